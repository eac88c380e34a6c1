"""The Wan2.2 VAE's decoder half as a weight container, loaded without diffusers.

`WanDecoderWeights` holds `post_quant_conv` and `decoder` under diffusers' `AutoencoderKLWan` names and shapes
(`decoder.up_blocks.0.resnets.0.conv1.weight`, ...), built from the VAE's `config.json` with that class's defaults,
and loads those keys of its safetensors straight onto the device. It has no forward: `wan_decoder.WanDecoder` runs
it, as it runs diffusers' module. Why: the decode stage needs only these weights, and importing diffusers' whole
autoencoders package to build them took 6.1 s of a vae_decode reload on the H100 host (2.6 s on a 2-core CPU).

`unsupported(vae_dir, random_weights)` says when a VAE is not this container's: one our forward refuses
(`wan_decoder.unsupported`, asked of the container built on the meta device), no latents statistics, or weights
sharded in a way it does not read; the checkpoint then loads diffusers' class (`Checkpoint.load_vae_decoder`).
Layouts as diffusers': causal Conv3d weights `[out, in, t, h, w]` (`_padding` = (w, w, h, h, 2t, 0)), RMS-norm
`gamma` `[C, 1, 1, 1]` (`[C, 1, 1]` in attention), upsample Conv2d `[out, in, 3, 3]`.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from . import wan_decoder
from .config import WEIGHTS, read_json

# AutoencoderKLWan's constructor defaults for the keys our decoder reads (diffusers 0.42.1)
DEFAULTS: dict[str, Any] = {
    "base_dim": 96,
    "decoder_base_dim": None,
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "temperal_downsample": [False, True, True],
    "is_residual": False,
    "out_channels": 3,
    "patch_size": None,
}


def read_config(vae_dir: Path) -> SimpleNamespace:
    """The VAE's config.json over the class defaults, as attributes (`vae.config.z_dim`, as diffusers')."""
    return SimpleNamespace(**{**DEFAULTS, **read_json(Path(vae_dir) / "config.json")})


def unsupported(vae_dir: Path, random_weights: bool) -> str | None:
    """Why this container cannot hold the VAE at `vae_dir` (None: it can)."""
    cfg = read_config(vae_dir)
    if "latents_mean" not in vars(cfg) or "latents_std" not in vars(cfg):
        return "config.json has no latents_mean/latents_std"
    if not random_weights and not (Path(vae_dir) / WEIGHTS).is_file():
        return f"no single {WEIGHTS}"
    if not cfg.is_residual:  # Wan2.1's up blocks: another module tree, which this container does not build
        return "not Wan2.2's residual decoder (is_residual false)"
    with torch.device("meta"):
        return wan_decoder.unsupported(WanDecoderWeights(cfg))


class CausalConv3d(nn.Conv3d):
    """diffusers' WanCausalConv3d's parameters and `_padding` (its forward pads in time causally: WanDecoder does)."""

    def __init__(self, cin: int, cout: int, kernel: int | tuple[int, int, int], padding: int | tuple = 0):
        super().__init__(cin, cout, kernel, padding=padding)
        p = self.padding
        self._padding = (p[2], p[2], p[1], p[1], 2 * p[0], 0)
        self.padding = (0, 0, 0)


class RmsNorm(nn.Module):
    def __init__(self, dim: int, images: bool = False):
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim, 1, 1) if images else torch.ones(dim, 1, 1, 1))


class ResidualBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1, self.conv1 = RmsNorm(cin), CausalConv3d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = RmsNorm(cout), CausalConv3d(cout, cout, 3, padding=1)
        self.conv_shortcut = CausalConv3d(cin, cout, 1) if cin != cout else nn.Identity()


class AttentionBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = RmsNorm(dim, images=True)
        self.to_qkv, self.proj = nn.Conv2d(dim, 3 * dim, 1), nn.Conv2d(dim, dim, 1)


class MidBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.attentions = nn.ModuleList([AttentionBlock(dim)])
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])


class DupUp:
    """DupUp3D's shape (it has no weights): `in_channels` repeated to `out_channels` × factor_t·factor_s²."""

    def __init__(self, in_channels: int, out_channels: int, factor_t: int, factor_s: int):
        self.in_channels, self.out_channels, self.factor_t, self.factor_s = (
            in_channels,
            out_channels,
            factor_t,
            factor_s,
        )


class Resample(nn.Module):
    def __init__(self, dim: int, mode: str):
        super().__init__()
        self.mode = mode
        self.resample = nn.Sequential(nn.Identity(), nn.Conv2d(dim, dim, 3, padding=1))  # [0]: the nearest 2x
        if mode == "upsample3d":
            self.time_conv = CausalConv3d(dim, 2 * dim, (3, 1, 1), padding=(1, 0, 0))


class ResidualUpBlock(nn.Module):
    def __init__(self, cin: int, cout: int, num_res_blocks: int, temporal: bool, up: bool):
        super().__init__()
        self.avg_shortcut = DupUp(cin, cout, 2 if temporal else 1, 2) if up else None
        self.resnets = nn.ModuleList([ResidualBlock(cin if i == 0 else cout, cout) for i in range(num_res_blocks + 1)])
        self.upsampler = Resample(cout, "upsample3d" if temporal else "upsample2d") if up else None


class Decoder(nn.Module):
    def __init__(self, cfg: SimpleNamespace):
        super().__init__()
        base = cfg.decoder_base_dim or cfg.base_dim
        mult = cfg.dim_mult
        dims = [base * u for u in [mult[-1], *mult[::-1]]]
        temporal_up = cfg.temperal_downsample[::-1]
        self.conv_in = CausalConv3d(cfg.z_dim, dims[0], 3, padding=1)
        self.mid_block = MidBlock(dims[0])
        self.up_blocks = nn.ModuleList()
        for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
            up = i != len(mult) - 1
            self.up_blocks.append(ResidualUpBlock(cin, cout, cfg.num_res_blocks, up and temporal_up[i], up))
        self.norm_out = RmsNorm(dims[-1])
        self.conv_out = CausalConv3d(dims[-1], cfg.out_channels, 3, padding=1)


class WanDecoderWeights(nn.Module):
    """`post_quant_conv` and `decoder` of a Wan2.2 `AutoencoderKLWan`, its `config` as attributes."""

    def __init__(self, cfg: SimpleNamespace):
        super().__init__()
        self.config = cfg
        self.post_quant_conv = CausalConv3d(cfg.z_dim, cfg.z_dim, 1)
        self.decoder = Decoder(cfg)

    @property
    def dtype(self) -> torch.dtype:
        return self.post_quant_conv.weight.dtype

    @classmethod
    def load(
        cls, vae_dir: Path, device: str | torch.device, dtype: torch.dtype, random_weights: bool = False
    ) -> WanDecoderWeights:
        """From `vae_dir` (config.json + the safetensors' decoder keys; its other keys, the encoder's, are not read)
        onto `device` in `dtype`; `random_weights`: drawn there instead (torch's default init, seed 0). A decoder
        tensor missing from the file, or of another shape than config.json gives it, raises ValueError."""
        cfg = read_config(vae_dir)
        if random_weights:
            torch.manual_seed(0)
            with torch.device(device):
                model = cls(cfg).to(dtype).eval().requires_grad_(False)
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()  # the draw's fp32 copies
            return model
        with torch.device("meta"):
            model = cls(cfg)
        wanted = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        path = Path(vae_dir) / WEIGHTS
        with safe_open(path, framework="pt", device=str(device)) as f:
            missing = sorted(set(wanted) - set(f.keys()))
            if missing:
                raise ValueError(f"{path}: {len(missing)} decoder tensor(s) missing, e.g. {', '.join(missing[:3])}")
            state = {k: f.get_tensor(k).to(dtype) for k in wanted}
        wrong = [f"{k} {tuple(v.shape)} (config.json: {wanted[k]})" for k, v in state.items() if v.shape != wanted[k]]
        if wrong:
            raise ValueError(f"{path}: {len(wrong)} decoder tensor(s) of another shape, e.g. {'; '.join(wrong[:3])}")
        model.load_state_dict(state, strict=True, assign=True)
        return model.eval().requires_grad_(False)
