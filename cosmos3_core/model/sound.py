"""Sound (``enable_sound=True``) model-level pieces, each equal to diffusers 0.42.1's `Cosmos3OmniPipeline` ("P",
`pipeline_cosmos3_omni.py`) and `Cosmos3AVAEAudioTokenizer` ("A", `autoencoder_cosmos3_audio.py`).

- `SoundSpec.open(root)`: what a checkpoint says about sound (transformer `sound_gen`, `sound_dim`, `sound_latent_fps`;
  `sound_tokenizer/config.json` sampling rate, hop = prod(dec_strides), channels), or the pipeline's error when the
  checkpoint cannot make sound (P:1028-1032).
- `SoundSpec.latent_shape(num_frames, fps)`: ``[sound_dim, T]`` with ``T = ceil(int(num_frames / fps · sr) / hop)``
  (P:891-897; 48 kHz / 1920 = 25 latents per second). Every sound token is noisy; the video length is not a
  multiple of the hop in general, and the waveform is not trimmed back.
- `initial_noise(vision_shape, sound_shape, seed)`: one CPU generator, vision noise first (its full shape, clean
  frames included), then sound `[sound_dim, T]` (P:950-984); action noise, when there is any, comes third.
- `sound_position_ids(cfg, sound_len, text_len, latent_fps)`: ``[3, T]`` mRoPE ids: temporal ids start at the same
  ``text_len + margin`` as vision's (sound and vision are temporal siblings), ``t = j · base_fps / latent_fps``
  (24/25: *not* compressed by 4 like vision's ``i · 24 / fps``), h = w = 0 (P:128-176, 621-654).
- `load_sound_tokenizer(root)` / `decode_sound(tokenizer, latents)`: ``[sound_dim, T]`` → stereo float32
  ``[channels, T · hop]``: the tokenizer's Oobleck decoder, clamped to [-1, 1], no latent denormalisation (the
  AVAE has none: A:513-516), exactly P:517-524 + A:603-617.

We use diffusers' tokenizer class rather than our own forward (its decoder is weight-norm convs and Snake1d only,
so a rewrite buys nothing but risk), with the weight norm folded once at load: equal to the pipeline to the bit,
1.3-1.8x faster on CPU (`load_sound_tokenizer`).
"""

from __future__ import annotations

import inspect
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..caches import memo_json
from ..from_diffusers import from_diffusers
from ..sampling import initial_noise_bands
from .config import ModelConfig

__all__ = ["SoundSpec", "decode_sound", "initial_noise", "load_sound_tokenizer", "sound_position_ids"]

SOUND_DIR = "sound_tokenizer"
# torch's FutureWarning at every tokenizer load: diffusers builds its convs with the deprecated weight_norm
WEIGHT_NORM_NOTICE = r"`torch\.nn\.utils\.weight_norm` is deprecated"
SPEC_KEYS = (
    "hop_size",
    "dec_strides",
    "sampling_rate",
    "dec_out_channels",
    "vocoder_input_dim",
)  # what SoundSpec reads


def _tokenizer_defaults() -> dict[str, object]:
    """The tokenizer class's constructor defaults that `SoundSpec` reads: what diffusers fills in for keys a
    config.json leaves out (kept per diffusers version: the class's import takes seconds, `caches.memo_json`)."""

    def read() -> dict[str, object]:
        sig = inspect.signature(from_diffusers("Cosmos3AVAEAudioTokenizer").__init__)
        return {k: sig.parameters[k].default for k in SPEC_KEYS if k in sig.parameters
                and sig.parameters[k].default is not inspect.Parameter.empty}  # fmt: skip

    return memo_json("sound-tokenizer-defaults", ",".join(SPEC_KEYS), read)


@dataclass(frozen=True)
class SoundSpec:
    sound_dim: int  # latent channels (transformer sound_dim == tokenizer vocoder_input_dim)
    latent_fps: float  # transformer sound_latent_fps: the rate the rotary ids assume (25)
    sampling_rate: int  # Hz (48000)
    hop_size: int  # waveform samples per latent frame (1920)
    channels: int  # waveform channels (2: stereo)

    @classmethod
    def open(cls, root: str | Path) -> SoundSpec:
        """Read from a checkpoint root (diffusers layout); ValueError, as the pipeline's, when it has no sound."""
        root = Path(root)
        index = json.loads((root / "model_index.json").read_text())
        if (index.get(SOUND_DIR) or [None])[0] is None or not (root / SOUND_DIR / "config.json").is_file():
            raise ValueError(f"{root}: enable_sound requires a sound-capable checkpoint with a `{SOUND_DIR}`")
        t = json.loads((root / "transformer" / "config.json").read_text())
        if not t.get("sound_gen", False):
            raise ValueError(
                f"{root / 'transformer' / 'config.json'}: enable_sound but the transformer has no sound_gen"
            )
        a = {**_tokenizer_defaults(), **json.loads((root / SOUND_DIR / "config.json").read_text())}
        hop = int(a["hop_size"]) if a.get("hop_size") is not None else math.prod(a["dec_strides"])  # A:546
        spec = cls(
            sound_dim=int(t["sound_dim"]),
            latent_fps=float(t.get("sound_latent_fps", 25.0)),
            sampling_rate=int(a["sampling_rate"]),
            hop_size=hop,
            channels=int(a["dec_out_channels"]),
        )
        if int(a["vocoder_input_dim"]) != spec.sound_dim:
            raise ValueError(
                f"{root / SOUND_DIR / 'config.json'}: vocoder_input_dim {a['vocoder_input_dim']} != transformer "
                f"sound_dim {spec.sound_dim}"
            )
        return spec

    def latent_frames(self, num_frames: int, fps: float) -> int:
        # the pipeline's float arithmetic as written (int() truncates, then a ceiling division by the hop)
        samples = int(num_frames / fps * self.sampling_rate)
        return (samples + self.hop_size - 1) // self.hop_size

    def latent_shape(self, num_frames: int, fps: float) -> tuple[int, int]:
        """[sound_dim, T]: the pipeline's sound latents have no batch axis."""
        return (self.sound_dim, self.latent_frames(num_frames, fps))

    def samples(self, sound_len: int) -> int:
        """Waveform samples the decoder returns for `sound_len` latents (every stride's ConvTranspose1d is exact)."""
        return sound_len * self.hop_size


def initial_noise(
    vision_shape: tuple[int, ...], sound_shape: tuple[int, int], seed: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(vision noise, sound noise), both fp32, from one CPU generator in the pipeline's order: the sound noise is
    the generator's next draw after the full vision tensor (`sampling.initial_noise` draws the vision one alone)."""
    vision, sound = initial_noise_bands([vision_shape, sound_shape], seed, device)
    return vision, sound


def sound_position_ids(cfg: ModelConfig, sound_len: int, text_len: int, latent_fps: float = 25.0) -> torch.Tensor:
    """[3, sound_len] float32 ids for the sound tokens of a branch whose text prefix has `text_len` tokens.

    Same values as the pipeline's `get_3d_mrope_ids_vae_tokens(grid_t=T, grid_h=1, grid_w=1, fps=latent_fps,
    temporal_compression_factor=1)` (P:632-641); the arithmetic is in the same order, so equal to the bit."""
    offset = text_len + cfg.temporal_modality_margin  # the vision start: sound does not follow vision in time
    frames = torch.arange(sound_len, dtype=torch.float32)
    if cfg.enable_fps_modulation and sound_len > 1:
        t_ids = frames / float(latent_fps) * float(cfg.base_fps) + offset  # 25 Hz latents on the 24 fps grid
    else:  # the pipeline's integer ids (a single latent frame, or no fps modulation); exact in fp32
        t_ids = frames + offset
    hw = torch.zeros(sound_len, dtype=torch.float32)
    if not cfg.reset_spatial_ids:
        hw = hw + offset
    return torch.stack([t_ids, hw, hw.clone()])


def load_sound_tokenizer(
    root: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, fold: bool = True
):
    """diffusers' `Cosmos3AVAEAudioTokenizer` from ``root/sound_tokenizer`` (eval, no grad).

    `fold`: compute each weight-normed conv's ``g·v/‖v‖`` once here instead of on every forward. The same
    `torch._weight_norm` call makes the same weight, so decode is unchanged to the bit (tested), and 1.3-1.8x
    faster on CPU at dec_dim 64."""
    SoundSpec.open(root)  # the same errors as the pipeline's check before anything is loaded (or imported: a
    # checkpoint without sound never imports diffusers' autoencoders here, seconds of a vae_decode start)
    from torch.nn.utils import remove_weight_norm

    Cosmos3AVAEAudioTokenizer = from_diffusers("Cosmos3AVAEAudioTokenizer")

    with warnings.catch_warnings():  # WEIGHT_NORM_NOTICE: diffusers' to act on, noise in a server's log
        warnings.filterwarnings("ignore", WEIGHT_NORM_NOTICE, FutureWarning)
        tok = Cosmos3AVAEAudioTokenizer.from_pretrained(Path(root) / SOUND_DIR, torch_dtype=dtype)
    if fold:
        for module in tok.decoder.modules():
            if hasattr(module, "weight_g"):
                remove_weight_norm(module)
    return tok.to(device).eval().requires_grad_(False)


@torch.inference_mode()
def decode_sound(tokenizer, latents: torch.Tensor) -> torch.Tensor:
    """Sound latents [sound_dim, T] (fp32, as sampled) → waveform [channels, T·hop] float32 in [-1, 1] (CPU or the
    tokenizer's device). The pipeline's `decode_sound`: cast to the decoder's dtype, decode, clamp (in `decode`)."""
    if latents.ndim != 2:
        raise ValueError(f"sound latents: expected [sound_dim, T], got {tuple(latents.shape)}")
    p = next(tokenizer.parameters())
    wave = tokenizer.decode(latents.unsqueeze(0).to(device=p.device, dtype=p.dtype))  # [1, channels, T·hop]
    return wave.squeeze(0).float()
