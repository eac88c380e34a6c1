"""Real-shape checkpoints with random weights: `checkpoint: "random:edge"` (or nano) for speed, and real
diffusers checkpoints with LLM-like random weights for numerics (`bench.parity`).

`write_skeleton(out, preset)` writes the diffusers layout with every config at the published shapes
(`cosmos3.md`), the local byte-level tokenizer, and no weight files; `model_index.json` carries
`"random_weights": true`. `Checkpoint.load_transformer` / `load_vae` then draw weights on the target device
(timing does not depend on values). The same skeleton builds diffusers' pipeline for side-by-side runs.

`write_skeleton(out, preset, weights=True)` (or `write_weights(root)` on any checkpoint) also writes the weights,
so that diffusers' `from_pretrained` and our loader read the same files. The transformer is drawn as an LLM's is
initialised (transformers' `_init_weights` with `initializer_range` 0.02): every matrix and embedding
N(0, 0.02²), biases 0, norm scales 1. The VAE keeps torch's default init under the seed. Everything is stored in
bf16 (the fp32 time embedder in fp32), so a bf16 run holds exactly the weights an fp32 run holds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .make_tiny import build_text_tokenizer

LLM_INIT_STD = 0.02  # transformers' default `initializer_range` (Qwen3, Nemotron, Llama)
SHARD_BYTES = 4 << 30

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


def write_skeleton(out: Path, preset: str, weights: bool = False, seed: int = 0, device: str = "cpu") -> Path:
    """`weights`: also write LLM-like random weights (`write_weights`), drawn on `device`."""
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
    if weights:
        del index["random_weights"]  # the weights are in the files
        index |= {"sound_tokenizer": [None, None], "safety_checker": [None, None]}
    (out / "model_index.json").write_text(json.dumps(index, indent=1))
    if weights:
        write_weights(out, seed, device)
    return out


def llm_init(name: str, shape: tuple[int, ...], gen: torch.Generator, device: str) -> torch.Tensor:
    """One transformer tensor as an LLM initialises it: norm scales 1, biases 0, the rest N(0, 0.02²)."""
    if len(shape) == 1:
        is_norm = "norm" in name.rsplit(".", 2)[-2]  # the owning module's name: input_layernorm, norm_added_q, ...
        return torch.ones(shape, device=device) if is_norm else torch.zeros(shape, device=device)
    return torch.randn(shape, generator=gen, device=device) * LLM_INIT_STD


def write_weights(root: Path, seed: int = 0, device: str = "cpu", shard_bytes: int = SHARD_BYTES) -> None:
    """Write LLM-like random transformer weights and a seeded random VAE into the checkpoint at `root` (its configs
    as they are), as diffusers' `save_pretrained` lays them out; existing weight files are replaced."""
    from diffusers import AutoencoderKLWan, Cosmos3OmniTransformer
    from safetensors.torch import save_file

    root = Path(root)
    tdir = root / "transformer"
    tcfg = {k: v for k, v in json.loads((tdir / "config.json").read_text()).items() if not k.startswith("_")}
    with torch.device("meta"):
        model = Cosmos3OmniTransformer(**tcfg)
    fp32 = tuple(f"{m}." for m in model._keep_in_fp32_modules or ())
    specs = [(k, tuple(v.shape), torch.float32 if k.startswith(fp32) else torch.bfloat16)
             for k, v in model.state_dict().items()]  # fmt: skip
    shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
    size = 0
    for spec in specs:
        nbytes = torch.Size(spec[1]).numel() * spec[2].itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    for stale in [*tdir.glob("*.safetensors"), *tdir.glob("*.safetensors.index.json")]:
        stale.unlink()
    gen = torch.Generator(device).manual_seed(seed)
    names = ["diffusion_pytorch_model.safetensors"] if len(shards) == 1 else [
        f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]  # fmt: skip
    weight_map, total = {}, 0
    for name, shard in zip(names, shards):
        tensors = {k: llm_init(k, shape, gen, device).to(dtype).cpu() for k, shape, dtype in shard}
        save_file(tensors, str(tdir / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, name)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tdir / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    vcfg = json.loads((root / "vae" / "config.json").read_text())
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        vae = AutoencoderKLWan.from_config({k: v for k, v in vcfg.items() if not k.startswith("_")})
    vae.to(torch.bfloat16).save_pretrained(root / "vae", safe_serialization=True)
    del vae
