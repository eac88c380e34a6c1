"""The conformance space: random valid Cosmos3 checkpoints and requests, drawn from a seed.

Checkpoints are written here with diffusers' and tokenizers' own classes and `save_pretrained`, independently of
`cosmos3_core.tools.make_tiny` (whose choices our other tests share): hidden size, heads / KV heads, head_dim,
layers, `rope_axes_dim`, `hidden_act` and the Edge switches, fps modulation, the tokenizer (byte-level BPE or
word-level, with its own chat template), the scheduler (flow UniPC at several shifts and orders, the native flow
schedule, epsilon UniPC) and the VAE (Wan2.2 widths; one draw in five a Wan2.1-style VAE). Requests: steps 1–8, guidance 1 or > 1, fps, sizes with
odd latent grids, prompt and negative-prompt lengths from one token up to the deployment's limit.

`draw(seed)` → `Case`; `Case.write(dir)` → the checkpoint; `Case.deployment` the served config (its sizes are the
deployment's defaults, so a request with no parameters is a small one; everything else is the reference's).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")
WORDS = (
    "a red cube slides across wooden table robot arm picks up the blue ball under soft light camera pans left "
    "over green field river flows past old stone bridge at dusk while birds fly high above city street rain"
).split()
MAX_PROMPT_TOKENS = 512  # the conformance deployment's limit; prompts are drawn up to near it
# a chat template unlike make_tiny's (other role markers, system prompt inline), still ending the generation prompt
WORD_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|> ' + message['role'] + ' : ' + message['content'] + ' <|im_end|> ' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|> assistant : ' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class Case:
    seed: int
    transformer: dict[str, Any]
    vae: dict[str, Any]
    scheduler: dict[str, Any]
    native_schedule: bool
    tokenizer: str  # "bpe" | "word"
    default_use_system_prompt: bool
    prompt: str
    request: dict[str, Any]  # every parameter given explicitly
    sizes: dict[str, int] = field(default_factory=dict)  # the deployment's size defaults (= request's sizes)
    image_hw: tuple[int, int] | None = None  # i2v: the conditioning image's size (any aspect; resized and cropped)

    @property
    def image(self) -> np.ndarray | None:
        if self.image_hw is None:
            return None
        h, w = self.image_hw
        g = torch.Generator().manual_seed(self.seed)
        coarse = torch.rand(1, 3, 4, 4, generator=g)  # smooth, so resize and crop matter but stay well defined
        img = torch.nn.functional.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)
        return (img[0].permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()

    @property
    def deployment(self) -> dict[str, Any]:
        return {
            "device": "cpu",
            "dtype": "float32",
            "pool_pages": 512,
            "page_size": 16,
            "defaults": dict(self.sizes),
            "limits": {"max_prompt_tokens": MAX_PROMPT_TOKENS, "max_height": 128, "max_width": 128, "max_frames": 17},
        }

    def label(self) -> str:
        t, s = self.transformer, self.scheduler
        sched = "native" if self.native_schedule else s["prediction_type"].split("_")[0]
        task = "t2i" if self.sizes["num_frames"] == 1 else ("i2v" if self.image_hw else "t2v")
        return (
            f"{task}-"
            f"seed{self.seed}-{t['hidden_act']}-h{t['hidden_size']}x{t['num_hidden_layers']}-"
            f"{t['num_attention_heads']}q{t['num_key_value_heads']}kv{t['head_dim']}d-{self.tokenizer}-{sched}"
            f"{s.get('flow_shift', '')}-{'wan22' if self.vae.get('is_residual') else 'wan21'}-"
            f"{self.sizes['height']}x{self.sizes['width']}x{self.sizes['num_frames']}"
        )

    def write(self, out: Path) -> Path:
        """The checkpoint, saved by `Cosmos3OmniPipeline.save_pretrained`; nothing patched afterwards."""
        from diffusers import AutoencoderKLWan, Cosmos3OmniPipeline, Cosmos3OmniTransformer, UniPCMultistepScheduler

        if (out / "model_index.json").is_file():
            return out
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            tokenizer = _tokenizer(self.tokenizer)
            transformer = Cosmos3OmniTransformer(**self.transformer, vocab_size=len(tokenizer)).eval()
            _redraw(transformer)
            z = self.vae["z_dim"]
            vae = AutoencoderKLWan(
                **self.vae,
                latents_mean=[round(v, 3) for v in (0.3 * torch.randn(z)).tolist()],
                latents_std=[round(v, 3) for v in (0.6 + torch.rand(z)).tolist()],
            ).eval()
            _redraw(vae)
        pipe = Cosmos3OmniPipeline(
            transformer=transformer,
            text_tokenizer=tokenizer,
            vae=vae,
            scheduler=UniPCMultistepScheduler(**self.scheduler),
            enable_safety_checker=False,
            default_use_system_prompt=self.default_use_system_prompt,
            use_native_flow_schedule=self.native_schedule,
        )
        pipe.save_pretrained(out, safe_serialization=True)
        return out


def _redraw(model: nn.Module) -> None:
    """Every parameter non-trivial (zero-initialised embeddings and norms included); matrices at half the
    variance-preserving scale, so relu² stacks stay finite over many steps."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim <= 1:
                base = 1.0 if ("norm" in name or "gamma" in name) and name.endswith(("weight", "gamma")) else 0.0
                p.copy_(base + 0.05 * torch.randn_like(p))
            else:
                p.copy_(0.5 * torch.randn_like(p) / math.sqrt(math.prod(p.shape[1:])))


def _tokenizer(kind: str):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if kind == "bpe":  # byte-level BPE with a few merges
        alphabet = [chr(c) for c in range(33, 127)] + ["Ġ", "Ċ"]
        vocab = {ch: i for i, ch in enumerate(alphabet)}
        merges = [("Ġ", "a"), ("t", "h"), ("Ġ", "th"), ("e", "r"), ("i", "n")]
        for a, b in merges:
            vocab[a + b] = len(vocab)
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        template = None  # make_tiny-like Qwen chat template below
    else:
        words = sorted({w.lower() for w in WORDS} | {"system", "user", "assistant", ":", ".", ","})
        vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        template = WORD_CHAT_TEMPLATE
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = template or (
        "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )
    return tokenizer


def draw(seed: int) -> Case:
    """One valid checkpoint and request; every choice comes from `seed`."""
    r = random.Random(seed)
    heads = r.choice([2, 4, 6])
    kv = r.choice([k for k in (1, 2, 3, 6) if heads % k == 0])
    head_dim = r.choice([16, 24, 32])
    t_axis = r.randrange(2, head_dim // 2 - 3, 2)  # mRoPE sections: even temporal part, the rest split h/w
    h_axis = (head_dim // 2 - t_axis) // 2
    edge = r.random() < 0.5
    latent_channel = r.choice([8, 16])
    transformer = {
        "hidden_size": r.choice([32, 48, 64, 96]),
        "num_hidden_layers": r.randint(1, 3),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "intermediate_size": r.choice([64, 96, 160]),
        "rope_axes_dim": [t_axis, h_axis, head_dim // 2 - t_axis - h_axis],
        "rope_theta": r.choice([1e4, 5e6, 1e8]),
        "hidden_act": "relu2" if edge else "silu",
        "qk_norm_for_text": not edge if r.random() < 0.8 else edge,
        "use_und_k_norm_for_gen": edge if r.random() < 0.8 else not edge,
        "attention_bias": r.random() < 0.3,
        "enable_fps_modulation": r.random() < 0.8,
        "unified_3d_mrope_reset_spatial_ids": r.random() < 0.8,
        "latent_channel": latent_channel,
        "latent_patch_size": 2,
        "patch_latent_dim": latent_channel * 4,
        "dtype": "float32",
    }
    vae = {
        "base_dim": r.choice([8, 16]),
        "decoder_base_dim": r.choice([8, 16, 24]),
        "z_dim": latent_channel,
        "dim_mult": r.choice([[1, 2, 4, 4], [1, 2, 2, 2], [1, 1, 2, 2]]),
        "num_res_blocks": r.randint(1, 2),
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
    kind = r.choice(["flow", "flow", "native", "epsilon"])
    scheduler: dict[str, Any] = {
        "num_train_timesteps": 1000,
        "solver_order": r.choice([1, 2, 3]),
        "solver_type": "bh2",  # bh1 with flow sigmas gives NaN in the reference itself
        "lower_order_final": True,  # else the last step (to sigma 0) is a 2nd-order update on log(0): inf in the reference
        "timestep_spacing": "linspace",  # "trailing" starts flow sigmas at 1: NaN in the reference too
    }
    if kind == "epsilon":
        scheduler.update(prediction_type="epsilon", use_flow_sigmas=False, beta_schedule="scaled_linear",
                         beta_start=0.00085, beta_end=0.012, final_sigmas_type="zero")  # fmt: skip
    else:
        scheduler.update(prediction_type="flow_prediction", use_flow_sigmas=True, final_sigmas_type="zero",
                         flow_shift=r.choice([1.0, 2.5, 3.0, 4.0, 7.0, 12.0]))  # fmt: skip
    frames = r.choice([1, 5, 9])
    sizes = {"height": 16 * r.randint(1, 5), "width": 16 * r.randint(1, 5), "num_frames": frames}
    tokenizer = r.choice(["bpe", "word"])
    request = {
        **sizes,
        "steps": r.randint(1, 8),
        "guidance_scale": 1.0 if r.random() < 0.25 else round(r.uniform(1.5, 9.0), 2),
        "fps": r.choice([8.0, 16.0, 24.0, 30.0]),
        "shift": round(r.uniform(0.5, 12.0), 2),
        "seed": r.randrange(2**31),
        "negative_prompt": _text(r, tokenizer, r.choice([0, 1, 3, 40])),
    }
    if r.random() < 0.2:  # Wan2.1-style (no residual blocks, no patchify, x8): diffusers' decoder serves it
        vae = {"base_dim": r.choice([8, 16]), "z_dim": latent_channel, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 1,
               "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0}  # fmt: skip
    return Case(
        seed=seed,
        transformer=transformer,
        vae=vae,
        scheduler=scheduler,
        native_schedule=kind == "native",
        tokenizer=tokenizer,
        default_use_system_prompt=r.random() < 0.7,
        prompt=_text(r, tokenizer, _prompt_words(r, tokenizer)),
        request=request,
        sizes=sizes,
        image_hw=(r.randint(8, 96), r.randint(8, 96)) if frames > 1 and r.random() < 0.4 else None,
    )


def _prompt_words(r: random.Random, tokenizer: str) -> int:
    """1 up to what fits the token limit: templates and system prompt take up to ~150 tokens with the word-level
    tokenizer (it splits them finely); a BPE word with its space is ~5 tokens."""
    room = MAX_PROMPT_TOKENS - 160
    limit = room if tokenizer == "word" else room // 6
    return r.choice([1, 2, r.randint(3, limit), limit])


def _text(r: random.Random, tokenizer: str, words: int) -> str:
    return " ".join(r.choice(WORDS) for _ in range(words))


class Reference:
    """`Cosmos3OmniPipeline` on a case's checkpoint (fp32, CPU): latents for `params` as a request would give them.
    What is absent takes the pipeline's defaults, except sizes (the deployment's) and the seed (ours is 0; the
    pipeline's generator would be random)."""

    def __init__(self, ckpt: Path, case: Case):
        from diffusers import Cosmos3OmniPipeline

        self.case = case
        self.pipe = Cosmos3OmniPipeline.from_pretrained(ckpt, dtype=torch.float32)
        self.pipe.set_progress_bar_config(disable=True)
        self.scheduler = self.pipe.scheduler

    def latents(self, params: dict[str, Any]) -> torch.Tensor:
        kwargs: dict[str, Any] = {**self.case.sizes}
        names = {"steps": "num_inference_steps", "height": "height", "width": "width", "num_frames": "num_frames",
                 "guidance_scale": "guidance_scale", "fps": "fps", "negative_prompt": "negative_prompt"}  # fmt: skip
        kwargs.update({names[k]: v for k, v in params.items() if k in names})
        shift = {"flow_shift": params["shift"]} if "shift" in params else {}
        self.pipe.scheduler = self.scheduler.from_config(self.scheduler.config, **shift)
        out = self.pipe(
            prompt=self.case.prompt,
            image=self.case.image,
            generator=torch.Generator().manual_seed(params.get("seed", 0)),
            output_type="latent",
            enable_safety_check=False,
            **kwargs,
        )
        return out.video


def dump(case: Case) -> str:
    return json.dumps({"seed": case.seed, "label": case.label(), "request": case.request}, sort_keys=True)
