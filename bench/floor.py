"""The compute floor of a denoise phase: dense bf16 FLOPs at the GPU's achievable peak.

Per branch-step: 2·(GEN params touched per token)·tokens for the linears + 4·tokens·keys·head_dim·heads per layer
for attention (QK^T and PV), keys = text + tokens. ×branches ×steps. The UND tower runs once (prefill) and is
not counted; neither is the VAE.

A request's floor (`request_floor`): its tokens per branch are the vision tokens (latent frames × the token grid of
the frames it generates: an action request's content crop) plus its action tokens (`chunk_size`, as the GEN stack
runs them: each through every layer like a vision token; its own in/out projections, 2·action_dim·hidden, are
counted as a patch's, a difference of < 0.01 %), each branch with its own text length (the prompt as the prefill
tokenizes it: an action request's JSON caption, the negative prompt raw), every step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cosmos3_core.model.config import ModelConfig

if TYPE_CHECKING:
    from cosmos3_core.model.checkpoint import Checkpoint
    from cosmos3_core.requests import GenerationParams

# dense bf16 on random data: the H200's measured by the field (performance.md); the H100 SXM has the same tensor cores
# and clocks (the same peak, 989 TF/s on paper); the B200's is its paper peak (2.25 PF/s) at the H200's 80 %
CARD_BF16_FLOPS = {"H100": 790e12, "H200": 790e12, "B200": 1800e12}


def card_flops(name: str | None = None) -> tuple[str, float]:
    """(card, its dense bf16 FLOP/s) for the GPU named `name` (default: this machine's first; none: the H200's)."""
    if name is None:
        import torch

        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "H200"
    card = next((c for c in CARD_BF16_FLOPS if c in name.upper()), "H200")
    return card, CARD_BF16_FLOPS[card]


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


def request_tokens(cfg: ModelConfig, p: GenerationParams) -> tuple[int, int]:
    """(vision, action) GEN tokens per branch of a validated single-shot request (sound not counted)."""
    return tokens_for(cfg, *p.frame_size, p.num_frames), p.chunk_size if p.action_mode else 0


def text_lengths(ckpt: Checkpoint, p: GenerationParams) -> list[int]:
    """Each CFG branch's text tokens, as `PrefillStage.run` builds them (templates or the action JSON caption)."""
    from cosmos3_core.model.prompts import PromptEncoder

    prompts = PromptEncoder(ckpt.load_tokenizer(), ckpt.default_use_system_prompt)
    if p.action_mode:
        ids = prompts.encode_action(p.prompt, p.negative_prompt, p.num_frames, p.height, p.width, p.fps, p.view_point,
                                    p.use_system_prompt)  # fmt: skip
    else:
        ids = prompts.encode(p.prompt, p.negative_prompt, p.num_frames, p.height, p.width, p.fps, p.use_system_prompt,
                             p.add_templates)  # fmt: skip
    return [len(i) for i in ids][: p.cfg_branches]


def request_floor(cfg: ModelConfig, p: GenerationParams, text: list[int], card: str | None = None) -> dict:
    """The denoise floor of one request on `card` (default: this machine's GPU): vision + action tokens, each branch
    (its own text), all steps."""
    vision, action = request_tokens(cfg, p)
    flops = sum(denoise_flops(cfg, vision + action, t, p.steps, 1) for t in text)
    card, flops_per_s = card_flops(card)
    return {"vision_tokens": vision, "action_tokens": action, "text_tokens": list(text), "branches": len(text),
            "steps": p.steps, "flops": flops, "floor_s": flops / flops_per_s, "card": card}  # fmt: skip
