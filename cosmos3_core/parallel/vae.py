"""The VAE decode split by rows of the frame over the decode ranks (patch parallel, exact).

Rank j of n decodes latent rows `[off_j, off_j + h_j)` (`row_split`: as even as the height allows, every rank at
least one row) through the unchanged decoder forward (`wan_decoder.DecoderStream`) with three places where the
rows meet, overridden in `PatchStream`:
- every spatial convolution (3×3(×3) causal convs, the 2×2 phase convs of the upsamplers) first gets its
  neighbours' boundary rows (a halo as deep as the conv's own padding; zeros at the frame's edges, as the
  padding would be), then convolves without padding over rows — each output row sees exactly the inputs it
  sees in one process;
- the mid block's attention (per frame, over all pixels) all-gathers its K/V rows;
- the frames are all-gathered by rows at the end.
The causal cache per stream: each rank keeps its own rows' 2 context frames per conv (`DecoderStream.state`); the
halo of the context frames is exchanged with the new frames' every chunk, so chunk after chunk equals one decode.

Rank 0's `PatchDecoder` replaces the codec's decoder (`VaeCodec(wrap=…)`): its streams send each chunk's latents
as a "decode" command (stream id; ids of dropped streams ride along) and decode their own rows; the workers'
`DecodeWorker` keeps a `PatchStream` per stream id. A stream whose group was lost between chunks fails (its
workers' caches are gone).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..caches import precompiled_dir
from ..model.wan_decoder import EAGER, DecoderKernels, DecoderStream, WanDecoder, _linear, _rows
from .comm import Comm, all_gather_rows
from .group import Group, WorkerLost


def row_split(h: int, n: int) -> list[int]:
    if h < n:
        raise ValueError(f"parallel.vae: {n} ranks need at least {n} latent rows, the video has {h}")
    return [h // n + (i < h % n) for i in range(n)]


class PatchStream(DecoderStream):
    def __init__(self, decoder: WanDecoder, comm: Comm):
        super().__init__(decoder)
        self.comm = comm
        self.n, self.j = comm.parallel.vae, comm.rank
        self.sizes: list[int] = []  # latent rows per rank, fixed by the stream's first chunk

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """All ranks' call: the whole chunk's latents [1, C, T, h, w] → the whole chunk's frames [T', H, W, 3]."""
        if not self.sizes:
            self.sizes = row_split(z.shape[3], self.n)
        off = sum(self.sizes[: self.j])
        frames = self(z[:, :, :, off : off + self.sizes[self.j]])
        scale = frames.shape[1] // self.sizes[self.j]
        return all_gather_rows(frames, self.comm.decode_group, [s * scale for s in self.sizes], dim=1)

    def _halo(self, x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
        """x with its neighbours' `n` boundary rows along `dim` on either side (zeros past the frame's edge)."""
        edges = torch.stack([x.narrow(dim, 0, n), x.narrow(dim, x.shape[dim] - n, n)]).contiguous()
        parts = [torch.empty_like(edges) for _ in range(self.n)]
        dist.all_gather(parts, edges, group=self.comm.decode_group)
        above = parts[self.j - 1][1] if self.j > 0 else torch.zeros_like(edges[0])
        below = parts[self.j + 1][0] if self.j + 1 < self.n else torch.zeros_like(edges[0])
        return torch.cat([above, x, below], dim)

    def _causal(self, conv: torch.nn.Conv3d, inp: torch.Tensor) -> torch.Tensor:
        rows = conv._padding[2]  # (w, w, h, h, 2t, 0): the conv's padding over rows
        if rows == 0:
            return super()._causal(conv, inp)
        self.state[id(conv)] = inp[:, -2:].clone()  # this rank's rows only; their halo is exchanged every call
        y = F.conv3d(
            self._halo(inp, rows, 2).permute(0, 4, 1, 2, 3), conv.weight, None, padding=(0, 0, conv._padding[0])
        )
        return y.permute(0, 2, 3, 4, 1)

    def _phase_conv(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.conv2d(self._halo(x, 1, 1).permute(0, 3, 1, 2), weight, None, padding=(0, 1)).permute(0, 2, 3, 1)

    def _attention(self, attn, x: torch.Tensor) -> torch.Tensor:
        """As `DecoderStream._attention`, queries of this rank's rows over keys and values of all rows."""
        b, t, h, w, c = x.shape
        y = self.k.rms_norm(_rows(x), self.d.norm_weights[id(attn.norm)]).view(b * t, 1, h * w, c)
        q, k, v = _linear(attn.to_qkv, y).chunk(3, dim=-1)
        scale = h // self.sizes[self.j]  # the mid block runs at latent resolution: 1
        sizes = [s * scale * w for s in self.sizes]
        k, v = (
            all_gather_rows(k.contiguous(), self.comm.decode_group, sizes, 2),
            all_gather_rows(v.contiguous(), self.comm.decode_group, sizes, 2),
        )
        y = _linear(attn.proj, F.scaled_dot_product_attention(q, k, v))
        return x + y.reshape(b, t, h, w, c)


class PatchDecoder:
    """Rank 0's decoder: `stream()` as `WanDecoder.stream()`, decoding over the group's decode ranks."""

    def __init__(self, decoder: WanDecoder, group: Group):
        self.decoder, self.group = decoder, group
        self.next_id = 0
        self.dropped: list[int] = []  # streams garbage-collected here: their workers' caches go with the next chunk
        self._lock = threading.Lock()

    def stream(self) -> PatchStreamHandle:
        with self._lock:
            self.next_id += 1
            return PatchStreamHandle(self, self.next_id)

    def take_dropped(self) -> list[int]:
        with self._lock:
            out, self.dropped = self.dropped, []
            return out


class PatchStreamHandle:
    def __init__(self, owner: PatchDecoder, sid: int):
        self.owner, self.sid = owner, sid
        self.local: PatchStream | None = None
        self.generation = 0
        weakref.finalize(self, owner.dropped.append, sid)

    @torch.inference_mode()
    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        """un-normalised latents [1, C, T, h, w] → uint8 frames [T', 16h, 16w, 3] (same device)."""
        g = self.owner.group
        if self.local is not None and (not g.running or g.generation != self.generation):
            raise WorkerLost(g.lost or "parallel group restarted; this stream's decoder caches are gone")
        with g.session("decode", {"stream": self.sid, "drop": self.owner.take_dropped()}, [z]) as comm:
            if self.local is None:
                self.local, self.generation = PatchStream(self.owner.decoder, comm), g.generation
            return self.local.decode(z)


class DecodeWorker:
    """A worker's side of "decode": a `PatchStream` per stream id (the most recent MAX_STREAMS)."""

    MAX_STREAMS = 256

    def __init__(self, vae: Any, comm: Comm, compile: bool):
        self.decoder = WanDecoder(vae, DecoderKernels.compiled(precompiled_dir()) if compile else EAGER)
        self.comm = comm
        self.streams: OrderedDict[int, PatchStream] = OrderedDict()

    def run(self, header: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        for sid in header["drop"]:
            self.streams.pop(sid, None)
        sid = header["stream"]
        stream = self.streams.pop(sid, None) or PatchStream(self.decoder, self.comm)
        self.streams[sid] = stream
        while len(self.streams) > self.MAX_STREAMS:
            self.streams.popitem(last=False)
        stream.decode(tensors[0].to(self.decoder.vae.dtype))
