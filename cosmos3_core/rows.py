"""Rows: what one request contributes to a denoise step, and the one function that builds it.

`denoise_step_row` is the only constructor of a `Row`. Every caller — the engine's tick, warmup, AR commit
passes, tests — gets rows from it, so a new input changes its signature and every caller. `segments_of` lays
rows out in a packed step (one segment per CFG branch). Imports nothing of the step, the scheduler or above.

Layouts:
  latents     [1, C, T, H, W] fp32 (the scheduler's sample; H, W in latent pixels)
  row tokens  [T*h*w, p*p*C] in the model dtype, token order (t, h, w), features (p_h, p_w, C);
              h = ceil(H/p), w = ceil(W/p): a grid that is not a patch multiple is zero-padded (and cropped back)
  velocity    [1, C, T, H, W] fp32, zero on clean (conditioning) frames
  sound       [T_s, sound_dim] in the model dtype (the sampler's [sound_dim, T_s] transposed), after the vision
              tokens in each branch's segment (text | vision | sound); every sound token is noisy and gets the
              row's timestep (the pipeline steps sound with a copy of the vision scheduler: the same t)
  sound velocity [sound_dim, T_s] fp32
  action      [T_a, action_dim] in the model dtype (the sampler's [chunk, action_dim]), after the sound tokens
              (text | vision | sound | action); all noisy at the row's timestep (policy, inverse dynamics) or all
              clean (forward dynamics: no timestep embedding, zero velocity); `action_domain` picks the row of the
              domain-aware linears every one of them goes through
  action velocity [T_a, action_dim] fp32, zero on clean tokens
  residual    [N + T_s + T_a, hidden] model dtype: a branch's GEN block-stack residual (output after the final
              norm minus input after the embedding), over its segment's tokens — what step caching (cache.py) reuses

Precision: `Row.a16` says how the row's FP8 layer linears run this step — W8A16 (True) or W8A8 — as the FP8 step
policy decides for its step (model/fp8.py); a model without FP8 linears ignores it. Rows of one tick may differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .kv_pool import PageList


@dataclass(frozen=True)
class Branch:
    """One CFG branch of a request: the K/V its tokens attend to before their own (text, then committed AR
    context frames, oldest first) and the rotary tables of its latent tokens."""

    prefix: tuple[PageList, ...]
    cos: torch.Tensor  # [N + T_s + T_a, head_dim]: vision, sound, then action positions
    sin: torch.Tensor  # [N + T_s + T_a, head_dim]


@dataclass(frozen=True)
class ActionBand:
    """A request's action tokens for one step (the row builder's input)."""

    latents: torch.Tensor  # [T_a, action_dim] fp32, as sampled
    domain: int  # the embodiment's row of the domain-aware linears
    noisy: bool  # policy / inverse dynamics: all noisy at the step's t; forward dynamics: all clean


@dataclass(frozen=True)
class Row:
    tokens: torch.Tensor  # [N, patch_latent_dim], model dtype
    sound: torch.Tensor  # [T_s, sound_dim] model dtype; T_s = 0 without sound
    timestep: float  # the step's timestep; its embedding goes to noisy tokens only
    noisy_mask: torch.Tensor  # [N + T_s + T_a] bool (sound tokens: all True)
    token_shape: tuple[int, int, int]  # (T, h, w) patches
    latent_hw: tuple[int, int]  # (H, W) latent pixels; h*p, w*p when the grid needed no padding
    branches: tuple[Branch, ...]  # (cond,) or (cond, uncond)
    commit: bool  # return the tokens' K/V instead of a velocity
    action: torch.Tensor  # [T_a, action_dim] model dtype; T_a = 0 without actions
    # per branch: None runs the branch in the packed forward; a residual skips its block stack (no segment)
    reuse: tuple[torch.Tensor | None, ...]
    record: bool  # return the block-stack residual of each branch that runs (a cached request's)
    action_domain: int = 0
    a16: bool = True  # FP8 linears: W8A16 this step (False: W8A8); ignored by 16-bit models
    lora: tuple[int, float] | None = None  # its adapter: (pool slot, scale), model/lora.py; None: the base model


@dataclass(frozen=True)
class Segment:
    start: int
    length: int
    prefix: tuple[PageList, ...]
    collect_kv: bool
    sound: int = 0  # the `sound` tokens before the action tokens are sound tokens
    action: int = 0  # the last `action` of the `length` tokens are action tokens


@dataclass
class RowOutput:
    velocity: list[torch.Tensor]  # per branch [1, C, T, H, W] fp32; empty for a commit row
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # commit rows: per branch (k, v) [layers, N, kv_heads, d]
    sound_velocity: list[torch.Tensor] = field(default_factory=list)  # per branch [sound_dim, T_s] fp32
    action_velocity: list[torch.Tensor] = field(default_factory=list)  # per branch [T_a, action_dim] fp32
    residual: list[torch.Tensor | None] = field(default_factory=list)  # record rows: per branch, None if reused


def patchify(latents: torch.Tensor, p: int) -> torch.Tensor:
    """[1, C, T, H, W] → [T*ceil(H/p)*ceil(W/p), p*p*C], H and W zero-padded up to multiples of p."""
    _, c, t, h, w = latents.shape
    x = torch.nn.functional.pad(latents[0], (0, -w % p, 0, -h % p))
    x = x.reshape(c, t, x.shape[2] // p, p, x.shape[3] // p, p)
    return torch.einsum("cthpwq->thwpqc", x).reshape(-1, p * p * c)


def unpatchify(
    tokens: torch.Tensor, token_shape: tuple[int, int, int], p: int, latent_hw: tuple[int, int]
) -> torch.Tensor:
    """[T*h*w, p*p*C] → [1, C, T, H, W]: the patch grid cropped back to the latent size."""
    t, h, w = token_shape
    x = tokens.reshape(t, h, w, p, p, -1)
    x = torch.einsum("thwpqc->cthpwq", x).reshape(1, -1, t, h * p, w * p)
    return x[..., : latent_hw[0], : latent_hw[1]]


def denoise_step_row(
    latents: torch.Tensor,
    timestep: float,
    noisy_frames: torch.Tensor,
    branches: tuple[Branch, ...],
    patch: int,
    dtype: torch.dtype,
    commit: bool = False,
    sound_latents: torch.Tensor | None = None,
    action: ActionBand | None = None,
    a16: bool = True,
    reuse: tuple[torch.Tensor | None, ...] = (),
    record: bool = False,
    lora: tuple[int, float] | None = None,
) -> Row:
    """Build one request's input to a denoise step.

    latents [1, C, T, H, W] (any dtype; cast to the model dtype), `timestep` the scheduler's t for this step
    (applied to the frames in `noisy_frames`), `branches` per CFG branch. `commit`: an AR commit pass over
    clean latents — no noisy frames, no timestep; the step returns the tokens' K/V. `sound_latents`
    [sound_dim, T_s] (fp32, as sampled): the request's sound band, every token noisy at `timestep`. `action`: its
    action band. The branches' rotary tables cover N + T_s + T_a positions. `a16`: the FP8 step policy's precision
    for this step (W8A16; False: W8A8). `reuse`: per branch, the block-stack residual to reuse instead of running it
    ([N + T_s + T_a, hidden]) or None; () runs every branch. `record`: the step returns the residual of each branch
    it runs. `lora`: the request's adapter, (its slot in the adapter pool, its scale), or None."""
    if commit and (len(noisy_frames) or sound_latents is not None or action is not None):
        raise ValueError("a commit row has no noisy frames, no sound and no actions")
    reuse = reuse or (None,) * len(branches)
    if len(reuse) != len(branches) or (commit and any(r is not None for r in reuse)):
        raise ValueError("reuse: one entry per branch, and a commit row reuses nothing")
    _, _, t, h, w = latents.shape
    token_shape = (t, -(-h // patch), -(-w // patch))
    per_frame = token_shape[1] * token_shape[2]
    frame_is_noisy = torch.zeros(t, dtype=torch.bool, device=latents.device)
    frame_is_noisy.index_fill_(0, noisy_frames, True)  # a Python value: no host-to-device copy (a sync)
    noisy_mask = frame_is_noisy.repeat_interleave(per_frame)
    sound = latents.new_zeros(0, 0, dtype=dtype) if sound_latents is None else sound_latents.t().to(dtype)
    if len(sound):
        noisy_mask = torch.cat([noisy_mask, noisy_mask.new_ones(len(sound))])
    acts = latents.new_zeros(0, 0, dtype=dtype) if action is None else action.latents.to(dtype)
    if action is not None:  # one value for the whole band: a fill, no host-to-device copy
        noisy_mask = torch.cat([noisy_mask, noisy_mask.new_full((len(acts),), action.noisy)])
    return Row(
        tokens=patchify(latents.to(dtype), patch),
        sound=sound,
        timestep=0.0 if commit else float(timestep),
        noisy_mask=noisy_mask,
        token_shape=token_shape,
        latent_hw=(h, w),
        branches=branches,
        commit=commit,
        action=acts,
        action_domain=0 if action is None else action.domain,
        reuse=reuse,
        record=record,
        a16=a16,
        lora=lora,
    )


SEGMENT_ALIGN = 64  # rows; see segments_of


def segments_of(rows: list[Row]) -> tuple[list[Segment], int]:
    """One segment per CFG branch that runs (not reused), each starting at a multiple of SEGMENT_ALIGN rows (zero
    padding after it) → (segments, total rows). Aligned segments see the same GEMM blocking whatever they are packed
    with, so a request's result does not depend on its neighbours (bit for bit on CPU); padding rows never reach
    attention."""
    segments, start = [], 0
    for row in rows:
        s, a = row.sound.shape[0], row.action.shape[0]
        n = row.tokens.shape[0] + s + a
        for br, reuse in zip(row.branches, row.reuse):
            if reuse is not None:
                continue
            segments.append(Segment(start, n, br.prefix, row.commit, s, a))
            start += -(-n // SEGMENT_ALIGN) * SEGMENT_ALIGN
    return segments, start
