"""The GPU memory plan of a deployment: what each part holds at its peak, sized before anything loads.

A server is four processes on one card: the prefill stub (UND tower, VAE encoder, text guardrail), the denoise stub
(GEN tower, K/V pool, the packed step's activations), the decode stub (VAE decoder, video guardrail) and
tritonserver itself. `plan(deployment, config, card_bytes)` sizes every entry from the checkpoint's configs (weights
are counted on the meta device, exactly) and the deployment's limits (the largest request they admit), resolves
`pool_pages: auto`, `max_step_rows: auto` and the decoder's latent frames per call, and says whether the whole fits
`gpu_memory_utilization` of the card. The server refuses to load on a plan that does not fit, with `verdict()`'s
text (what to change, by how much); `python -m cosmos3_core.tools.plan` prints the same without a GPU.

Activations are per-row (step) and per-pixel (decoder, encoder) coefficients measured on an H100 with the allocator's
own peak (`bench/memory.py` checks them); weights, K/V pages and Triton's CUDA pool are counted exactly.
Sizes are bytes; the table prints GiB.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .caches import memo_json
from .from_diffusers import from_diffusers
from .model.checkpoint import stored_fp8_linears, weight_files
from .model.config import ModelConfig
from .model.fp8 import layer_linear_names
from .model.layers import GEN, UND, Cosmos3Transformer
from .model.towers import MLP_CHUNK_ROWS
from .windows import latent_frames

GIB = 1 << 30
MIB = 1 << 20
PARTS = ("prefill", "denoise", "vae_decode", "server")

# a CUDA context with torch, cuBLAS and cuDNN loaded, per process (nvidia-smi's share of a stub that allocated nothing)
CONTEXT_BYTES = 600 * MIB
# tritonserver's own process apart from its CUDA pool (its context, the Python backend's bookkeeping): H100,
# nvidia-smi, 1.13 GiB with a 640 MiB pool
SERVER_BYTES = 520 * MIB
# the denoise step's memory per packed row, in units of hidden × dtype bytes, with the MLP run in row chunks
# (towers.gen_forward: the residual stream, its normed copy, q/k/v, the attention output, the gathered own K/V), as
# the default caching allocator reserves it. H100 (bench.memory, Nano, compiled kernels): live peaks 2.02 / 3.52 /
# 5.01 GiB at 24,180 / 57,040 / 88,320 rows (6.3 copies), reserved 2.33 / 4.63 (graphs included) / 7.88 GiB: the
# blocks of the chunks' sizes the allocator keeps apart (10 copies fits the largest). With expandable segments (the
# default since) the 88,320-row step reserves 5.15 GiB alone, but a served nano.yaml's denoise part (eager step,
# captured layouts, workspaces) measured 0.96 of its plan at 10 copies (H100, 2b7ef9d): kept until the served
# layouts are measured apart
STEP_HIDDEN_COPIES = 10.0
MLP_INTERMEDIATE_COPIES = 1.0  # what a chunk's [rows, intermediate] tensors add (the compiled kernels fuse the rest)
STEP_FIXED_BYTES = 400 * MIB  # FlashInfer's workspace, cuBLAS's, the step's small buffers
GRAPH_POOL_SHARE = 0.3  # the CUDA graphs' pool beside the eager step, a share of its step (H100: 2.02 → 2.33 GiB)
# the VAE decoder's workspace per call: bytes per output pixel of one latent frame (4 video frames), and the share
# each further latent frame in the same call adds (a call's activations grow less than linearly with its frames)
# (H100, compiled kernels: 2.78 / 6.39 / 11.35 GiB at 832x480 / 1280x720 / 1280x1280, 2.56x that with 4 frames)
DECODE_BYTES_PER_PIXEL = 7500
DECODE_EXTRA_FRAME = 0.52
# served, a stream of one-latent-frame calls (frames above 832x480) reserves more than one call's live peak above:
# nano.yaml's vae_decode through 1280x720x189 and 944x976x189 requests reserved 10.04 GiB with its 1.03 GiB of
# weights (H200, expandable segments, torch's peak-reserved gauge; 10.79 GiB by nvidia-smi), 1.40x the call's 6.44
DECODE_ONE_FRAME_SERVED_FACTOR = 1.4
MAX_DECODE_FRAMES_PER_CALL = 4
# frames up to this size decode 4 latent frames a call (faster there: H100, 832x480, 0.038 s a latent frame against
# 0.07 s one at a time); larger ones 1 (1280x720: 0.075 s against 0.089 s, and 6.4 GiB against 16.4)
FOUR_FRAMES_MAX_PIXELS = 832 * 480
# a decoder stream's causal state: every causal conv's last 2 input frames, per output pixel of a frame (bf16 Wan2.2,
# counted on its config); kept from a stream's first piece to its last, and for a kept session until it ends
STREAM_STATE_BYTES_PER_PIXEL = 3600
# live streams the plan holds decoder state for on the GPU (one at the largest frame, the rest at the default size):
# requests whose pieces decode at once, as c=4 packs them; the state of more waits in host memory between pieces
MAX_STREAMS_PLANNED = 4
# eager kernels (compile: false) keep more of each op's output alive: the decoder at 1280x720, 4 frames a call,
# took 22 GiB eager against 14 GiB compiled (H100); the step is taken to grow alike
EAGER_FACTOR = 1.6
# frames larger than this decode in row bands (model/wan_decoder.py BandedStream), each a call of at most this size
BAND_ABOVE_PIXELS = 1280 * 720
BAND_HALO_ROWS = 8  # = BandedStream.HALO_ROWS
# the VAE encoder's workspace per input pixel of one frame (H100: 2.01 GiB at 1280x1280); a clip's first 1 + 4 frames
# (H100: 1.62 / 3.71 / 6.57 GiB at 832x480 / 1280x720 / 1280x1280)
ENCODE_BYTES_PER_PIXEL = 1400
ENCODE_CLIP_FACTOR = 3.15
UND_PASS_BYTES = 320 * MIB  # the UND tower over max_prompt_tokens, both branches (H100: 0.30 GiB at 1024 tokens)
# NVIDIA's guardrail (safety.py, cosmos_guardrail 0.3.2): Qwen3Guard-0.6B in prefill; RetinaFace and the video
# content filter in decode (3.9 GiB for both, measured on the H200)
GUARDRAIL_BYTES = {"prefill": 1600 * MIB, "vae_decode": 2300 * MIB}


class PlanError(ValueError):
    """A deployment whose plan does not fit its card; the text says what to change."""


@dataclass(frozen=True)
class Entry:
    part: str  # prefill | denoise | vae_decode | server
    kind: str  # weights | kv_pool | step | workspace | guardrail | context | cuda_pool
    bytes: int
    what: str  # how it was sized


@dataclass(frozen=True)
class Largest:
    """The largest request the limits admit, as the denoise step and the decoder see it."""

    height: int
    width: int
    frames: int
    rows: int  # packed rows of its step, both CFG branches
    frame_height: int  # the largest frame the limits admit (a 1-frame request's): the decoder's and encoder's
    frame_width: int

    @property
    def frame_pixels(self) -> int:
        return self.frame_height * self.frame_width

    def warmup_request(self, limits) -> dict:  # limits: requests.Limits
        """A 2-step request of this size, with CFG (memory is claimed at load: `Deployment.planned`)."""
        return {"height": self.height, "width": self.width, "num_frames": self.frames,
                "steps": min(2, limits.max_steps), "guidance_scale": min(6.0, limits.max_guidance)}  # fmt: skip


@dataclass(frozen=True)
class MemoryPlan:
    entries: tuple[Entry, ...]
    card_bytes: int  # the card's memory; 0: unknown (the verdict then only sizes)
    utilization: float
    pool_pages: int
    max_step_rows: int
    largest: Largest
    decode_budget: int  # the decoder's workspace at its largest call (`decode_budget`)
    spatial: int  # output pixels per latent pixel, per axis (the VAE's spatial factor)
    notes: tuple[str, ...] = field(default_factory=tuple)
    # decoder streams whose causal state the plan holds on the GPU (one at the largest frame, the rest at the default
    # size), and those streams' state in bytes: the decoder parks the state of the least recently decoded streams
    # beyond those bytes in host memory until their next piece (stages.DecodeStage)
    decode_streams: int = MAX_STREAMS_PLANNED
    decode_state_bytes: int = 0
    state_itemsize: int = 2  # the decoder's dtype

    def decoder_state_bytes(self, h: int, w: int) -> int:
        """One decoder stream's causal state at latent grid (h, w) (`stream_state_bytes`)."""
        return stream_state_bytes(h, w, self.spatial, self.state_itemsize)

    def part_bytes(self, part: str) -> int:
        return sum(e.bytes for e in self.entries if e.part == part)

    @property
    def total(self) -> int:
        return sum(e.bytes for e in self.entries)

    @property
    def budget(self) -> int:
        return int(self.card_bytes * self.utilization)

    @property
    def fits(self) -> bool:
        return not self.card_bytes or self.total <= self.budget

    def decode_frames_per_call(self, h: int, w: int) -> int:
        """Latent frames per decoder call for a latent grid (h, w) (a band's rows, halo included)."""
        return decode_frames_per_call(h * w * self.spatial**2)

    def decode_warmup_sizes(self) -> list[tuple[int, int]]:
        """(height, width) of the frames whose decode reaches the decoder's budget: the largest admitted one, and
        the 4-frames-a-call size when the limits admit it."""
        big = self.largest
        sizes = [(big.frame_height, big.frame_width)]
        if big.frame_pixels > FOUR_FRAMES_MAX_PIXELS:
            sizes.append((480, 832))
        return sizes

    def decode_band_rows(self, h: int, w: int) -> int:
        """Latent rows per band of a frame of latent grid (h, w) (`plan_band_rows`)."""
        return plan_band_rows(h, w, self.spatial)

    def table(self) -> str:
        lines = [f"{'part':<11} {'kind':<10} {'GiB':>7}  what"]
        for part in PARTS:
            for e in (e for e in self.entries if e.part == part):
                lines.append(f"{e.part:<11} {e.kind:<10} {e.bytes / GIB:7.2f}  {e.what}")
            lines.append(f"{part:<11} {'(part)':<10} {self.part_bytes(part) / GIB:7.2f}")
        card = f" of {self.budget / GIB:.1f} GiB ({self.utilization:g} × {self.card_bytes / GIB:.1f} GiB card)"
        lines.append(f"{'total':<22} {self.total / GIB:7.2f}{card if self.card_bytes else ''}")
        return "\n".join(lines + list(self.notes))

    def verdict(self) -> str:
        """One paragraph: fits, or by how much it does not and what would make it fit."""
        if not self.card_bytes:
            return f"plan: {self.total / GIB:.1f} GiB in all (no card given: pass --gpu-memory GIB to check a fit)"
        if self.fits:
            return f"plan: {self.total / GIB:.1f} GiB fits {self.budget / GIB:.1f} GiB (gpu_memory_utilization)"
        over = self.total - self.budget
        return (
            f"memory plan: {self.total / GIB:.1f} GiB does not fit {self.budget / GIB:.1f} GiB "
            f"({self.utilization:g} of the {self.card_bytes / GIB:.1f} GiB card): {over / GIB:.1f} GiB over. "
            + " ".join(self._advice(over))
        )

    def _advice(self, over: int) -> list[str]:
        out = []
        towers = [e for e in self.entries if e.kind == "weights" and e.part in ("prefill", "denoise")]
        if not any("fp8" in e.what for e in towers):  # the layer linears, most of each tower, halve
            out.append(f"precision: fp8 saves ~{sum(e.bytes for e in towers) * 0.45 / GIB:.1f} GiB of weights.")
        pool = next(e for e in self.entries if e.kind == "kv_pool")
        page = pool.bytes // max(self.pool_pages, 1)
        least = 2 * -(-1024 // 16)  # one prompt of 1024 tokens, both branches
        if page and self.pool_pages > least:
            fewer = min(self.pool_pages - least, -(-over // page))
            out.append(
                f"pool_pages: {self.pool_pages - fewer} (from {self.pool_pages}) saves {fewer * page / GIB:.1f} GiB."
            )
        step = next(e for e in self.entries if e.kind == "step")
        if step.bytes:
            fit = self.max_step_rows - -(-over * self.max_step_rows // step.bytes)
            out.append(
                f"limits (max_pixel_frames, max_height, max_width, max_frames) or max_step_rows: the step holds "
                f"{self.max_step_rows} rows ({step.bytes / GIB:.1f} GiB)"
                + (f"; {fit} rows would fit." if fit >= 64 else ": the step alone cannot make it fit.")
            )
        out.append("Or gpu_memory_utilization, if the card holds nothing else.")
        return out


def plan_band_rows(h: int, w: int, spatial: int) -> int:
    """Latent rows per band of a frame of latent grid (h, w): h up to BAND_ABOVE_PIXELS, else the most whose band
    (with its halo, `BandedStream.HALO_ROWS` each side) is at most that."""
    row = w * spatial * spatial
    if h * row <= BAND_ABOVE_PIXELS:
        return h
    return max(1, min(h, BAND_ABOVE_PIXELS // row - 2 * BAND_HALO_ROWS))


def stream_state_bytes(h: int, w: int, spatial: int, itemsize: int) -> int:
    """The causal state one decoder stream keeps between its pieces at latent grid (h, w): every causal conv's last
    2 input frames (STREAM_STATE_BYTES_PER_PIXEL an output pixel in bf16), over each band of a banded frame with its
    halos."""
    band = plan_band_rows(h, w, spatial)
    rows = h if band >= h else -(-h // band) * (band + 2 * BAND_HALO_ROWS)
    return STREAM_STATE_BYTES_PER_PIXEL * itemsize // 2 * rows * w * spatial * spatial


def decode_workspace(pixels: int, frames: int) -> int:
    """The decoder's activations for one call over `frames` latent frames of `pixels` output pixels each."""
    return int(DECODE_BYTES_PER_PIXEL * pixels * (1 + DECODE_EXTRA_FRAME * (frames - 1)))


def decode_frames_per_call(pixels: int) -> int:
    """Latent frames a decoder call takes at `pixels` output pixels a frame: 4 (every kernel busy) up to
    FOUR_FRAMES_MAX_PIXELS, else 1, diffusers' own pattern and bit-identical."""
    return MAX_DECODE_FRAMES_PER_CALL if pixels <= FOUR_FRAMES_MAX_PIXELS else 1


def decode_budget(largest_pixels: int) -> int:
    """The decoder's workspace for frames up to `largest_pixels`: its largest call, 4 latent frames at up to
    FOUR_FRAMES_MAX_PIXELS, or 1 at up to BAND_ABOVE_PIXELS (larger frames are banded to that), a stream of those
    reserving DECODE_ONE_FRAME_SERVED_FACTOR of it."""
    four = decode_workspace(min(largest_pixels, FOUR_FRAMES_MAX_PIXELS), MAX_DECODE_FRAMES_PER_CALL)
    if largest_pixels <= FOUR_FRAMES_MAX_PIXELS:
        return four
    one = decode_workspace(min(largest_pixels, BAND_ABOVE_PIXELS), 1) * DECODE_ONE_FRAME_SERVED_FACTOR
    return max(four, int(one))


def largest_request(cfg: ModelConfig, limits, extra_rows: int = 0) -> Largest:  # limits: requests.Limits
    """The admitted request with the most packed rows (both CFG branches, `extra_rows` of sound and actions each):
    over every frame count the limits allow (per window for AR) and every aligned width, the tallest aligned frame
    within max_pixel_frames, max_height and max_width (a latent grid that is not a multiple of the patch rounds up,
    so the most pixels is not always the most rows); and the largest frame of any admitted request, the decoder's
    and the encoder's."""
    align, t = cfg.pixel_alignment, cfg.vae_scale_temporal
    best: tuple[int, int, int, int] | None = None  # rows, height, width, frames
    frame_area = limits.max_frame_pixels or limits.max_height * limits.max_width
    for frames in range(1, limits.max_frames + 1, t):
        area = min(limits.max_pixel_frames // frames, frame_area)
        for width in range(align, limits.max_width + 1, align):
            height = min(limits.max_height, area // width) // align * align
            if height < align:
                break
            gh, gw = cfg.token_grid(height, width)
            rows = 2 * (gh * gw * latent_frames(frames, t) + extra_rows)
            if best is None or rows > best[0]:
                best = (rows, height, width, frames)
    if best is None:
        raise ValueError("limits admit no request: max_pixel_frames is below one aligned frame")
    area = min(limits.max_pixel_frames, frame_area)
    frame_w = min(limits.max_width, area // align // align * align) // align * align
    frame_h = min(limits.max_height, area // frame_w) // align * align
    return Largest(best[1], best[2], best[3], best[0], frame_h, frame_w)


def extra_rows_per_branch(ckpt_root: Path, cfg: ModelConfig, limits) -> int:
    """The most sound and action rows a branch adds beside its video: sound at max_frames and the lowest fps (1),
    actions at max_chunk_size; none where the checkpoint has no such heads."""
    rows = limits.max_chunk_size if cfg.action_gen else 0
    if cfg.sound_gen:
        from .model.sound import SoundSpec

        try:
            rows += SoundSpec.open(ckpt_root).latent_shape(limits.max_frames, 1.0)[1]
        except (ValueError, OSError):  # no sound tokenizer: sound requests are refused
            pass
    return rows


def tower_bytes(
    cfg: ModelConfig, tower: str, dtype: torch.dtype, quantized: bool, stored_fp8: frozenset[str] = frozenset()
) -> int:
    """Bytes of one tower's parameters as loaded (counted on the meta device): its layer linears the checkpoint
    stores in E4M3 (`stored_fp8`, `stored_fp8_linears`: one byte a weight, a tensorwise weight and input scale), the
    other layer linears quantized at load when `quantized` (`precision: fp8`: one byte a weight and an fp32 scale per
    output channel) or 16-bit, the rest 16-bit but the timestep embedder, fp32."""
    with torch.device("meta"):
        model = Cosmos3Transformer(cfg, frozenset({tower}))
    linears = set(layer_linear_names(model))
    total = 0
    for name, p in model.named_parameters():
        module = name.removesuffix(".weight")
        if module in linears and module in stored_fp8:
            total += p.numel() + 2 * 4
        elif module in linears and quantized:
            total += p.numel() + p.shape[0] * 4
        elif name.startswith("time_embedder."):
            total += p.numel() * 4
        else:
            total += p.numel() * dtype.itemsize
    return total


def vae_bytes(vae_config: dict, dtype: torch.dtype) -> tuple[int, int]:
    """(encoder, decoder) parameter bytes of the checkpoint's AutoencoderKLWan (quant_conv with the encoder,
    post_quant_conv with the decoder)."""
    encoder, decoder = _vae_params(json.dumps(vae_config, sort_keys=True))
    return encoder * dtype.itemsize, decoder * dtype.itemsize


@functools.lru_cache(maxsize=8)
def _vae_params(vae_config: str) -> tuple[int, int]:
    """(encoder, decoder) parameter counts, counted once per config on this machine (`caches.memo_json`):
    diffusers' autoencoders package takes seconds to import, which a part that runs no VAE (denoise) or a reload
    would pay for the plan alone."""

    def count() -> list[int]:
        with torch.device("meta"):  # seconds for Wan2.2's
            vae = from_diffusers("AutoencoderKLWan").from_config(json.loads(vae_config))
        return [sum(p.numel() for m in halves for p in m.parameters())
                for halves in ((vae.encoder, vae.quant_conv), (vae.decoder, vae.post_quant_conv))]  # fmt: skip

    encoder, decoder = memo_json("vae-params", vae_config, count)
    return int(encoder), int(decoder)


def page_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    """One K/V pool page: K and V of `page_size` tokens in every layer (kv_pool.py)."""
    return 2 * cfg.num_hidden_layers * page_size * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize


def step_bytes(cfg: ModelConfig, rows: int, dtype: torch.dtype) -> int:
    """The packed step's activations at `rows` rows (gen_forward with its MLP in chunks of MLP_CHUNK_ROWS)."""
    hidden = STEP_HIDDEN_COPIES * rows * cfg.hidden_size
    mlp = MLP_INTERMEDIATE_COPIES * min(rows, MLP_CHUNK_ROWS) * cfg.intermediate_size
    return int((hidden + mlp) * dtype.itemsize) + STEP_FIXED_BYTES


# the share of the host's memory that decoder states waiting there (parked streams, kept sessions) may pin; torch
# keeps freed pinned blocks for reuse and rounds each up to a power of two, so the process pins up to ~2× this
PINNED_HOST_SHARE = 1 / 8


def pinned_host_bytes() -> int:
    """How many bytes of decoder state may wait in pinned host memory: PINNED_HOST_SHARE of the host's memory, or of
    this container's limit (cgroup v2 `memory.max`) when that is lower; beyond it, states wait in pageable memory."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        total = min(total, int(limit)) if limit.isdigit() else total
    except OSError:
        pass
    return int(total * PINNED_HOST_SHARE)


def card_bytes(device: str = "cuda") -> int:
    """The memory of the card a deployment on `device` serves on (the first visible GPU); 0 off CUDA."""
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return 0
    return torch.cuda.get_device_properties(0).total_memory


def plan(d, ckpt_root: str | Path, cfg: ModelConfig, card: int) -> MemoryPlan:  # d: deployment.Deployment
    """The deployment's plan on a card of `card` bytes (0: size only, no verdict)."""
    dtype = d.torch_dtype
    quantized = d.precision == "fp8"  # the 16-bit layer linears are quantized at load
    stored = stored_fp8_linears(weight_files(Path(ckpt_root))) if _fp8_checkpoint(Path(ckpt_root)) else frozenset()
    fp8 = "fp8 linears, " if quantized or stored else ""
    label = f"{fp8}{str(dtype).removeprefix('torch.')}"
    vae_config = json.loads((Path(ckpt_root) / "vae" / "config.json").read_text())
    encoder, decoder = vae_bytes(vae_config, dtype)
    largest = largest_request(cfg, d.limits, extra_rows_per_branch(Path(ckpt_root), cfg, d.limits))
    eager = 1.0 if d.compile else EAGER_FACTOR
    entries: list[Entry] = []
    notes: list[str] = []
    n_pre, n_den = d.instances["prefill"], d.instances["denoise"]

    def add(part: str, kind: str, nbytes: int, what: str, times: int = 1) -> None:
        entries.append(Entry(part, kind, int(nbytes) * times, what + (f" × {times} instances" if times > 1 else "")))

    guard = d.safety_checker != "none"
    # prefill: the UND tower, the VAE's encoder, the text guardrail; activations: its largest conditioning encode
    add(
        "prefill",
        "weights",
        tower_bytes(cfg, UND, dtype, quantized, stored) + encoder,
        f"UND tower ({label}) + VAE encoder",
        n_pre,
    )
    enc_pixels = largest.frame_pixels  # conditioning frames are resized to the request's size
    add("prefill", "workspace", max(ENCODE_BYTES_PER_PIXEL * ENCODE_CLIP_FACTOR * enc_pixels, UND_PASS_BYTES),
        f"VAE encode of a {largest.frame_width}x{largest.frame_height} clip's first 1 + 4 frames", n_pre)  # fmt: skip
    if guard:
        add("prefill", "guardrail", GUARDRAIL_BYTES["prefill"], "text guardrail (Qwen3Guard)", n_pre)
    add("prefill", "context", CONTEXT_BYTES, "CUDA context", n_pre)

    # denoise: the GEN tower, the step at max_step_rows, the K/V pool from what is left
    rows = largest.rows if d.max_step_rows == "auto" else int(d.max_step_rows)
    if rows < largest.rows:
        notes.append(f"max_step_rows {rows} is below the largest admitted request's {largest.rows} rows: "
                     "such a request is refused at submit")  # fmt: skip
    add("denoise", "weights", tower_bytes(cfg, GEN, dtype, quantized, stored), f"GEN tower ({label})", n_den)
    step = step_bytes(cfg, rows, dtype) * eager
    if d.lora_dir:  # a pack with adapters runs each layer's MLP whole (model/towers.py): its [rows, intermediate] three
        step += 3 * max(rows - MLP_CHUNK_ROWS, 0) * cfg.intermediate_size * dtype.itemsize
    add("denoise", "step", step,
        f"packed step of {rows} rows (largest admitted: {largest.width}x{largest.height}x{largest.frames}, CFG)", n_den)  # fmt: skip
    # step caching (SeaCache, any request may ask): the last two block-stack residuals of every running branch
    add("denoise", "cache", 2 * rows * cfg.hidden_size * dtype.itemsize, "SeaCache residuals (2 per branch)", n_den)
    graphs = d.torch_device.startswith("cuda") and d.cuda_graphs and d.max_captures
    captured = min(rows, d.max_capture_rows or rows) if graphs else 0
    if captured:  # the graphs' shared pool holds the largest captured layout's activations beside the eager ones
        add("denoise", "graphs", GRAPH_POOL_SHARE * step_bytes(cfg, captured, dtype) * eager,
            f"CUDA graph pool (layouts ≤ {captured} rows)", n_den)  # fmt: skip
    add("denoise", "context", CONTEXT_BYTES, "CUDA context", n_den)

    # decode: the decoder, its workspace at the largest call (a frame up to 1280x720, one latent frame a call;
    # larger frames in row bands of that size), the video guardrail
    budget = decode_budget(largest.frame_pixels)
    banded = " in row bands" if largest.frame_pixels > BAND_ABOVE_PIXELS else ""
    add("vae_decode", "weights", decoder, f"VAE decoder ({str(dtype).removeprefix('torch.')})")
    add("vae_decode", "workspace", budget * eager, f"its largest call (4 latent frames at 832x480, 1 at 1280x720; "
        f"largest frame {largest.frame_width}x{largest.frame_height}{banded})")  # fmt: skip
    # live streams' causal state beyond the workspace's own: the workspace was measured over a whole stream, so it
    # holds the state of the rows its call decodes; a banded stream also keeps its other bands' (halos included),
    # and the other live streams theirs, at the default size
    state = STREAM_STATE_BYTES_PER_PIXEL * dtype.itemsize // 2
    s = cfg.vae_scale_spatial
    h, w = largest.frame_height // s, largest.frame_width // s
    band = plan_band_rows(h, w, s)
    call_rows = min(h, band + 2 * BAND_HALO_ROWS) if band < h else h
    largest_whole = stream_state_bytes(h, w, s, dtype.itemsize)  # each band with its halo
    largest_state = largest_whole - state * call_rows * w * s * s
    default_px = d.defaults.height * d.defaults.width
    gh, gw = cfg.token_grid(d.defaults.height, d.defaults.width)
    default_rows = 2 * gh * gw * latent_frames(d.defaults.num_frames, cfg.vae_scale_temporal)
    streams = max(1, min(MAX_STREAMS_PLANNED, rows // max(default_rows, 1)))
    # (a kept session's state waits in host memory: `StreamDecoder.move_state`)
    if largest_state or streams > 1:
        add("vae_decode", "streams", largest_state + state * default_px * (streams - 1),
            f"decoder state beyond the call's own: the largest frame's other bands, {streams - 1} more live "
            f"streams at {d.defaults.width}x{d.defaults.height}")  # fmt: skip
    if guard:
        add("vae_decode", "guardrail", GUARDRAIL_BYTES["vae_decode"], "video guardrail (RetinaFace, content filter)")
    add("vae_decode", "context", CONTEXT_BYTES, "CUDA context")

    add("server", "context", SERVER_BYTES, "tritonserver")
    add("server", "cuda_pool", cuda_pool_bytes(d, cfg), "Triton's CUDA memory pool (text K/V between stages)")

    page = page_bytes(cfg, d.page_size, dtype)
    need_pages = max_prompt_pages(cfg, d)
    if d.pool_pages == "auto":
        left = int(card * d.gpu_memory_utilization) - sum(e.bytes for e in entries) if card else 0
        pages = max(need_pages, min(left // (page * n_den), max_pool_pages(cfg, d))) if card else max_pool_pages(cfg, d)
        how = "auto: what the card leaves" if card else "auto (no card: sized for max_queue requests)"
    else:
        pages, how = int(d.pool_pages), "pool_pages"
    if pages < need_pages:
        notes.append(f"pool_pages {pages} is below one largest prompt's {need_pages} pages")
    entries.insert(
        [i for i, e in enumerate(entries) if e.part == "denoise"][-1],
        Entry("denoise", "kv_pool", page * pages * n_den, f"{pages} pages of {d.page_size} tokens ({how})"),
    )
    state_on_gpu = largest_whole + state * default_px * (streams - 1)
    return MemoryPlan(tuple(entries), card, d.gpu_memory_utilization, pages, rows, largest, budget,
                      cfg.vae_scale_spatial, tuple(notes), streams, state_on_gpu, dtype.itemsize)  # fmt: skip


def max_prompt_pages(cfg: ModelConfig, d) -> int:
    """Pages of one request's text K/V at max_prompt_tokens, both CFG branches: the least a pool must hold."""
    return 2 * -(-d.limits.max_prompt_tokens // d.page_size)


def max_pool_pages(cfg: ModelConfig, d) -> int:
    """What `pool_pages: auto` never goes beyond: max_queue requests' text at max_prompt_tokens, and one kv stream's
    context at the default size (context_frames of both CFG branches: kv streams keep their committed K/V)."""
    text = d.max_queue * max_prompt_pages(cfg, d)
    gh, gw = cfg.token_grid(d.defaults.height, d.defaults.width)
    frames = latent_frames(d.defaults.context_frames or d.limits.max_frames, cfg.vae_scale_temporal)
    return text + 2 * frames * -(-gh * gw // d.page_size)


def cuda_pool_bytes(d, cfg: ModelConfig) -> int:
    """Triton's CUDA pool for a deployment that serves on the GPU (0 on the CPU), a multiple of 64 MiB: room for
    the largest `text_kv` in each prefill instance's output and each denoise instance's input at once, plus 64 MiB
    for the rest (latents, conditioning). Triton's default, 64 MiB, holds no Nano K/V (70 MB at a 473-token
    prompt): such a tensor then crosses through host shared memory, slower."""
    if not d.torch_device.startswith("cuda"):
        return 0
    from .wire import max_text_kv_bytes

    kv = max_text_kv_bytes(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, d.torch_dtype.itemsize,
                           d.limits.max_prompt_tokens)  # fmt: skip
    need = (d.instances["prefill"] + d.instances["denoise"]) * kv + (64 << 20)
    return -(-need // (64 << 20)) * (64 << 20)


def _fp8_checkpoint(root: Path) -> bool:
    try:
        qc = json.loads((root / "transformer" / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError):
        return False
    return isinstance(qc, dict) and "FP8" in str(qc.get("quant_algo") or qc.get("quant_type") or "").upper()


def allocator_settings(expandable_segments: bool) -> str:
    """torch's CUDA allocator settings for a deployment (`PYTORCH_CUDA_ALLOC_CONF`'s form; a group's workers get it
    in their environment)."""
    return f"expandable_segments:{expandable_segments}"


def use_allocator(expandable_segments: bool) -> None:
    """This process's CUDA caching allocator, set before its first model loads (`Deployment.planned`). Expandable
    segments are never exported by CUDA IPC here: the Python backend's stub copies its GPU outputs into buffers
    that tritonserver allocates (python_backend: `pb_stub.cc` saves responses with `copy_gpu` false), and opens
    tritonserver's for its inputs."""
    settings = allocator_settings(expandable_segments)
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch ≥ 2.10; the older name warns there
    (setter or torch.cuda.memory._set_allocator_settings)(settings)


def in_use_bytes() -> int:
    """This process's share of the card: what torch's allocator reserves, plus a CUDA context."""
    return torch.cuda.memory_reserved() + CONTEXT_BYTES if torch.cuda.is_initialized() else 0  # 0: a CPU part


def release_cached() -> None:
    """After a part's load and warmup: the allocator's cached blocks go back to the card. The plan still holds them
    for the part (its requests grow back to the warmup's peak); the next part's warmup can use them meanwhile."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def peak_bytes() -> int:
    """The most of the card this process has held: torch's peak reserved memory, plus a CUDA context."""
    return torch.cuda.max_memory_reserved() + CONTEXT_BYTES if torch.cuda.is_initialized() else 0


def check(p: MemoryPlan) -> None:
    """Raise `PlanError` with the verdict when the plan does not fit."""
    if not p.fits:
        raise PlanError(p.verdict() + "\n" + p.table())
