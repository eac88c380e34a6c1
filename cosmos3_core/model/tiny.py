"""Write a tiny, random-weight Cosmos3 checkpoint in the exact diffusers layout.

Contract
--------
:func:`make_tiny` (or ``python -m cosmos3_core.tools.make_tiny --out DIR --variant {nano,edge} --seed N
[--shard-size BYTES] [--sound] [--action]``) writes::

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

Sound and action (optional, off by default; the default output is unchanged byte for byte)
-----------------------------------------------------------------------------------------
``make_tiny(..., sound=True)`` (``--sound``) adds ``DIR/sound_tokenizer/`` (a tiny ``Cosmos3AVAEAudioTokenizer``:
48 kHz stereo, ``vocoder_input_dim == sound_dim``, decoder strides (2,4,5,6,8) -> hop 1920 -> 25 latents/s) and the
transformer's sound weights (config ``sound_gen``, ``sound_dim``, ``sound_latent_fps``; ``audio_proj_in/out``,
``audio_modality_embed``); ``action=True`` (``--action``) adds ``action_gen``, ``action_dim``, ``num_embodiment_domains`` and the
``action_proj_in/out`` / ``action_modality_embed`` weights. Every weight the plain checkpoint of the same
``(variant, seed)`` has is the same tensor: the extra parts are drawn after the VAE. The zero-initialised modality
embeddings and the tokenizer's Snake ``alpha``/``beta`` are redrawn at O(1) scale, so a parity test notices a missing
term. The result loads with ``Cosmos3OmniPipeline.from_pretrained`` and runs ``enable_sound=True`` on CPU in seconds.
"""

from __future__ import annotations

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
    variant: str = "nano",
    seed: int = 0,
    head_dim: int = 32,
    vae_config: dict[str, Any] | None = None,
    sound: bool = False,
    action: bool = False,
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

        sound_tokenizer = None
        if sound or action:  # drawn last, so the weights above equal the plain checkpoint's
            transformer, sound_tokenizer = _add_sound_and_action(transformer, tcfg, sound=sound, action=action)

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
        sound_tokenizer=sound_tokenizer,
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


SOUND_DIR = "sound_tokenizer"

# Transformer extras (sound_dim is the real checkpoints' 64 shrunk; 32 domains as the released action heads).
SOUND_TRANSFORMER: dict[str, Any] = {"sound_gen": True, "sound_dim": 8, "sound_latent_fps": 25.0}
ACTION_TRANSFORMER: dict[str, Any] = {"action_gen": True, "action_dim": 16, "num_embodiment_domains": 32}

# Tiny Cosmos3AVAEAudioTokenizer: the shipped strides (hop 1920 at 48 kHz -> 25 latents/s), tiny widths.
SOUND_TOKENIZER_CONFIG: dict[str, Any] = {
    "sampling_rate": 48000,
    "vocoder_input_dim": SOUND_TRANSFORMER["sound_dim"],
    "dec_dim": 2,
    "dec_c_mults": [1, 2, 4, 8, 16],
    "dec_strides": [2, 4, 5, 6, 8],
    "enc_dim": 4,
    "enc_num_blocks": 1,
    "enc_latent_dim": 2 * SOUND_TRANSFORMER["sound_dim"],  # mean and scale of the VAE bottleneck
    "enc_c_mults": [1, 2, 4],
    "enc_strides": [4, 5, 6],
    "enc_n_fft": 64,
    "enc_hop_length": 16,
}


def _add_sound_and_action(transformer: nn.Module, tcfg: dict[str, Any], sound: bool, action: bool) -> tuple[Any, Any]:
    """The transformer rebuilt with the sound / action heads (its other weights copied over) and, with ``sound``,
    a random tiny sound tokenizer. Uses the global torch RNG (the caller's fork)."""
    from diffusers import Cosmos3AVAEAudioTokenizer, Cosmos3OmniTransformer

    extra = {**(SOUND_TRANSFORMER if sound else {}), **(ACTION_TRANSFORMER if action else {})}
    full = Cosmos3OmniTransformer(**tcfg, **extra)
    missing, unexpected = full.load_state_dict(transformer.state_dict(), strict=False)
    assert not unexpected and all(k.startswith(("audio_", "action_")) for k in missing), (missing, unexpected)
    with torch.no_grad():
        for name in missing:
            p = full.get_parameter(name)
            if name.endswith("modality_embed"):
                p.copy_(torch.randn_like(p))  # zero-initialised upstream: O(1) so dropping it shows
            elif name.startswith("action_proj_") and name.endswith(".fc.weight"):
                # DomainAwareLinear stores [domains, in*out]; scale by the true fan-in of each domain's matrix
                fan_in = full.get_submodule(name.rsplit(".", 2)[0]).input_size
                p.copy_(torch.randn_like(p) / math.sqrt(fan_in))
            elif p.ndim <= 1 or name.endswith(".bias.weight"):
                p.copy_(0.02 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(math.prod(p.shape[1:])))
    tokenizer = None
    if sound:
        tokenizer = Cosmos3AVAEAudioTokenizer(**SOUND_TOKENIZER_CONFIG)
        _randomize_(tokenizer)
        with torch.no_grad():
            for name, p in tokenizer.named_parameters():
                # Snake x + sin²(αx)/β, log-scale, zero upstream: redrawn so a swap of α and β shows. α around
                # e^-1: at α ~ 1 the stacked Snakes turn a 1e-6 change of the latents into 6e-3 of the waveform,
                # which no parity bar can see through; at e^-1 it is 5e-6
                if name.endswith(".alpha"):
                    p.copy_(-1.0 + 0.5 * torch.randn_like(p))
                elif name.endswith(".beta"):
                    p.copy_(0.5 * torch.randn_like(p))
            # random weights put the waveform at std ~5, almost all of it clamped to +-1 by decode(), which would
            # hide any difference; this gain brings it to std ~0.3 (a few samples still exercise the clamp)
            tokenizer.decoder.conv2.weight_g.mul_(0.05)
        tokenizer.eval()
    return full.eval(), tokenizer


def _record_sound_tokenizer(out: Path) -> None:
    path = out / "model_index.json"
    index = json.loads(path.read_text())
    index["sound_tokenizer"] = ["diffusers", "Cosmos3AVAEAudioTokenizer"]
    path.write_text(json.dumps(dict(sorted(index.items())), indent=2) + "\n")


def make_tiny(
    out: Path,
    variant: str = "nano",
    seed: int = 0,
    shard_size: int | None = None,
    head_dim: int = 32,
    vae_config: dict[str, Any] | None = None,
    sound: bool = False,
    action: bool = False,
) -> Path:
    """Write the tiny checkpoint to ``out`` (created if needed) and return ``out``.

    Existing ``transformer/``, ``vae/``, ``scheduler/`` and ``text_tokenizer/`` subfolders of ``out`` are replaced.

    ``shard_size`` (bytes), when given, writes the transformer as safetensors shards plus
    ``diffusion_pytorch_model.safetensors.index.json`` instead of a single file. ``vae_config``: see
    :func:`build_pipeline`. ``sound`` / ``action``: see the module docstring (both off: the output is unchanged).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in _COMPONENT_DIRS:  # never mix in files from an earlier run (e.g. old shards)
        if (out / stale).is_dir():
            shutil.rmtree(out / stale)
    if (out / SOUND_DIR).is_dir():  # a stale tokenizer from an earlier --sound run
        shutil.rmtree(out / SOUND_DIR)
    pipe = build_pipeline(
        variant=variant, seed=seed, head_dim=head_dim, vae_config=vae_config, sound=sound, action=action
    )
    pipe.save_pretrained(out, safe_serialization=True)
    if shard_size is not None:
        if shard_size <= 0:
            raise ValueError(f"shard_size must be positive, got {shard_size}")
        tdir = out / "transformer"
        shutil.rmtree(tdir)
        pipe.transformer.save_pretrained(tdir, safe_serialization=True, max_shard_size=shard_size)
    _fix_metadata(out, variant)
    if sound:  # _fix_metadata records no tokenizer; this one has one
        _record_sound_tokenizer(out)
    return out
