"""Model configuration: the parts of `transformer/config.json` and `vae/config.json` the towers need.

`ModelConfig.from_files` is the only reader of those files; every error names the file and the key.
Frozen: nothing changes a config after load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HIDDEN_ACTS = ("silu", "relu2")


# a diffusers component's weights, one file (sharded: WEIGHTS + ".index.json" beside the shards)
WEIGHTS = "diffusion_pytorch_model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint is missing a file, a key, or has a tensor of the wrong shape."""


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    hidden_act: str  # "silu" (SwiGLU, Nano/Super) or "relu2" (Edge)
    qk_norm_for_text: bool
    use_und_k_norm_for_gen: bool
    attention_bias: bool
    rms_norm_eps: float
    rope_theta: float
    rope_axes_dim: tuple[int, int, int]
    latent_channel: int
    latent_patch_size: int
    patch_latent_dim: int
    timestep_scale: float
    base_fps: float
    enable_fps_modulation: bool
    temporal_modality_margin: int
    reset_spatial_ids: bool
    # from vae/config.json
    vae_scale_spatial: int
    vae_scale_temporal: int
    sound_gen: bool = False  # the transformer has audio_proj_in/out and audio_modality_embed
    sound_dim: int = 0
    sound_latent_fps: float = 25.0
    action_gen: bool = False  # the transformer has action_proj_in/out (domain-aware) and action_modality_embed
    action_dim: int = 0  # action token width: every embodiment's raw actions zero-padded to it
    num_embodiment_domains: int = 32  # rows of the domain-aware linears (the domain table indexes them)

    @property
    def nemotron_norm(self) -> bool:
        """Edge (relu²) checkpoints use Nemotron RMSNorm: scale in fp32, cast once."""
        return self.hidden_act == "relu2"

    @property
    def has_und_k_norm_for_gen(self) -> bool:
        return self.use_und_k_norm_for_gen and not self.qk_norm_for_text

    @property
    def pixel_alignment(self) -> int:
        """Height and width must be multiples of this (the VAE's spatial factor, as the reference checks). A latent
        grid that is not a multiple of the patch size (720p: 45 rows) is zero-padded for the transformer and the
        prediction cropped back, as the reference does (`rows.patchify` / `unpatchify`)."""
        return self.vae_scale_spatial

    def latent_hw(self, height: int, width: int) -> tuple[int, int]:
        """The latent grid (rows, columns) of a height × width pixel frame: the one definition of it."""
        return height // self.vae_scale_spatial, width // self.vae_scale_spatial

    def token_grid(self, height: int, width: int) -> tuple[int, int]:
        """Patches per latent frame (rows, columns) for a video of height × width pixels; odd latent grids round
        up (zero-padded, see `pixel_alignment`)."""
        h, w = self.latent_hw(height, width)
        p = self.latent_patch_size
        return -(-h // p), -(-w // p)

    @classmethod
    def from_files(cls, transformer_config: Path, vae_config: Path) -> ModelConfig:
        t = read_json(transformer_config)
        v = read_json(vae_config)

        def get(d: dict[str, Any], key: str, src: Path, default: Any = ...) -> Any:
            if key in d:
                return d[key]
            if default is ...:
                raise CheckpointError(f"{src}: missing key {key!r}")
            return default

        hidden_act = get(t, "hidden_act", transformer_config, "silu")
        if hidden_act not in HIDDEN_ACTS:
            raise CheckpointError(
                f"{transformer_config}: key 'hidden_act' is {hidden_act!r}; supported: {', '.join(HIDDEN_ACTS)}"
            )
        if t.get("action_gen") and not t.get("action_dim"):
            raise CheckpointError(f"{transformer_config}: key 'action_dim' must be set when 'action_gen' is true")
        rope_axes = t.get("rope_axes_dim") or (t.get("rope_scaling") or {}).get("mrope_section", [24, 20, 20])
        latent_channel = int(get(t, "latent_channel", transformer_config, 48))
        patch = int(get(t, "latent_patch_size", transformer_config, 2))
        patch_latent_dim = int(get(t, "patch_latent_dim", transformer_config, 192))
        if patch_latent_dim != latent_channel * patch * patch:
            raise CheckpointError(
                f"{transformer_config}: key 'patch_latent_dim' is {patch_latent_dim}, expected "
                f"latent_channel*latent_patch_size^2 = {latent_channel * patch * patch}"
            )
        # a VAE key's default is AutoencoderKLWan's registered one, which diffusers fills in for a config that
        # lacks it (Wan2.1's released configs predate scale_factor_*)
        z_dim = int(get(v, "z_dim", vae_config, 16))
        if z_dim != latent_channel:
            raise CheckpointError(
                f"{vae_config}: key 'z_dim' is {z_dim}, transformer latent_channel is {latent_channel}"
            )
        return cls(
            hidden_size=int(get(t, "hidden_size", transformer_config)),
            num_hidden_layers=int(get(t, "num_hidden_layers", transformer_config)),
            num_attention_heads=int(get(t, "num_attention_heads", transformer_config)),
            num_key_value_heads=int(get(t, "num_key_value_heads", transformer_config)),
            head_dim=int(get(t, "head_dim", transformer_config)),
            intermediate_size=int(get(t, "intermediate_size", transformer_config)),
            vocab_size=int(get(t, "vocab_size", transformer_config)),
            hidden_act=hidden_act,
            qk_norm_for_text=bool(get(t, "qk_norm_for_text", transformer_config, True)),
            use_und_k_norm_for_gen=bool(get(t, "use_und_k_norm_for_gen", transformer_config, False)),
            attention_bias=bool(get(t, "attention_bias", transformer_config, False)),
            rms_norm_eps=float(get(t, "rms_norm_eps", transformer_config, 1e-6)),
            rope_theta=float(get(t, "rope_theta", transformer_config, 5e6)),
            rope_axes_dim=tuple(int(x) for x in rope_axes),  # type: ignore[arg-type]
            latent_channel=latent_channel,
            latent_patch_size=patch,
            patch_latent_dim=patch_latent_dim,
            timestep_scale=float(get(t, "timestep_scale", transformer_config, 0.001)),
            base_fps=float(get(t, "base_fps", transformer_config, 24)),
            enable_fps_modulation=bool(get(t, "enable_fps_modulation", transformer_config, True)),
            temporal_modality_margin=int(
                get(t, "unified_3d_mrope_temporal_modality_margin", transformer_config, 15000)
            ),
            reset_spatial_ids=bool(get(t, "unified_3d_mrope_reset_spatial_ids", transformer_config, True)),
            vae_scale_spatial=int(get(v, "scale_factor_spatial", vae_config, 8)),
            vae_scale_temporal=int(get(v, "scale_factor_temporal", vae_config, 4)),
            sound_gen=bool(t.get("sound_gen", False)),
            sound_dim=int(t.get("sound_dim") or 0),
            sound_latent_fps=float(t.get("sound_latent_fps", 25.0)),
            action_gen=bool(t.get("action_gen", False)),
            action_dim=int(t.get("action_dim") or 0),
            num_embodiment_domains=int(t.get("num_embodiment_domains", 32)),
        )
