"""Pixels ↔ normalised latents through the Wan VAE (diffusers `AutoencoderKLWan`).

- `preprocess_image`: uint8 [H, W, 3] → [1, 3, h, w] in [-1, 1]: resize to cover (bilinear, antialias),
  centre-crop, round — as the reference pipeline does for a conditioning image.
- `VaeCodec.encode_first_frame`: the i2v conditioning latent [1, C, 1, h/s, w/s] (s: the VAE's spatial factor)
  through diffusers' encoder. The Wan encoder is causal in time, so latent frame 0 of the reference's
  repeat-padded clip depends on pixel frame 0 only.
- `StreamDecoder`: the decode, chunk by chunk along time, through our decoder forward (`wan_decoder.py`), or, for
  a VAE that forward does not cover (Wan2.1: no residual blocks, no patchify), through diffusers' own decoder
  (`DiffusersDecoder`; one log line at load says so). The Wan decoder is causal in time, so carrying its
  per-conv state across chunks makes the joined chunks equal one decode of the whole sequence.
  `VaeCodec.decode` is a one-chunk stream.
  Output: uint8 [T', H, W, 3] (T' = 1 + 4(T-1) for the first chunk, 4T after); the reference's
  `output_type="np"` × 255, rounded. `StreamDecoder.start` returns before the frames reach the host (a
  `HostFrames` to wait on), so a server can launch the next chunk while this one is copied and sent.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ..caches import precompiled_dir
from ..from_diffusers import from_diffusers
from .wan_decoder import EAGER, DecoderKernels, WanDecoder, unsupported

log = logging.getLogger(__name__)


def preprocess_image(image: np.ndarray, height: int, width: int) -> torch.Tensor:
    x = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).unsqueeze(0).to(torch.float32)
    src_h, src_w = x.shape[-2:]
    scale = max(width / src_w, height / src_h)
    rh, rw = math.ceil(scale * src_h), math.ceil(scale * src_w)
    x = F.interpolate(x, size=(rh, rw), mode="bilinear", align_corners=False, antialias=True)
    top, left = round((rh - height) / 2), round((rw - width) / 2)
    x = x[:, :, top : top + height, left : left + width]
    return x.round().clamp(0, 255) / 127.5 - 1.0


class VaeCodec:
    """`wrap`: applied to our decoder when it is prepared (parallel/vae.py splits it over ranks); diffusers'
    fallback decoder is never wrapped."""

    def __init__(
        self,
        vae,
        compile: bool = False,
        wrap: Callable[[WanDecoder], object] | None = None,
        frames_per_call: Callable[[int, int], int] | None = None,
        band_rows: Callable[[int, int], int] | None = None,
    ):
        """`frames_per_call`, `band_rows`: the decoder's latent frames per call and latent rows per band by latent
        grid (h, w), from the memory plan (None: `WanDecoder`'s defaults, whole frames)."""
        self.vae = vae
        self.compile = compile
        self.frames_per_call, self.band_rows = frames_per_call, band_rows
        self.wrap = wrap
        self._decoder: WanDecoder | DiffusersDecoder | None = None
        self.dtype = vae.dtype
        dev = self.device
        self.mean = torch.tensor(vae.config.latents_mean, dtype=vae.dtype, device=dev).view(1, -1, 1, 1, 1)
        self.inv_std = (1.0 / torch.tensor(vae.config.latents_std, dtype=vae.dtype, device=dev)).view(1, -1, 1, 1, 1)

    @property
    def decoder(self) -> WanDecoder | DiffusersDecoder:
        """Prepared on first use: the prefill stage's codec only encodes."""
        if self._decoder is None:
            if (reason := unsupported(self.vae)) is None:
                kernels = DecoderKernels.compiled(precompiled_dir()) if self.compile else EAGER
                self._decoder = WanDecoder(self.vae, kernels, self.frames_per_call, self.band_rows)
                if self.wrap is not None:
                    self._decoder = self.wrap(self._decoder)
            else:  # a checkpoint diffusers runs is served, only slower
                log.warning("VAE decode falls back to diffusers' AutoencoderKLWan decoder (slower): %s", reason)
                self._decoder = DiffusersDecoder(self.vae)
        return self._decoder

    @property
    def device(self) -> torch.device:
        return next(p.device for p in self.vae.parameters() if not p.is_meta)  # a stage loads one half

    @torch.inference_mode()
    def encode_first_frame(self, image: np.ndarray, height: int, width: int) -> torch.Tensor:
        """uint8 [H, W, 3] → normalised latent [1, C, 1, height/16, width/16] fp32."""
        pixels = preprocess_image(image, height, width).to(self.device)  # [1, 3, h, w]
        mu = self.vae.encode(pixels.unsqueeze(2).to(self.dtype)).latent_dist.mode()
        return ((mu - self.mean) * self.inv_std).float()

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """normalised latents [1, C, T, h, w] → uint8 [T', H, W, 3] (CPU)."""
        return StreamDecoder(self).decode(latents)


def _moved(tensor: torch.Tensor, device: str | torch.device, pinned: bool) -> torch.Tensor:
    """`tensor` on `device`. `pinned`, to the host: copied in the current stream's order without waiting for it,
    through pinned memory (a pageable copy of Nano's 1.4 GB state at 832×480 blocks ~1 s; pinned, ~0.03 s on an
    H100), and back from it asynchronously; every use of a moved state is a later copy or kernel on the same stream."""
    device = torch.device(device)
    if tensor.device == device:
        return tensor
    if tensor.is_cuda and device.type == "cpu" and pinned:
        try:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        except RuntimeError:  # no pinned memory left: the blocking copy
            return tensor.to(device)
        return host.copy_(tensor, non_blocking=True)
    return tensor.to(device, non_blocking=tensor.is_pinned())


class StreamDecoder:
    def __init__(self, codec: VaeCodec):
        self.codec = codec
        self.stream = codec.decoder.stream()

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """The next latent frames [1, C, T, h, w] of this stream → uint8 [T', H, W, 3] (CPU)."""
        return self.start(latents)()

    def _streams(self) -> list:
        bands = getattr(self.stream, "bands", None)
        return [b[2] for b in bands] if bands else [self.stream]

    def move_state(self, device: str | torch.device, pinned: bool = True) -> None:
        """Move the stream's causal state (every conv's context frames) to `device`: a kept session's idle state
        waits in host memory ("cpu"), not on the GPU, and comes back unchanged when it continues; `pinned` False:
        in pageable host memory, a blocking copy. A stream split over decode ranks keeps its state on the workers."""
        for stream in self._streams():
            if isinstance(getattr(stream, "state", None), dict):  # our decoder's
                stream.state = {k: _moved(v, device, pinned) for k, v in stream.state.items()}
            elif isinstance(getattr(stream, "cache", None), list):  # diffusers' fallback's feat cache
                stream.cache = [_moved(v, device, pinned) if isinstance(v, torch.Tensor) else v for v in stream.cache]

    def state_bytes(self) -> int:
        """The bytes of the stream's causal state, wherever it is (0 before its first piece)."""
        total = 0
        for stream in self._streams():
            if isinstance(getattr(stream, "state", None), dict):
                total += sum(v.nbytes for v in stream.state.values())
            elif isinstance(getattr(stream, "cache", None), list):
                total += sum(v.nbytes for v in stream.cache if isinstance(v, torch.Tensor))
        return total

    @torch.inference_mode()
    def start(self, latents: torch.Tensor) -> HostFrames:
        """Launch the decode of the next latent frames and the copy of its frames to the host; on CUDA it
        returns while both run (the caller's next chunk queues behind them on the same stream)."""
        c = self.codec
        if c.device.type == "cuda" and latents.device.type == "cpu":
            latents = latents.pin_memory()  # a blocking copy from pageable memory would wait for the previous chunk
        z = latents.to(device=c.device, dtype=c.dtype, non_blocking=True)
        frames = self.stream(z / c.inv_std + c.mean)
        if not frames.is_cuda:
            return lambda: frames
        host = torch.empty(frames.shape, dtype=frames.dtype, pin_memory=True)  # from torch's pinned-block cache
        host.copy_(frames, non_blocking=True)
        copied = torch.cuda.Event(blocking=True)  # the waiting thread sleeps instead of spinning
        copied.record(torch.cuda.current_stream(frames.device))

        def wait() -> torch.Tensor:
            copied.synchronize()
            return host

        return wait


class DiffusersDecoder:
    """diffusers' own decoder, for a VAE `WanDecoder` does not cover: `AutoencoderKLWan._decode`'s loop (one latent
    frame per `decoder` call, a causal feature cache between calls), with the cache held by each stream instead of
    on the shared module (`vae._feat_map`), so streams never clear or read each other's."""

    def __init__(self, vae):
        self.vae = vae

    def stream(self) -> DiffusersStream:
        return DiffusersStream(self.vae)


class DiffusersStream:
    def __init__(self, vae):
        self.vae = vae
        self.cache: list = [None] * vae._cached_conv_counts["decoder"]  # the list `clear_cache` gives `_feat_map`
        self.first = True
        self.unpatchify = (
            None
            if vae.config.patch_size is None
            else from_diffusers("unpatchify", "diffusers.models.autoencoders.autoencoder_kl_wan")
        )

    @torch.inference_mode()
    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        """un-normalised latents [1, C, T, h, w] → uint8 frames [T', H, W, 3] (same device)."""
        if z.shape[0] != 1:
            raise ValueError(f"a decoder stream decodes one video, latents [1, C, T, h, w]; got {tuple(z.shape)}")
        vae, outs = self.vae, []
        for i in range(z.shape[2]):
            # post_quant_conv too one frame at a time: then a frame's arithmetic is the same in any chunking
            x = vae.post_quant_conv(z[:, :, i : i + 1])
            outs.append(vae.decoder(x, feat_cache=self.cache, feat_idx=[0], first_chunk=self.first))
            self.first = False
        video = torch.cat(outs, dim=2)
        if self.unpatchify is not None:
            video = self.unpatchify(video, vae.config.patch_size)
        frames = (video[0].float().clamp(-1.0, 1.0) * 0.5 + 0.5).clamp(0, 1).permute(1, 2, 3, 0)
        return (frames * 255).round().to(torch.uint8)  # the pipeline's output_type="np" × 255, rounded


HostFrames = Callable[[], torch.Tensor]  # waits for a chunk's frames on the host, uint8 [T', H, W, 3]
