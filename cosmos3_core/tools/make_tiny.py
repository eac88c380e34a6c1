"""Write a tiny, random-weight Cosmos3 checkpoint in the exact diffusers layout.

Contract
--------
``python -m cosmos3_core.tools.make_tiny --out DIR --variant {nano,edge} --seed N [--shard-size BYTES]``
(or :func:`make_tiny` from Python) writes::

    DIR/model_index.json          # Cosmos3OmniPipeline, written by DiffusionPipeline.save_pretrained
    DIR/transformer/              # Cosmos3OmniTransformer (config.json + diffusion_pytorch_model.safetensors,
                                  #   or *.safetensors shards + diffusion_pytorch_model.safetensors.index.json)
    DIR/vae/                      # AutoencoderKLWan, Wan2.2-style (residual, patch_size=2, x16 spatial, x4 temporal)
    DIR/scheduler/                # UniPCMultistepScheduler (flow_prediction, flow sigmas)
    DIR/text_tokenizer/           # locally built byte-level BPE tokenizer with a Qwen-style chat template

The result loads offline with ``diffusers.Cosmos3OmniPipeline.from_pretrained(DIR)`` (no safety checker, no sound
tokenizer) and runs t2i / t2v / i2v on CPU in seconds. Everything is built from diffusers' / transformers' own classes;
nothing is downloaded. Output is a deterministic function of ``(variant, seed)``; the caller's global torch RNG state
is left untouched.

Variants
--------
``nano``: Qwen3-style backbone (``hidden_act="silu"``, QK-norm on text, ``rope_theta=5e6``), scheduler
``flow_shift=3.0``, pipeline ``use_native_flow_schedule=False``.
``edge``: Nemotron-style backbone (``hidden_act="relu2"``, no text QK-norm, und-K-norm for gen, ``rope_theta=1e8``),
scheduler ``flow_shift=8.0``, pipeline ``use_native_flow_schedule=True``.

Weights are re-drawn after construction so that every parameter is non-trivial: norm scales ``1 + 0.1*randn``,
biases ``0.02*randn``, matrices / conv kernels ``randn / sqrt(fan_in)`` (keeps activations O(1), so attention is not
uniform and outputs depend on every input, while staying finite over many sampling steps).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["SPECIAL_TOKENS", "VARIANTS", "build_pipeline", "build_text_tokenizer", "make_tiny"]

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
)

# Qwen-style chat template. `add_vision_id` (passed by the pipeline) is accepted and ignored.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}"
    "{{- item['text'] -}}"
    "{%- elif item['type'] in ['image', 'video'] -%}"
    "{{- '<|vision_start|><|vision_end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

_COMMON_TRANSFORMER: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 128,
    "rope_axes_dim": [6, 5, 5],  # sums to head_dim // 2
    "latent_channel": 16,
    "patch_latent_dim": 64,  # latent_channel * latent_patch_size**2
    "latent_patch_size": 2,
    "dtype": "float32",
}

VARIANTS: dict[str, dict[str, Any]] = {
    "nano": {
        "transformer": {
            **_COMMON_TRANSFORMER,
            "hidden_act": "silu",
            "qk_norm_for_text": True,
            "use_und_k_norm_for_gen": False,
            "rope_theta": 5_000_000.0,
        },
        "flow_shift": 3.0,
        "use_native_flow_schedule": False,
    },
    "edge": {
        "transformer": {
            **_COMMON_TRANSFORMER,
            "hidden_act": "relu2",
            "qk_norm_for_text": False,
            "use_und_k_norm_for_gen": True,
            "rope_theta": 100_000_000.0,
        },
        "flow_shift": 8.0,
        "use_native_flow_schedule": True,
    },
}

# Wan2.2-style VAE (residual blocks, 2x2 pixel patchify -> x16 spatial, x4 temporal), shrunk for CPU.
_COMPONENT_DIRS = ("transformer", "vae", "scheduler", "text_tokenizer")

VAE_CONFIG: dict[str, Any] = {
    "base_dim": 8,
    "decoder_base_dim": 16,
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 1,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
    "is_residual": True,
    "in_channels": 12,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_spatial": 16,
    "scale_factor_temporal": 4,
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte -> printable unicode char table (the ByteLevel pre-tokenizer alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def build_text_tokenizer() -> Any:
    """Byte-level BPE over the 256-byte alphabet with no merges (token id == byte value) plus special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=131072,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _randomize_(model: nn.Module) -> None:
    """Re-draw every parameter in place (uses the global torch RNG)."""
    with torch.no_grad():
        for module in model.modules():
            is_norm = "norm" in type(module).__name__.lower() or isinstance(module, nn.GroupNorm)
            for name, p in module.named_parameters(recurse=False):
                if is_norm and name in ("weight", "gamma"):
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                elif p.ndim <= 1:
                    p.copy_(0.02 * torch.randn_like(p))
                else:
                    fan_in = math.prod(p.shape[1:])
                    p.copy_(torch.randn_like(p) / math.sqrt(fan_in))


def build_pipeline(
    variant: str = "nano", seed: int = 0, head_dim: int = 32, vae_config: dict[str, Any] | None = None
) -> Any:
    """Build the tiny random-weight ``Cosmos3OmniPipeline`` in memory (float32, CPU). ``head_dim`` 64 gives
    GPU kernels with a fixed head-size menu (FlashInfer's fa3: 64/128/256) a shape they take. ``vae_config``
    replaces ``VAE_CONFIG`` (e.g. a Wan2.1-style VAE; its ``z_dim`` must stay the transformer's 16)."""
    from diffusers import AutoencoderKLWan, Cosmos3OmniPipeline, Cosmos3OmniTransformer, UniPCMultistepScheduler

    vae_config = VAE_CONFIG if vae_config is None else vae_config
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {sorted(VARIANTS)}")
    spec = VARIANTS[variant]
    tokenizer = build_text_tokenizer()

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tcfg = dict(spec["transformer"])
        if head_dim != tcfg["head_dim"]:
            scale = head_dim // tcfg["head_dim"]
            tcfg["head_dim"] = head_dim
            tcfg["rope_axes_dim"] = [a * scale for a in tcfg["rope_axes_dim"]]
        tcfg["rope_scaling"] = {
            "rope_type": "default",
            "mrope_section": list(tcfg["rope_axes_dim"]),
            "mrope_interleaved": True,
        }
        tcfg["vocab_size"] = len(tokenizer)
        transformer = Cosmos3OmniTransformer(**tcfg)
        _randomize_(transformer)

        z_dim = vae_config["z_dim"]
        latents_mean = [round(v, 4) for v in (0.5 * torch.randn(z_dim)).tolist()]
        latents_std = [round(v, 4) for v in (0.5 + torch.rand(z_dim)).tolist()]
        vae = AutoencoderKLWan(**vae_config, latents_mean=latents_mean, latents_std=latents_std)
        _randomize_(vae)

    scheduler = UniPCMultistepScheduler(
        num_train_timesteps=1000,
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=spec["flow_shift"],
        solver_order=2,
        solver_type="bh2",
        predict_x0=True,
        lower_order_final=True,
        final_sigmas_type="zero",
        timestep_spacing="linspace",
    )
    pipe = Cosmos3OmniPipeline(
        transformer=transformer.eval(),
        text_tokenizer=tokenizer,
        vae=vae.eval(),
        scheduler=scheduler,
        sound_tokenizer=None,
        safety_checker=None,
        enable_safety_checker=False,
        default_use_system_prompt=True,
        use_native_flow_schedule=spec["use_native_flow_schedule"],
    )
    return pipe


def _fix_metadata(out: Path, variant: str) -> None:
    """Make model_index.json carry every field the loader needs, whatever save_pretrained chose to write.

    transformers>=5 saves the tokenizer class as ``TokenizersBackend``, a name transformers 4.x lacks; both record
    the portable alias ``PreTrainedTokenizerFast`` instead (it resolves to the same class under transformers 5).
    """
    tok_cfg_path = out / "text_tokenizer" / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")

    path = out / "model_index.json"
    index = json.loads(path.read_text())
    index["_class_name"] = "Cosmos3OmniPipeline"
    index["text_tokenizer"] = ["transformers", "PreTrainedTokenizerFast"]
    index["sound_tokenizer"] = [None, None]
    index["safety_checker"] = [None, None]
    index["enable_safety_checker"] = False
    index["default_use_system_prompt"] = True
    index["use_native_flow_schedule"] = VARIANTS[variant]["use_native_flow_schedule"]
    path.write_text(json.dumps(dict(sorted(index.items())), indent=2) + "\n")


def make_tiny(
    out: Path,
    variant: str = "nano",
    seed: int = 0,
    shard_size: int | None = None,
    head_dim: int = 32,
    vae_config: dict[str, Any] | None = None,
) -> Path:
    """Write the tiny checkpoint to ``out`` (created if needed) and return ``out``.

    Existing ``transformer/``, ``vae/``, ``scheduler/`` and ``text_tokenizer/`` subfolders of ``out`` are replaced.

    ``shard_size`` (bytes), when given, writes the transformer as safetensors shards plus
    ``diffusion_pytorch_model.safetensors.index.json`` instead of a single file. ``vae_config``: see
    :func:`build_pipeline`.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in _COMPONENT_DIRS:  # never mix in files from an earlier run (e.g. old shards)
        if (out / stale).is_dir():
            shutil.rmtree(out / stale)
    pipe = build_pipeline(variant=variant, seed=seed, head_dim=head_dim, vae_config=vae_config)
    pipe.save_pretrained(out, safe_serialization=True)
    if shard_size is not None:
        if shard_size <= 0:
            raise ValueError(f"shard_size must be positive, got {shard_size}")
        tdir = out / "transformer"
        shutil.rmtree(tdir)
        pipe.transformer.save_pretrained(tdir, safe_serialization=True, max_shard_size=shard_size)
    _fix_metadata(out, variant)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="nano")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-size", type=int, default=None, help="max transformer shard size in bytes")
    args = parser.parse_args(argv)
    path = make_tiny(args.out, variant=args.variant, seed=args.seed, shard_size=args.shard_size)
    print(path)


if __name__ == "__main__":
    main()
