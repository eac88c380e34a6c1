"""The two towers' computations, split for serving.

- `prefill_text_kv`: the UND tower over a text prefix, once per request and CFG branch → per-layer
  GEN-facing K (`k_norm_und_for_gen(norm_k(K))`, rotated) and V, `[layers, tokens, kv_heads, head_dim]`.
  Exact: UND tokens attend causally to text only, so this K/V never depends on the denoise step.
- `gen_forward`: the GEN tower over a packed step (many requests' rows, both CFG branches), attending to
  [text K/V from the pool | the segment's own tokens] → a `GenOutput`: `[rows, patch_latent_dim]` predictions,
  the sound and action rows' own, for step caching the block stack's residual, and a commit pass's K/V.
- `domain_linear`: a domain-aware linear with each row's embodiment weights gathered for that row.
- `embed_row` / `output_heads`: one row's GEN input and output heads alone — a branch that reuses a cached
  block-stack residual (cosmos3_core/cache.py) runs only these.
- `fused_reference`: the whole stack every step, as the reference model runs it. Tests only.

Precision (FP8 layer linears, `fp8.py`): every linear call takes `a16_rows` — rows [0, a16_rows) of its input run
W8A16, the rest W8A8; 16-bit linears ignore it. Prefill passes all rows or none (the reasoner policy); a packed GEN
step passes the pack's split (`PackedStep.a16_rows`: its W8A16 rows come first).

LoRA (model/lora.py): the layer linears also take the rows' `AdapterRows` (a packed step's `PackedStep.lora`;
prefill: the request's one adapter), None without adapters — then exactly the linears alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..precompiled import Precompiled
from .attend import Attend, sdpa
from .fp8 import Fp8Linear
from .layers import Cosmos3Transformer, DomainAwareLinear, Layer
from .lora import AdapterRows, adapted
from .rotary import apply_rotary


def _und_qkv(
    layer: Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, a16_rows: int, lora: AdapterRows | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """UND projections → q, k (for the causal text path), k_for_gen, v; each [T, heads, d]."""
    a = layer.self_attn
    h = layer.input_layernorm(x)
    d = cos.shape[-1]
    q = adapted(a.to_q, h, a16_rows, lora).unflatten(-1, (-1, d))  # [T, heads, d]
    k = adapted(a.to_k, h, a16_rows, lora).unflatten(-1, (-1, d))  # [T, kv_heads, d]
    v = adapted(a.to_v, h, a16_rows, lora).unflatten(-1, (-1, d))
    if hasattr(a, "norm_q"):
        q, k = a.norm_q(q), a.norm_k(k)
    k_for_gen = a.k_norm_und_for_gen(k) if hasattr(a, "k_norm_und_for_gen") else k
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), apply_rotary(k_for_gen, cos, sin), v


def _gen_qkv(
    layer: Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, a16_rows: int, lora: AdapterRows | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a = layer.self_attn
    d = cos.shape[-1]
    h = layer.input_layernorm_moe_gen(x)
    q = a.norm_added_q(adapted(a.add_q_proj, h, a16_rows, lora).unflatten(-1, (-1, d)))  # [N, heads, d]
    k = a.norm_added_k(adapted(a.add_k_proj, h, a16_rows, lora).unflatten(-1, (-1, d)))  # [N, kv_heads, d]
    v = adapted(a.add_v_proj, h, a16_rows, lora).unflatten(-1, (-1, d))
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def _und_residual(
    layer: Layer, x: torch.Tensor, attn: torch.Tensor, a16_rows: int, lora: AdapterRows | None = None
) -> torch.Tensor:
    x = x + adapted(layer.self_attn.to_out, attn, a16_rows, lora)  # attn [T, heads*d]
    return x + layer.mlp(layer.post_attention_layernorm(x), a16_rows, lora)


def _gen_residual(
    layer: Layer, x: torch.Tensor, attn: torch.Tensor, a16_rows: int, lora: AdapterRows | None = None
) -> torch.Tensor:
    x = x + adapted(layer.self_attn.to_add_out, attn, a16_rows, lora)  # attn [N, heads*d]
    return x + layer.mlp_moe_gen(layer.post_attention_layernorm_moe_gen(x), a16_rows, lora)


def embed_latent_tokens(
    model: Cosmos3Transformer,
    tokens: torch.Tensor,
    noisy_mask: torch.Tensor,
    timesteps: torch.Tensor,
    token_group: torch.Tensor | None = None,
) -> torch.Tensor:
    """tokens [N, patch_latent_dim], noisy_mask [N] bool, timesteps [G] fp32 (one per group of tokens: a packed
    segment), token_group [N] int64 (each token's group; None: one group) → [N, hidden].

    The timestep embedding is added to noisy tokens only; clean (conditioning) tokens get none. It is computed
    once per group, not per token: its two fp32 linears would otherwise cost a GEMM over every token."""
    x = model.proj_in(tokens)
    temb = model.time_embedder(timesteps * model.cfg.timestep_scale).to(x.dtype)
    temb = temb if token_group is None else temb[token_group]
    return x + torch.where(noisy_mask[:, None], temb, torch.zeros((), dtype=x.dtype, device=x.device))


def domain_linear(layer: DomainAwareLinear, x: torch.Tensor, domain: torch.Tensor) -> torch.Tensor:
    """x [R, in], domain [R] int64 → [R, out]: each row through its own domain's matrix and bias, as diffusers'
    `DomainAwareLinear` computes it (one [1, in] @ [in, out] per row, so a row's result never depends on the rows
    packed with it, whatever their domains)."""
    w = layer.fc(domain).view(-1, layer.in_features, layer.out_features)  # [R, in*out] → [R, in, out]
    return torch.bmm(x.unsqueeze(1), w).squeeze(1) + layer.bias(domain)  # [R, 1, in] @ [R, in, out] → [R, out]


@torch.inference_mode()
def prefill_text_kv(
    model: Cosmos3Transformer,
    input_ids: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    a16: bool = True,
    lora: AdapterRows | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [T], cos/sin [T, d] → (k, v) [layers, T, kv_heads, d] in the model dtype. `a16`: FP8 linears run
    W8A16 (False: W8A8), the reasoner policy's choice. `lora`: the request's adapter (one group of T rows)."""
    x = model.embed_tokens(input_ids)
    rows = x.shape[0] if a16 else 0
    ks, vs = [], []
    last = len(model.layers) - 1
    for i, layer in enumerate(model.layers):
        q, k, k_for_gen, v = _und_qkv(layer, x, cos, sin, rows, lora)
        ks.append(k_for_gen)
        vs.append(v)
        if i < last:  # the last layer's UND output feeds only the LM head, which generation never reads
            x = _und_residual(layer, x, sdpa(q, k, v, causal=True), rows, lora)
    return torch.stack(ks), torch.stack(vs)


@dataclass(frozen=True)
class GenKernels:
    """The per-layer GEN computations around attention: eager, or compiled once for every layer and every
    packed size (`torch.compile(dynamic=True)`; modules are inlined, so one graph serves all layers)."""

    qkv: Callable = _gen_qkv
    residual: Callable = _gen_residual

    @classmethod
    def compiled(cls, model: torch.nn.Module, store: Path | None = None) -> GenKernels:
        """`store`: the folder of their artifacts compiled ahead (`precompiled.py`; `caches.precompiled_dir()`), so a
        restarted process loads the two graphs instead of tracing them (most of a denoise reload's warmup), when
        `model`'s layer linears are all 16-bit: they ignore `a16_rows`, which then takes no part in the signature
        (an FP8 model's split varies with every pack: traced). A pack with adapters is traced. None: all traced."""
        qkv, residual = torch.compile(_gen_qkv, dynamic=True), torch.compile(_gen_residual, dynamic=True)
        if store is None or any(isinstance(m, Fp8Linear) for m in model.modules()):
            return cls(qkv, residual)
        return cls(_ahead(_gen_qkv, store, qkv), _ahead(_gen_residual, store, residual))


def _rows_dynamic(args: list) -> list:
    """Each tensor argument's rows (axis 0) dynamic (`Precompiled` passes its own fresh views: the marks are theirs)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(a, 0)
    return args


def _ahead(fn: Callable, store: Path, traced: Callable) -> Callable:
    """`fn(layer, *tensors, a16_rows, lora)` of a 16-bit model through artifacts compiled ahead (`a16_rows` as 0);
    with adapters through `traced`. The artifacts depend on the modules of this package that `fn` calls into (all
    of model/ is hashed: an edit to any of them compiles the two graphs again, once)."""
    ahead = Precompiled(fn, [_rows_dynamic], store, traced, sources=Path(__file__).parent.glob("*.py"))

    def run(*args):
        if args[-1] is not None:  # adapters: their rows' groups
            return traced(*args)
        return ahead(*args[:-2], 0, None)

    return run


EAGER = GenKernels()


@dataclass
class GenOutput:
    """What one GEN pass over a packed step returns (`gen_forward`, `graphs.StepLayout.run`)."""

    preds: torch.Tensor  # [S, patch_latent_dim]: every row, clean ones too
    sound: torch.Tensor | None  # [R, sound_dim]: the sound rows' predictions (None: no sound in the pack)
    action: torch.Tensor | None  # [A, action_dim]: the action rows' (None: no actions in the pack)
    residual: torch.Tensor | None  # [S, hidden]: the block stack's residual (None unless the layout asks)
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]  # collecting segments: K/V [layers, tokens, kv_heads, d]


# rows of a packed step per call of the layer's residual (output projection + MLP): its [rows, intermediate] tensors
# are the step's largest, and every op there is per row. Nano at 1280x720x189 with CFG packs 88,320 rows: its three
# live [rows, 12288] bf16 tensors would take 6.5 GB, a chunk's 2.4 GB (memory.py plans with this)
MLP_CHUNK_ROWS = 32768


def chunked_residual(
    kernels: GenKernels,
    layer: Layer,
    x: torch.Tensor,
    attn: torch.Tensor,
    a16_rows: int,
    lora: AdapterRows | None,
    chunk: int,
) -> torch.Tensor:
    """`kernels.residual` over rows [a, a + chunk) at a time, into one output [N, hidden] (W8A16 rows keep their
    place: each chunk gets its share of `a16_rows`). With adapters (their per-row groups) it runs whole."""
    n = x.shape[0]
    if n <= chunk or lora is not None:
        return kernels.residual(layer, x, attn, a16_rows, lora)
    out = torch.empty_like(x)
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        out[a:b] = kernels.residual(layer, x[a:b], attn[a:b], min(max(a16_rows - a, 0), b - a), None)
    return out


def gen_forward(
    model: Cosmos3Transformer, packed, attend: Attend, kernels: GenKernels = EAGER
) -> GenOutput:  # packed: graphs.PackedStep
    """One GEN pass over a packed step → predictions [rows, patch_latent_dim] (every row, clean ones too), the
    sound rows' predictions [R, sound_dim] (None without sound), the action rows' [A, action_dim] (None without
    actions; clean ones too), with `packed.residual` the block stack's residual [rows, hidden] (its output after
    `norm_moe_gen` minus its input after the embedding; else None) and, for each segment that asks (`collect_kv`),
    its tokens' K/V [layers, tokens, kv_heads, d]. `attend` is the step's attention plan (already updated for these
    segments). The residual half of each layer runs MLP_CHUNK_ROWS rows at a time (`chunked_residual`). No host
    synchronisation: capturable."""
    collect = [i for i, seg in enumerate(packed.segments) if seg.collect_kv]
    ks: dict[int, list[torch.Tensor]] = {i: [] for i in collect}
    vs: dict[int, list[torch.Tensor]] = {i: [] for i in collect}
    x = embed_latent_tokens(model, packed.tokens, packed.noisy_mask, packed.segment_timesteps, packed.token_segment)
    sound_rows, action_rows = packed.sound_rows, packed.action_rows
    if sound_rows.numel() or action_rows.numel():  # their rows' embeddings replace proj_in's (of zeros) there
        temb = model.time_embedder(packed.segment_timesteps * model.cfg.timestep_scale).to(x.dtype)
    if sound_rows.numel():  # sound tokens: audio_proj_in(x) + audio_modality_embed + temb(t), all noisy
        sound = model.audio_proj_in(packed.sound) + model.audio_modality_embed
        x = x.index_put((sound_rows,), sound + temb[packed.token_segment[sound_rows]])
    if action_rows.numel():  # action tokens: action_proj_in[domain](x) + action_modality_embed (+ temb(t) if noisy)
        action = domain_linear(model.action_proj_in, packed.action, packed.action_domain) + model.action_modality_embed
        t_emb = torch.where(packed.noisy_mask[action_rows, None], temb[packed.token_segment[action_rows]], 0.0)
        x = x.index_put((action_rows,), action + t_emb)
    stack_input = x if packed.residual else None  # kept only when the residual is returned
    for i, layer in enumerate(model.layers):
        q, k, v = kernels.qkv(layer, x, packed.cos, packed.sin, packed.a16_rows, packed.lora)
        for j in collect:
            rows = slice(packed.segments[j].start, packed.segments[j].start + packed.segments[j].length)
            ks[j].append(k[rows])
            vs[j].append(v[rows])
        attn = attend(q, k, v, i)
        del q, k, v  # their memory serves the residual's
        x = chunked_residual(kernels, layer, x, attn, packed.a16_rows, packed.lora, MLP_CHUNK_ROWS)
        del attn
    h = model.norm_moe_gen(x)
    sound_out = model.audio_proj_out(h[sound_rows]) if sound_rows.numel() else None
    action_out = (
        domain_linear(model.action_proj_out, h[action_rows], packed.action_domain) if action_rows.numel() else None
    )
    residual = h - stack_input if packed.residual else None
    kv = {j: (torch.stack(ks[j]), torch.stack(vs[j])) for j in collect}
    return GenOutput(model.proj_out(h), sound_out, action_out, residual, kv)


def embed_row(
    model: Cosmos3Transformer,
    tokens: torch.Tensor,
    sound: torch.Tensor,
    action: torch.Tensor,
    action_domain: int,
    noisy_mask: torch.Tensor,
    timestep: float,
) -> torch.Tensor:
    """One row's block-stack input, embedded as `gen_forward` embeds it in a pack: tokens [N, patch_latent_dim],
    sound [T_s, sound_dim] (T_s may be 0; all noisy), action [T_a, action_dim] (T_a may be 0) of embodiment
    `action_domain`, noisy_mask [N + T_s + T_a] → [N + T_s + T_a, hidden]."""
    n, s, a = tokens.shape[0], sound.shape[0], action.shape[0]
    t = torch.full((1,), timestep, dtype=torch.float32, device=tokens.device)  # a fill: no host-to-device copy
    x = embed_latent_tokens(model, tokens, noisy_mask[:n], t)
    parts = [x]
    if s or a:
        temb = model.time_embedder(t * model.cfg.timestep_scale).to(x.dtype)
    if s:
        parts.append(model.audio_proj_in(sound) + model.audio_modality_embed + temb)
    if a:
        domain = torch.full((a,), action_domain, dtype=torch.long, device=tokens.device)
        emb = domain_linear(model.action_proj_in, action, domain) + model.action_modality_embed
        parts.append(emb + torch.where(noisy_mask[n + s :, None], temb, 0.0))
    return torch.cat(parts) if len(parts) > 1 else x


def output_heads(
    model: Cosmos3Transformer, h: torch.Tensor, n: int, s: int, action_domain: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A row's block-stack output [N + T_s + T_a, hidden] → (predictions [N, patch_latent_dim], sound predictions
    [T_s, sound_dim] or None without sound, action predictions [T_a, action_dim] or None without actions)."""
    a = h.shape[0] - n - s
    sound = model.audio_proj_out(h[n : n + s]) if s else None
    action = None
    if a:
        domain = torch.full((a,), action_domain, dtype=torch.long, device=h.device)
        action = domain_linear(model.action_proj_out, h[n + s :], domain)
    return model.proj_out(h[:n]), sound, action


@torch.inference_mode()
def fused_reference(
    model: Cosmos3Transformer,
    input_ids: torch.Tensor,
    text_rotary: tuple[torch.Tensor, torch.Tensor],
    tokens: torch.Tensor,
    timestep: float,
    noisy_mask: torch.Tensor,
    gen_rotary: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """Both towers every layer for one branch, as the reference forward does → [N, patch_latent_dim] (FP8
    linears: W8A16)."""
    und = model.embed_tokens(input_ids)
    gen = embed_latent_tokens(model, tokens, noisy_mask, torch.tensor([float(timestep)], device=tokens.device))
    t, n = und.shape[0], gen.shape[0]
    for layer in model.layers:
        q_u, k_u, k_for_gen, v_u = _und_qkv(layer, und, *text_rotary, t)
        q_g, k_g, v_g = _gen_qkv(layer, gen, *gen_rotary, n)
        und_attn = sdpa(q_u, k_u, v_u, causal=True)
        gen_attn = sdpa(q_g, torch.cat([k_for_gen, k_g]), torch.cat([v_u, v_g]), causal=False)
        und, gen = _und_residual(layer, und, und_attn, t), _gen_residual(layer, gen, gen_attn, n)
    return model.proj_out(model.norm_moe_gen(gen))
