"""The compute floor of a denoise phase: dense bf16 FLOPs at the GPU's achievable peak.

Per branch-step: 2·(GEN params touched per token)·tokens for the linears + 4·tokens·keys·head_dim·heads per layer
for attention (QK^T and PV), keys = text + tokens. ×branches ×steps. The UND tower runs once (prefill) and is
not counted; neither is the VAE.
"""

from __future__ import annotations

from cosmos3_core.model.config import ModelConfig

H200_BF16_FLOPS = 790e12  # dense bf16 on random data, measured by the field (performance.md)


def gen_params_per_token(cfg: ModelConfig) -> int:
    h, d, nh, nkv, f = (
        cfg.hidden_size,
        cfg.head_dim,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.intermediate_size,
    )
    attn = h * nh * d * 2 + h * nkv * d * 2  # q, out; k, v
    mlp = h * f * (3 if cfg.hidden_act == "silu" else 2)
    return cfg.num_hidden_layers * (attn + mlp) + 2 * h * cfg.patch_latent_dim


def denoise_flops(cfg: ModelConfig, tokens: int, text_tokens: int, steps: int, branches: int) -> float:
    linear = 2 * gen_params_per_token(cfg) * tokens
    attention = cfg.num_hidden_layers * 4 * tokens * (tokens + text_tokens) * cfg.head_dim * cfg.num_attention_heads
    return float(linear + attention) * branches * steps


def tokens_for(cfg: ModelConfig, height: int, width: int, frames: int) -> int:
    lat_t = 1 + (frames - 1) // cfg.vae_scale_temporal
    rows, cols = cfg.token_grid(height, width)
    return lat_t * rows * cols
