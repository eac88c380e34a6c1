"""Real-shape checkpoints without weights, for speed measurements: `checkpoint: "random:edge"` (or nano).

`write_skeleton(out, preset)` writes the diffusers layout with every config at the published shapes
(`cosmos3.md`), the local byte-level tokenizer, and no weight files; `model_index.json` carries
`"random_weights": true`. `Checkpoint.load_transformer` / `load_vae` then draw weights on the target device
(timing does not depend on values). The same skeleton builds diffusers' pipeline for side-by-side runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .make_tiny import build_text_tokenizer

PRESETS: dict[str, dict[str, Any]] = {
    "edge": {
        "hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 9216, "hidden_act": "relu2", "qk_norm_for_text": False,
        "use_und_k_norm_for_gen": True, "vocab_size": 131072, "rope_theta": 1e8,
    },
    "nano": {
        "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 12288, "hidden_act": "silu", "qk_norm_for_text": True,
        "use_und_k_norm_for_gen": False, "vocab_size": 151936, "rope_theta": 5e6,
    },
}  # fmt: skip
COMMON = {
    "_class_name": "Cosmos3OmniTransformer", "attention_bias": False, "base_fps": 24, "enable_fps_modulation": True,
    "latent_channel": 48, "latent_patch_size": 2, "patch_latent_dim": 192, "rms_norm_eps": 1e-6,
    "rope_axes_dim": [24, 20, 20], "timestep_scale": 0.001, "unified_3d_mrope_reset_spatial_ids": True,
    "unified_3d_mrope_temporal_modality_margin": 15000,
}  # fmt: skip
WAN22_VAE = {
    "_class_name": "AutoencoderKLWan", "base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2, "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0,
    "is_residual": True, "in_channels": 12, "out_channels": 12, "patch_size": 2, "scale_factor_spatial": 16,
    "scale_factor_temporal": 4, "latents_mean": [0.0] * 48, "latents_std": [1.0] * 48,
}  # fmt: skip
SCHEDULER = {
    "_class_name": "UniPCMultistepScheduler", "num_train_timesteps": 1000, "prediction_type": "flow_prediction",
    "use_flow_sigmas": True, "flow_shift": 5.0, "solver_order": 2, "solver_type": "bh2", "final_sigmas_type": "zero",
}  # fmt: skip


def write_skeleton(out: Path, preset: str) -> Path:
    if preset not in PRESETS:
        raise ValueError(f"unknown random preset {preset!r}; known: {', '.join(PRESETS)}")
    out = Path(out)
    for sub in ("transformer", "vae", "scheduler"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    (out / "transformer" / "config.json").write_text(json.dumps({**COMMON, **PRESETS[preset]}, indent=1))
    (out / "vae" / "config.json").write_text(json.dumps(WAN22_VAE, indent=1))
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER, indent=1))
    build_text_tokenizer().save_pretrained(out / "text_tokenizer")
    index = {
        "_class_name": "Cosmos3OmniPipeline", "random_weights": True, "transformer": ["diffusers", "Cosmos3OmniTransformer"],
        "vae": ["diffusers", "AutoencoderKLWan"], "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_tokenizer": ["transformers", "PreTrainedTokenizerFast"], "enable_safety_checker": False,
        "default_use_system_prompt": True, "use_native_flow_schedule": preset == "edge",
    }  # fmt: skip
    (out / "model_index.json").write_text(json.dumps(index, indent=1))
    return out
