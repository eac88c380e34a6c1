"""Cosmos3 modules whose parameter names equal the checkpoint keys (`layers.N.self_attn.to_q.weight`, ...).

One stack, two towers per layer: the understanding (UND) tower reads text, the generation (GEN) tower
reads latent tokens. `Cosmos3Transformer(cfg, parts)` builds only the towers a stage needs: prefill holds
`{"und"}`, the denoise engine `{"gen"}`, the fused reference (tests) both. No forward here: the towers'
computations live in `towers.py`, so the module tree stays a plain weight container.

Layer linears are `nn.Linear` as built; an FP8 checkpoint or `precision: fp8` swaps them for `fp8.Fp8Linear` at
load (`checkpoint.py`), so callers run them through `fp8.linear` with the rows' precision. The action bands'
`DomainAwareLinear`s are never FP8: they sit outside the layers, which diffusers' mixed precision leaves in high
precision too (`_classify_cosmos3_linear` classifies only layer attention/MLP linears).

Layouts: token-major, `[tokens, hidden]`; per-head tensors `[tokens, heads, head_dim]`.

Parameters are left as built: every `Cosmos3Transformer` is built on the meta device, then its weights are loaded or
drawn (`checkpoint.py`), so no module here initialises its own.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import ModelConfig
from .lora import AdapterRows, adapted

UND, GEN = "und", "gen"


def _table(rows: int, dim: int) -> nn.Embedding:
    """An embedding table without nn.Embedding's normal_ init: on the meta device that init imports torch._dynamo,
    a second of every stub's start for a value nothing reads."""
    return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, in the two numerics the checkpoints were trained with.

    `nemotron=False` (Nano/Super, diffusers' RMSNorm): normalise in fp32, cast to the weight dtype, scale.
    `nemotron=True` (Edge): normalise and scale in fp32, cast back to the input dtype once.
    """

    def __init__(self, dim: int, eps: float, nemotron: bool):
        super().__init__()
        self.eps = eps
        self.nemotron = nemotron
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.nemotron:
            return (self.weight.float() * normed).to(x.dtype)
        return normed.to(self.weight.dtype) * self.weight


class MLP(nn.Module):
    """SwiGLU (`silu`: gate/up/down) or squared ReLU (`relu2`: up/down, no gate). Its projections may be FP8
    (`fp8.Fp8Linear`): `a16_rows` leading rows then run W8A16, the rest W8A8 (ignored by 16-bit ones)."""

    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.act = act
        if act == "silu":
            self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, a16_rows: int, lora: AdapterRows | None = None) -> torch.Tensor:
        """x [N, hidden] → [N, hidden]; `lora`: the rows' adapters (model/lora.py), None: none."""
        if self.act == "relu2":
            up = torch.relu(adapted(self.up_proj, x, a16_rows, lora)).square()
            return adapted(self.down_proj, up, a16_rows, lora)
        gate = nn.functional.silu(adapted(self.gate_proj, x, a16_rows, lora))
        return adapted(self.down_proj, gate * adapted(self.up_proj, x, a16_rows, lora), a16_rows, lora)


class Attention(nn.Module):
    """Projections and per-head QK norms of both towers (UND: to_q/k/v/out; GEN: add_q/k/v_proj, to_add_out)."""

    def __init__(self, cfg: ModelConfig, parts: frozenset[str]):
        super().__init__()
        h, d, nh, nkv, bias = (
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.attention_bias,
        )

        def norm() -> RMSNorm:
            return RMSNorm(d, cfg.rms_norm_eps, cfg.nemotron_norm)

        if UND in parts:
            self.to_q = nn.Linear(h, nh * d, bias=bias)
            self.to_k = nn.Linear(h, nkv * d, bias=bias)
            self.to_v = nn.Linear(h, nkv * d, bias=bias)
            self.to_out = nn.Linear(nh * d, h, bias=bias)
            if cfg.qk_norm_for_text:
                self.norm_q, self.norm_k = norm(), norm()
            if cfg.has_und_k_norm_for_gen:
                self.k_norm_und_for_gen = norm()
        if GEN in parts:
            self.add_q_proj = nn.Linear(h, nh * d, bias=bias)
            self.add_k_proj = nn.Linear(h, nkv * d, bias=bias)
            self.add_v_proj = nn.Linear(h, nkv * d, bias=bias)
            self.to_add_out = nn.Linear(nh * d, h, bias=bias)
            self.norm_added_q, self.norm_added_k = norm(), norm()


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, parts: frozenset[str]):
        super().__init__()

        def norm() -> RMSNorm:
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.nemotron_norm)

        self.self_attn = Attention(cfg, parts)
        if UND in parts:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
            self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        if GEN in parts:
            self.mlp_moe_gen = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
            self.input_layernorm_moe_gen, self.post_attention_layernorm_moe_gen = norm(), norm()


class TimestepEmbedder(nn.Module):
    """sinusoid(256, cos first) → Linear → SiLU → Linear; kept in fp32 like the reference."""

    def __init__(self, hidden: int, channels: int = 256):
        super().__init__()
        self.channels = channels
        self.linear_1 = nn.Linear(channels, hidden)
        self.linear_2 = nn.Linear(hidden, hidden)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.channels // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        angles = t.float()[:, None] * freqs[None, :]
        sinusoid = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
        w = self.linear_1.weight
        return self.linear_2(nn.functional.silu(self.linear_1(sinusoid.to(w.dtype))))


class DomainAwareLinear(nn.Module):
    """A linear layer per embodiment domain (weights only; the product is `towers.domain_linear`).

    `fc.weight` [domains, in*out] holds each domain's matrix laid out (in, out), the transpose of `nn.Linear`'s
    (out, in), and `bias.weight` [domains, out]: the keys and layout of diffusers' `DomainAwareLinear`."""

    def __init__(self, in_features: int, out_features: int, domains: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.fc = _table(domains, in_features * out_features)
        self.bias = _table(domains, out_features)


class Cosmos3Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, parts: frozenset[str]):
        super().__init__()
        self.cfg = cfg
        self.parts = parts
        self.layers = nn.ModuleList(Layer(cfg, parts) for _ in range(cfg.num_hidden_layers))
        if UND in parts:
            self.embed_tokens = _table(cfg.vocab_size, cfg.hidden_size)
        if GEN in parts:
            self.norm_moe_gen = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.nemotron_norm)
            self.proj_in = nn.Linear(cfg.patch_latent_dim, cfg.hidden_size)
            self.proj_out = nn.Linear(cfg.hidden_size, cfg.patch_latent_dim)
            self.time_embedder = TimestepEmbedder(cfg.hidden_size)
            if cfg.sound_gen:  # sound tokens: their own projections and a modality embedding
                self.audio_proj_in = nn.Linear(cfg.sound_dim, cfg.hidden_size)
                self.audio_proj_out = nn.Linear(cfg.hidden_size, cfg.sound_dim)
                self.audio_modality_embed = nn.Parameter(torch.zeros(cfg.hidden_size))
            if cfg.action_gen:  # action tokens: per-embodiment projections and a modality embedding
                domains = cfg.num_embodiment_domains
                self.action_proj_in = DomainAwareLinear(cfg.action_dim, cfg.hidden_size, domains)
                self.action_proj_out = DomainAwareLinear(cfg.hidden_size, cfg.action_dim, domains)
                self.action_modality_embed = nn.Parameter(torch.zeros(cfg.hidden_size))

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (the layer linears may hold E4M3 weights; these two never do)."""
        return self.proj_in.weight.dtype if GEN in self.parts else self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device
