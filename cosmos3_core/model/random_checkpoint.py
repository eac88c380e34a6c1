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

Sound (Nano has it, Edge does not): `add_sound(root, preset)` adds to a written checkpoint, in place, the
transformer's sound heads (config `sound_gen`, `sound_dim`, `sound_latent_fps`; `audio_proj_in/out`,
`audio_modality_embed` in their own shard, `diffusion_pytorch_model-sound.safetensors`, drawn from their own
generator so that every other tensor stays the plain checkpoint's) and `sound_tokenizer/`
(`Cosmos3AVAEAudioTokenizer`). Nano's sizes: `sound_dim` 64 and 25 latents/s (cosmos3.md); its tokenizer's sizes are
not published, so the class defaults (48 kHz stereo, `vocoder_input_dim` 64, `dec_dim` 320, strides (2,4,5,6,8):
~496 M parameters, ~1 GB in bf16). The tokenizer's decoder is drawn so that a parity test can see through it: weight-
norm directions N(0, 1), biases 0, Snake α around e^-1 and β around 1 (log scale), and each convolution's gain set on
a probe input so its output has unit std (a residual branch 0.5, the waveform 0.3: little of it clamped). A change of
the latents then changes the waveform by about as much, neither swallowed by the biases (torch's default init: 1e-3
→ 3e-5) nor amplified by stacked Snakes. `write_skeleton(out, "nano_sound")` is Nano with these parts (the
tokenizer with its weights, the transformer drawn at load as for `random:nano`); `"tiny_sound"` is
`make_tiny(variant="nano", sound=True)` (CPU tests of the benchmarks).

Actions (Nano has them): `add_action(root, preset)` adds, in place, the transformer's action heads (config
`action_gen`, `action_dim`, `num_embodiment_domains`; `action_proj_in/out` — `DomainAwareLinear`s whose `fc` and `bias`
are embeddings of one row per domain, `fc` an (in, out) matrix flattened — and `action_modality_embed`) in their own
shard, `diffusion_pytorch_model-action.safetensors`, from their own generator. Drawn as an LLM draws embeddings: every
`fc` and `bias` row N(0, 0.02²); `action_modality_embed` (zero upstream) N(0, 0.02²) too, so a missing term shows.
Nano's sizes: 32 domains (cosmos3.md, and diffusers' default); `action_dim` is not published (diffusers has no
default), so 64: the smallest power of two holding the widest raw action of the pipeline's domain table (hand_pose,
57). The action heads hold ≈ 17 M parameters; their tokens are `chunk` per branch beside the video's. `write_skeleton(out, "nano_action")` is Nano with them (drawn at load, as for `random:nano`);
`"tiny_action"` is `make_tiny(variant="nano", action=True)` (action_dim 16).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from . import tiny

LLM_INIT_STD = 0.02  # transformers' default `initializer_range` (Qwen3, Nemotron, Llama)
SHARD_BYTES = 4 << 30
HEADS = ("audio_", "action_")  # optional heads, not drawn by write_weights

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
SOUND_TRANSFORMER = {"sound_gen": True, "sound_dim": 64, "sound_latent_fps": 25.0}
SOUND_TOKENIZER: dict[str, Any] = {"vocoder_input_dim": 64}  # the rest: Cosmos3AVAEAudioTokenizer's defaults
SOUND_SHARD = "diffusion_pytorch_model-sound.safetensors"
SOUND_SEED = 0x50D  # added to the seed: the sound parts' own draws
SOUND_PROBE_LATENTS = 8  # latent frames of the probe that sets the tokenizer's gains
ACTION_TRANSFORMER = {"action_gen": True, "action_dim": 64, "num_embodiment_domains": 32}
ACTION_SHARD = "diffusion_pytorch_model-action.safetensors"
ACTION_SEED = 0xAC7  # added to the seed: the action parts' own draws
SCHEDULER = {
    "_class_name": "UniPCMultistepScheduler", "num_train_timesteps": 1000, "prediction_type": "flow_prediction",
    "use_flow_sigmas": True, "flow_shift": 5.0, "solver_order": 2, "solver_type": "bh2", "final_sigmas_type": "zero",
}  # fmt: skip


def split_preset(preset: str) -> tuple[str, bool, bool]:
    """`<base>[_sound][_action]` → (base, sound, action)."""
    base, action = (preset.removesuffix("_action"), True) if preset.endswith("_action") else (preset, False)
    base, sound = (base.removesuffix("_sound"), True) if base.endswith("_sound") else (base, False)
    return base, sound, action


def sound_parts(preset: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(transformer config keys, tokenizer config) of a preset's sound: Nano's, or the tiny checkpoints' (make_tiny)."""
    base = split_preset(preset)[0]
    if base == "tiny":
        return dict(tiny.SOUND_TRANSFORMER), dict(tiny.SOUND_TOKENIZER_CONFIG)
    if base == "nano":
        return dict(SOUND_TRANSFORMER), dict(SOUND_TOKENIZER)
    raise ValueError(f"preset {preset!r} has no sound (Nano and the tiny checkpoints do)")


def action_parts(preset: str) -> dict[str, Any]:
    """The transformer config keys of a preset's action heads: Nano's, or the tiny checkpoints' (make_tiny)."""
    base = split_preset(preset)[0]
    if base == "tiny":
        return dict(tiny.ACTION_TRANSFORMER)
    if base == "nano":
        return dict(ACTION_TRANSFORMER)
    raise ValueError(f"preset {preset!r} has no action heads (Nano and the tiny checkpoints do)")


def write_skeleton(out: Path, preset: str, weights: bool = False, seed: int = 0, device: str = "cpu") -> Path:
    """`weights`: also write LLM-like random weights (`write_weights`), drawn on `device`. `<preset>_sound`,
    `<preset>_action`, `<preset>_sound_action`: with those parts (`add_sound`, `add_action`); `tiny_sound` /
    `tiny_action` / `tiny_sound_action`: the tiny checkpoint with them (`make_tiny`)."""
    base, sound, action = split_preset(preset)
    if base == "tiny" and (sound or action):
        return tiny.make_tiny(out, variant="nano", seed=seed, sound=sound, action=action)
    if base not in PRESETS:
        known = ", ".join([*PRESETS, "nano_sound", "nano_action", "nano_sound_action", "tiny_sound", "tiny_action"])
        raise ValueError(f"unknown random preset {preset!r}; known: {known}")
    if sound:
        sound_parts(preset)  # a preset without sound fails here, before anything is written
    if action:
        action_parts(preset)
    out = Path(out)
    for sub in ("transformer", "vae", "scheduler"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    (out / "transformer" / "config.json").write_text(json.dumps({**COMMON, **PRESETS[base]}, indent=1))
    (out / "vae" / "config.json").write_text(json.dumps(WAN22_VAE, indent=1))
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER, indent=1))
    tiny.build_text_tokenizer().save_pretrained(out / "text_tokenizer")
    index = {
        "_class_name": "Cosmos3OmniPipeline", "random_weights": True, "transformer": ["diffusers", "Cosmos3OmniTransformer"],
        "vae": ["diffusers", "AutoencoderKLWan"], "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_tokenizer": ["transformers", "PreTrainedTokenizerFast"], "enable_safety_checker": False,
        "default_use_system_prompt": True, "use_native_flow_schedule": base == "edge",
    }  # fmt: skip
    if weights:
        del index["random_weights"]  # the weights are in the files
        index |= {"sound_tokenizer": [None, None], "safety_checker": [None, None]}
    (out / "model_index.json").write_text(json.dumps(index, indent=1))
    if weights:
        write_weights(out, seed, device)
    if sound:
        add_sound(out, preset, seed, device, weights=weights)
    if action:
        add_action(out, preset, seed, device, weights=weights)
    return out


def llm_init(name: str, shape: tuple[int, ...], gen: torch.Generator, device: str) -> torch.Tensor:
    """One transformer tensor as an LLM initialises it: norm scales 1, biases 0, the rest N(0, 0.02²)."""
    if len(shape) == 1:
        parts = name.rsplit(".", 2)  # the owning module's name: input_layernorm, norm_added_q, ...
        is_norm = len(parts) > 1 and "norm" in parts[-2]
        return torch.ones(shape, device=device) if is_norm else torch.zeros(shape, device=device)
    return torch.randn(shape, generator=gen, device=device) * LLM_INIT_STD


def write_weights(root: Path, seed: int = 0, device: str = "cpu", shard_bytes: int = SHARD_BYTES) -> None:
    """Write LLM-like random transformer weights and a seeded random VAE into the checkpoint at `root` (its configs
    as they are), as diffusers' `save_pretrained` lays them out; existing weight files are replaced. The sound and
    action heads are left out (`add_sound`, `add_action` draw them), so the rest is the same with or without them."""
    from diffusers import AutoencoderKLWan, Cosmos3OmniTransformer
    from safetensors.torch import save_file

    root = Path(root)
    tdir = root / "transformer"
    tcfg = {k: v for k, v in json.loads((tdir / "config.json").read_text()).items() if not k.startswith("_")}
    with torch.device("meta"):
        model = Cosmos3OmniTransformer(**tcfg)
    fp32 = tuple(f"{m}." for m in model._keep_in_fp32_modules or ())
    specs = [(k, tuple(v.shape), torch.float32 if k.startswith(fp32) else torch.bfloat16)
             for k, v in model.state_dict().items() if not k.startswith(HEADS)]  # fmt: skip
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


def has_sound(root: Path) -> bool:
    """The checkpoint names a sound tokenizer (`add_sound` records it last, once every part is written)."""
    index = json.loads((Path(root) / "model_index.json").read_text())
    return (index.get("sound_tokenizer") or [None])[0] is not None


def add_sound(root: Path, preset: str, seed: int = 0, device: str = "cpu", weights: bool = True) -> Path:
    """Add `preset`'s sound parts (`sound_parts`) to the checkpoint at `root`, in place: the transformer's config
    keys, its sound weights (`weights`; LLM-like, their own shard and generator, so every other tensor is unchanged)
    and `sound_tokenizer/` (`write_sound_tokenizer`). `model_index.json` names the tokenizer last, so an interrupted
    run is redone whole. The transformer weights go into the checkpoint's index (made when it had a single file)."""
    root = Path(root)
    tsound, tokcfg = sound_parts(preset)
    tdir = root / "transformer"
    cfg_path = tdir / "config.json"
    cfg = {**json.loads(cfg_path.read_text()), **tsound}
    tokcfg = {**tokcfg, "vocoder_input_dim": tsound["sound_dim"]}
    if weights:
        write_sound_weights(tdir, cfg, seed, device)
    cfg_path.write_text(json.dumps(cfg, indent=1))
    write_sound_tokenizer(root / "sound_tokenizer", tokcfg, seed, device)
    index_path = root / "model_index.json"
    index = json.loads(index_path.read_text())
    index["sound_tokenizer"] = ["diffusers", "Cosmos3AVAEAudioTokenizer"]
    index_path.write_text(json.dumps(index, indent=1))
    return root


def write_sound_weights(tdir: Path, cfg: dict[str, Any], seed: int, device: str) -> None:
    """`audio_proj_in/out` (matrices N(0, 0.02²), biases 0) and `audio_modality_embed` (zero upstream; N(0, 0.02²)
    here, so a missing term shows) in `SOUND_SHARD`, added to the transformer's index."""
    from diffusers import Cosmos3OmniTransformer

    with torch.device("meta"):
        model = Cosmos3OmniTransformer(**{k: v for k, v in cfg.items() if not k.startswith("_")})
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if k.startswith("audio_")}
    gen = torch.Generator(device).manual_seed(seed + SOUND_SEED)
    tensors = {}
    for k, shape in sorted(shapes.items()):
        if k.endswith("modality_embed"):
            t = torch.randn(shape, generator=gen, device=device) * LLM_INIT_STD
        else:
            t = llm_init(k, shape, gen, device)
        tensors[k] = t.to(torch.bfloat16).cpu()
    add_shard(tdir, SOUND_SHARD, tensors)


def add_shard(tdir: Path, shard: str, tensors: dict[str, torch.Tensor]) -> None:
    """Save `tensors` as the transformer's file `shard` and name them in its index (made when the transformer had a
    single file); written again, the shard replaces its earlier self and is counted once."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    save_file(tensors, str(tdir / shard), metadata={"format": "pt"})
    index_path = tdir / "diffusion_pytorch_model.safetensors.index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    else:  # one file: an index that names it, and the new shard beside it
        single = tdir / "diffusion_pytorch_model.safetensors"
        with safe_open(single, framework="pt") as f:
            keys = list(f.keys())
        index = {"metadata": {"total_size": single.stat().st_size}, "weight_map": dict.fromkeys(keys, single.name)}
    metadata = index.get("metadata", {})
    if shard not in index["weight_map"].values():  # not counted yet (a redone run counts them once)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        metadata["total_size"] = metadata.get("total_size", 0) + size
    weight_map = {k: v for k, v in index["weight_map"].items() if v != shard}
    index |= {"metadata": metadata, "weight_map": weight_map | dict.fromkeys(tensors, shard)}
    index_path.write_text(json.dumps(index, indent=1))


def has_action(root: Path) -> bool:
    """The transformer's config has the action heads (`add_action` writes it last, once the weights are written)."""
    return bool(json.loads((Path(root) / "transformer" / "config.json").read_text()).get("action_gen"))


def add_action(root: Path, preset: str, seed: int = 0, device: str = "cpu", weights: bool = True) -> Path:
    """Add `preset`'s action heads (`action_parts`) to the checkpoint at `root`, in place: their weights (`weights`;
    `write_action_weights`, their own shard and generator, so every other tensor is unchanged), then the
    transformer's config keys (last, so an interrupted run is redone whole)."""
    root = Path(root)
    cfg_path = root / "transformer" / "config.json"
    cfg = {**json.loads(cfg_path.read_text()), **action_parts(preset)}
    if weights:
        write_action_weights(root / "transformer", cfg, seed, device)
    cfg_path.write_text(json.dumps(cfg, indent=1))
    return root


def write_action_weights(tdir: Path, cfg: dict[str, Any], seed: int, device: str) -> None:
    """`action_proj_in/out` (`fc` and `bias` are embeddings, one row per domain: N(0, 0.02²), as an LLM draws its
    embeddings) and `action_modality_embed` (zero upstream; N(0, 0.02²) here, so a missing term shows) in
    `ACTION_SHARD`, added to the transformer's index."""
    from diffusers import Cosmos3OmniTransformer

    with torch.device("meta"):
        model = Cosmos3OmniTransformer(**{k: v for k, v in cfg.items() if not k.startswith("_")})
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if k.startswith("action_")}
    gen = torch.Generator(device).manual_seed(seed + ACTION_SEED)
    tensors = {k: (torch.randn(shape, generator=gen, device=device) * LLM_INIT_STD).to(torch.bfloat16).cpu()
               for k, shape in sorted(shapes.items())}  # fmt: skip
    add_shard(tdir, ACTION_SHARD, tensors)


@torch.no_grad()
def write_sound_tokenizer(out: Path, config: dict[str, Any], seed: int = 0, device: str = "cpu") -> None:
    """A random `Cosmos3AVAEAudioTokenizer` (`config` over the class defaults) saved to `out` in bf16. The decoder
    is drawn to pass a change of its input through at about its size (see the module docstring); the encoder,
    which generation never runs, keeps torch's default init under the seed."""
    import shutil

    from diffusers import Cosmos3AVAEAudioTokenizer

    cuda = torch.device(device).type == "cuda"
    devices = [torch.device(device).index or 0] if cuda else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed + SOUND_SEED)
        tok = Cosmos3AVAEAudioTokenizer(**config).eval()
        for name, p in tok.decoder.named_parameters():
            if name.endswith("weight_v"):
                p.normal_()
            elif name.endswith("weight_g"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.zero_()
            elif name.endswith(".alpha"):  # log scale: α ~ e^-1
                p.copy_(-1.0 + 0.5 * torch.randn_like(p))
            elif name.endswith(".beta"):
                p.copy_(0.5 * torch.randn_like(p))
        probe = torch.randn(1, config["vocoder_input_dim"], SOUND_PROBE_LATENTS)
        _set_gains(tok.decoder, probe)
    shutil.rmtree(out, ignore_errors=True)
    tok.to("cpu", torch.bfloat16).save_pretrained(out, safe_serialization=True)


def _set_gains(decoder: torch.nn.Module, probe: torch.Tensor) -> None:
    """One forward of `probe` that rescales each weight-normed convolution's gain `weight_g` (its biases are 0, so
    its output scales with it) as the output passes: std 1 on the main path, 0.5 out of a residual branch, 0.3 for
    the waveform. Later layers see the rescaled outputs, so one pass sets them all."""
    targets: dict[torch.nn.Module, float] = {}
    for name, m in decoder.named_modules():
        if hasattr(m, "weight_g"):
            targets[m] = 0.3 if m is decoder.conv2 else (0.5 if name.endswith("conv2") else 1.0)

    def hook(module, _inputs, output):
        scale = targets[module] / output.float().std().clamp_min(1e-12)
        module.weight_g.mul_(scale)
        return output * scale

    handles = [m.register_forward_hook(hook) for m in targets]
    try:
        decoder(probe)
    finally:
        for h in handles:
            h.remove()
