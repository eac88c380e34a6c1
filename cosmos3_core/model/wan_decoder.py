"""Our forward of the Wan2.2 VAE decoder over diffusers' `AutoencoderKLWan` weights (`post_quant_conv`, `decoder`).

Contract: `WanDecoder(vae, kernels)` prepares a loaded VAE once; `decoder.stream()` decodes one video's latents
chunk by chunk along time: `stream(z)` takes the next un-normalised latents [1, C, T, h, w] and returns that chunk's frames, uint8 [T', 16h, 16w, 3] on the
latents' device (T' = 1 + 4(T-1) for the stream's first chunk, 4T after). The joined chunks equal diffusers'
`AutoencoderKLWan.decode` (which runs one latent frame per decoder call) within float rounding.

Why our own forward: diffusers' decode is 60 % elementwise work (pads, concatenations, layout transposes for
cuDNN, unfused norms) around 40 % convolutions. Here:
- activations are channels-last, `[B, T, H, W, C]` contiguous: the RMS norms reduce over the contiguous axis and
  cuDNN convolves the `[B, C, T, H, W]` view (channels_last_3d strides) with no transposes;
- spatial padding is the convolution's own; causal time padding is a per-conv state (the last 2 frames of its
  input, zeros at the stream's start) concatenated in the same kernel that normalises and activates the input;
- convolutions run without their bias; the kernel that reads the output next adds it (torch's own bias add is a
  separate broadcast pass over the whole activation);
- each nearest-2× upsample + 3×3 conv runs as one 2×2 conv at low resolution (`phase_weights`);
- after the first latent frame (which the temporal upsamplers do not double), up to `frames_per_call` latent
  frames go through each call on CUDA, so every kernel sees several frames; the deployment's memory plan picks
  them per frame size (memory.py: 4 at 480p, 1 at 720p and above, where one frame's activations are already large
  and a call's memory grows with its frames). On CPU it is one: a conv's
  rounding depends on its input's length, and one frame per call decodes any chunking of a stream bit for bit
  alike (the CPU tests compare served pieces with offline whole videos exactly).
`DecoderKernels.compiled()` fuses the elementwise functions with torch.compile: every axis but the channels is
dynamic, and a time axis unbacked (a stream's first piece of one latent frame shares the later pieces' graph);
channels stay static, so loads vectorise along them and the norms reduce over a known length (with symbolic channels
the kernels ran at a fraction of the memory bandwidth). Served, they are compiled ahead per signature and kept
on disk (`precompiled.py`; a first piece's one latent frame is a signature of its own there): a restarted decoder
loads its kernels instead of tracing them again.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from ..precompiled import Precompiled


def norm_silu_cat(x: torch.Tensor, bias: torch.Tensor | None, weight: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """One video's frames as rows [T·H·W, C] (+ the producing conv's `bias`, if still to add) → [prev (its 2
    context frames, [2·H·W, C]) | silu(rms_norm(x))]: a causal conv's input."""
    if bias is not None:
        x = x.float() + bias.float()
    return torch.cat([prev, F.silu(rms_norm(x, weight)).to(prev.dtype)])


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Wan's RMS_norm over channels (last dim): F.normalize in fp32, × sqrt(C)·gamma (`weight`)."""
    return (F.normalize(x.float(), dim=-1) * weight).to(x.dtype)


def add_bias(y: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """A conv's output as rows [N, C] + its bias [C] (+ the residual branch [N, C]), rounded once."""
    out = y.float() + bias.float()
    if residual is not None:
        out = out + residual.float()
    return out.to(y.dtype)


def split_time(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The temporal upsampler's conv output [B, T, H, W, 2C] (+ bias), channel (s, c) → frame 2t + s:
    [B, 2T, H, W, C]."""
    b, t, h, w, c2 = y.shape
    y = (y.float() + bias.float()).to(y.dtype)
    return y.reshape(b, t, h, w, 2, c2 // 2).permute(0, 1, 4, 2, 3, 5).reshape(b, 2 * t, h, w, c2 // 2)


def dup_up_add(x: torch.Tensor, shortcut: torch.Tensor, factor_t: int, drop: int) -> torch.Tensor:
    """x [B, T·ft - drop, 2H, 2W, C] + DupUp3D(shortcut [B, T, H, W, Cin]); `drop` (ft - 1 on a stream's first
    frame, T = 1) leading frames are not in x.

    DupUp3D repeats each input channel r = C·ft·4 / Cin times and unfolds the result into (channel, time, row,
    column) sub-positions, so output channel o at sub-position s = (a, i, j) reads input channel
    (o·ft·4 + s) // r = o·g + s // r with g = ft·4 / r: the g input channels of output channel o spread over the
    outermost sub-position axes. Written as a broadcast add on views of x, the kernel walks x in order.
    Needs Cin to be a multiple of C (Wan2.2: 1 or 2); `WanDecoder` checks that at load."""
    b, t, h, w, c_in = shortcut.shape
    c = x.shape[-1]
    g = c_in // c  # input channels per output channel, spread over (a, i, j) from the outermost axis in
    spread = []
    for n in (factor_t, 2, 2):
        spread.append(n if g > 1 else 1)
        g //= spread[-1]
    src = shortcut.reshape(b, t, h, w, c, *spread).permute(0, 1, 5, 2, 6, 3, 7, 4)  # [b, t, a, h, i, w, j, c]
    if spread[0] > 1:
        src = src[:, :, drop:]
    xv = x.reshape(b, t, -1, h, 2, w, 2, c)
    return (xv + src).reshape(x.shape)


def to_frames(y: torch.Tensor, bias: torch.Tensor, patch: int) -> torch.Tensor:
    """decoder output [1, T, H, W, 3·p·p] (channel = (rgb, p_w, p_h)) + conv_out's bias → uint8 [T, pH, pW, 3]."""
    _, t, h, w, _ = y.shape
    y = y[0].float() + bias.float()
    y = y.reshape(t, h, w, 3, patch, patch).permute(0, 1, 5, 2, 4, 3).reshape(t, h * patch, w * patch, 3)
    return ((y.clamp(-1.0, 1.0) * 0.5 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)


def phase_weights(weight: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 3×3 conv after a nearest 2× upsample → one 2×2 conv over the low-resolution input (padding 1) with 4×
    the output channels, phase (a, b) = output pixel (2i+a, 2j+b) at conv position (i+a, j+b).

    Output row 2i+a reads upsampled rows 2i+a-1 .. 2i+a+1 = input rows (i-1, i, i) for a = 0 and (i, i, i+1)
    for a = 1, so the 3 kernel rows fold into 2 taps: [w0, w1+w2] or [w0+w1, w2]; columns likewise.
    2.25× fewer FLOPs than the conv at full resolution, and no upsampled copy. Folded in fp32."""
    fold = torch.tensor([[[1.0, 0, 0], [0, 1, 1]], [[1, 1, 0], [0, 0, 1]]], device=weight.device)  # [a, tap, row]
    k = torch.einsum("ary,ocyx,bsx->abocrs", fold, weight.float(), fold)  # [a, b, out, in, 2, 2]
    k = k.reshape(-1, *k.shape[3:]).to(weight.dtype).contiguous(memory_format=torch.channels_last)
    return k, bias.repeat(4)


def phases_to_pixels(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """phase conv output [N, h+1, w+1, 4C] (channel = (a, b, c)) + its bias [4C] → [N, 2h, 2w, C]."""
    n, h, w, c = y.shape[0], y.shape[1] - 1, y.shape[2] - 1, y.shape[3] // 4
    y = (y.float() + bias.float()).to(y.dtype).view(n, h + 1, w + 1, 2, 2, c)
    rows = [torch.stack([y[:, a : a + h, b : b + w, a, b] for b in (0, 1)], dim=3) for a in (0, 1)]
    return torch.stack(rows, dim=2).reshape(n, 2 * h, 2 * w, c)  # [N, h, a, w, b, C]


@dataclass(frozen=True)
class DecoderKernels:
    """The decoder's elementwise functions: eager, or compiled once for all sizes."""

    norm_silu_cat: Callable = norm_silu_cat
    rms_norm: Callable = rms_norm
    add_bias: Callable = add_bias
    split_time: Callable = split_time
    dup_up_add: Callable = dup_up_add
    phases_to_pixels: Callable = phases_to_pixels
    to_frames: Callable = to_frames

    @classmethod
    def compiled(cls, store: Path | None = None) -> DecoderKernels:
        """`store`: the folder of their artifacts compiled ahead (`precompiled.py`; `caches.precompiled_dir()`), so a
        restart loads them instead of tracing them again; None: traced by every process."""

        def c(fn: Callable, time: tuple[tuple[int, int], ...] = ()) -> Callable:
            static = torch.compile(fn, dynamic=False)  # one graph per channel count (and per int argument)
            unbacked = list(time)  # emptied when this torch cannot compile them unbacked: then backed, as before

            def marked(args: list, time: tuple[tuple[int, int], ...]) -> list:
                """Fresh views of the tensor arguments (the marks are theirs), every axis but the channels dynamic
                (backed: sizes 0 and 1 still specialise), the `time` axes unbacked: 1 on a stream's first piece,
                which then shares the later pieces' graph (24 → 17 graphs at warmup)."""
                out = [a.contiguous().view(a.shape) if isinstance(a, torch.Tensor) else a for a in args]  # one layout
                for a in out:
                    if isinstance(a, torch.Tensor):
                        for dim in range(a.dim() - 1):
                            torch._dynamo.maybe_mark_dynamic(a, dim)
                for i, dim in time:
                    torch._dynamo.decorators.mark_unbacked(out[i], dim)
                return out

            def refused(e: Exception) -> None:
                unbacked.clear()
                print(f"cosmos3: the decoder's {fn.__name__} compiles with its time axis backed here "
                      f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})",
                      file=sys.stderr)  # fmt: skip

            def run(*args):
                axes = tuple(unbacked)  # read once: a refusal on another thread empties it
                if axes:
                    try:
                        inputs = marked(list(args), axes)
                    except Exception as e:  # noqa: BLE001 - a torch without (or refusing) unbacked marks
                        refused(e)
                    else:
                        try:
                            return static(*inputs)
                        except (torch._dynamo.exc.TorchDynamoException, GuardOnDataDependentSymNode) as e:
                            refused(e)  # tracing or compiling them unbacked failed; an error of the run propagates
                            return static(*marked(list(args), ()))
                return static(*marked(list(args), ()))

            if store is None:
                return run
            marks = [lambda args: marked(args, time)] + ([lambda args: marked(args, ())] if time else [])
            return Precompiled(fn, marks, store, run)  # time axes unbacked, else backed, as above

        return cls(
            c(norm_silu_cat), c(rms_norm), c(add_bias),  # rows [T·H·W, C]: 1 only at a 1×1 latent grid
            c(split_time, time=((0, 1),)),
            c(dup_up_add, time=((0, 1), (1, 1))),
            c(phases_to_pixels, time=((0, 0),)),  # [B·T, h+1, w+1, 4C]
            c(to_frames, time=((0, 1),)),
        )  # fmt: skip


EAGER = DecoderKernels()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[1, T, H, W, C] → [T·H·W, C] (a copy only for an output cuDNN left channels-first)."""
    return x.reshape(-1, x.shape[-1])


def _linear(conv: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A 1×1(×1) convolution over channels-last x: a GEMM."""
    return F.linear(x, conv.weight.flatten(1), conv.bias)


def unsupported(vae) -> str | None:
    """Why `WanDecoder` cannot decode this `AutoencoderKLWan` (None: it can)."""
    cfg = vae.config
    if not cfg.is_residual or cfg.patch_size != 2 or cfg.out_channels != 12:
        return (
            "the decoder forward is Wan2.2's (is_residual, patch_size 2, out_channels 12 = RGB × 2 × 2); this VAE "
            f"has is_residual={cfg.is_residual}, patch_size={cfg.patch_size}, out_channels={cfg.out_channels}"
        )
    for block in vae.decoder.up_blocks:
        if block.avg_shortcut is not None and block.avg_shortcut.in_channels % block.avg_shortcut.out_channels:
            return (
                f"DupUp3D {block.avg_shortcut.in_channels} → {block.avg_shortcut.out_channels} channels: the "
                "broadcast form needs a whole number of input channels per output"
            )
    return None


class WanDecoder:
    """One loaded VAE's decoder, prepared once: conv weights channels-last (cuDNN then keeps activations
    channels-last), upsample convs folded into phase convs, norm scales folded into their weights. `stream()`
    starts a video."""

    def __init__(
        self,
        vae,
        kernels: DecoderKernels = EAGER,
        frames_per_call: int | Callable[[int, int], int] | None = None,
        band_rows: Callable[[int, int], int] | None = None,
    ):
        """`frames_per_call`: latent frames per call after a stream's first, a count or a function of the latent
        grid (h, w); None: 4 on CUDA (16 output frames a call), 1 on CPU. `band_rows`: latent rows per band of a
        frame of latent grid (h, w) (`BandedStream`; ≥ h: the whole frame); None: whole frames."""
        if (reason := unsupported(vae)) is not None:
            raise ValueError(reason)
        self.vae, self.kernels = vae, kernels
        cuda = next(p for p in vae.decoder.parameters()).is_cuda
        frames = frames_per_call or (4 if cuda else 1)
        self.frames_per_call: Callable[[int, int], int] = frames if callable(frames) else (lambda h, w: frames)
        self.band_rows = band_rows
        self.phases: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(upsample Conv2d) → phase_weights
        self.norm_weights: dict[int, torch.Tensor] = {}  # id(WanRMS_norm) → sqrt(C)·gamma [C]
        with torch.no_grad():
            for m in vae.decoder.modules():
                if hasattr(m, "gamma"):  # WanRMS_norm (no bias in the decoder)
                    self.norm_weights[id(m)] = (m.gamma.float().flatten() * m.scale).to(m.gamma.dtype)
                elif isinstance(m, torch.nn.Conv3d):
                    m.weight.data = m.weight.data.contiguous(memory_format=torch.channels_last_3d)
                elif hasattr(m, "resample") and isinstance(m.resample, torch.nn.Sequential):  # WanResample
                    conv = m.resample[1]
                    self.phases[id(conv)] = phase_weights(conv.weight, conv.bias)

    def stream(self) -> DecoderStream | BandedStream:
        return DecoderStream(self) if self.band_rows is None else BandedStream(self)


class BandedStream:
    """A stream whose frames decode in horizontal bands of latent rows, each through its own `DecoderStream` (its
    own causal state) over its rows and `HALO_ROWS` more on either side, cropped back to its rows: a call holds one
    band's activations, not the frame's. The halo stands in for the rows beyond it (zeros at the band's edge where
    the whole frame has values, and the mid block's attention sees the band's pixels only), so a band's rows differ
    from the whole frame's by less than diffusers' own tiled decode (tiles of 16 latent rows, 4 blended):
    `tests/test_memory.py` holds it to that. The bands are fixed by the stream's first chunk."""

    HALO_ROWS = 8

    def __init__(self, decoder: WanDecoder):
        self.d = decoder
        self.bands: list[tuple[int, int, DecoderStream]] = []

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        """un-normalised latents [1, C, T, h, w] → uint8 frames [T', 16h, 16w, 3]."""
        h = z.shape[3]
        if not self.bands:
            rows = max(1, self.d.band_rows(h, z.shape[4]))  # type: ignore[misc]
            n = -(-h // rows)
            edges = [h * i // n for i in range(n + 1)]
            self.bands = [(a, b, DecoderStream(self.d)) for a, b in zip(edges, edges[1:])]
        if len(self.bands) == 1:
            return self.bands[0][2](z)
        pieces = []
        for a, b, stream in self.bands:
            lo, hi = max(0, a - self.HALO_ROWS), min(h, b + self.HALO_ROWS)
            frames = stream(z[:, :, :, lo:hi])  # [T', (hi - lo)·s, W, 3]
            s = frames.shape[1] // (hi - lo)
            pieces.append(frames[:, (a - lo) * s : (b - lo) * s])
        return torch.cat(pieces, dim=1)


class DecoderStream:
    def __init__(self, decoder: WanDecoder):
        self.d, self.vae, self.dec, self.k = decoder, decoder.vae, decoder.vae.decoder, decoder.kernels
        self.state: dict[int, torch.Tensor] = {}  # id(conv) → its input's last 2 frames [B, 2, H, W, C]
        self.first = True

    @torch.inference_mode()
    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        """un-normalised latents [1, C, T, h, w] → uint8 frames [T', 16h, 16w, 3] (same device)."""
        if z.shape[0] != 1:  # the kernels treat one video's frames as rows
            raise ValueError(f"a decoder stream decodes one video, latents [1, C, T, h, w]; got {tuple(z.shape)}")
        x = z.to(self.vae.dtype).permute(0, 2, 3, 4, 1)  # [1, T, h, w, C]
        x = _linear(self.vae.post_quant_conv, x)
        outs = []
        if self.first:
            outs.append(self._forward(x[:, :1]))
            self.first, x = False, x[:, 1:]
        n = self.d.frames_per_call(z.shape[3], z.shape[4])
        for a in range(0, x.shape[1], n):
            outs.append(self._forward(x[:, a : a + n]))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _causal(self, conv: torch.nn.Conv3d, inp: torch.Tensor) -> torch.Tensor:
        """inp = [context (2 frames) | x] → conv over time without padding, over space with its own padding; the
        caller's next kernel adds `conv.bias`."""
        self.state[id(conv)] = inp[:, -2:].clone()
        pad = (0, conv._padding[2], conv._padding[0])  # WanCausalConv3d keeps (w, w, h, h, 2t, 0) in _padding
        y = F.conv3d(inp.permute(0, 4, 1, 2, 3), conv.weight, None, padding=pad)
        return y.permute(0, 2, 3, 4, 1)

    def _context(self, conv: torch.nn.Conv3d, x: torch.Tensor) -> torch.Tensor:
        prev = self.state.get(id(conv))
        return prev if prev is not None else x.new_zeros((x.shape[0], 2, *x.shape[2:]))

    def _norm_conv(self, norm, conv, x: torch.Tensor, x_bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.d.norm_weights[id(norm)]
        b, t, h, w, c = x.shape
        inp = self.k.norm_silu_cat(_rows(x), x_bias, weight, _rows(self._context(conv, x)))
        return self._causal(conv, inp.view(b, t + 2, h, w, c))

    def _plain_conv(self, conv, x: torch.Tensor) -> torch.Tensor:
        return self._causal(conv, torch.cat([self._context(conv, x), x], dim=1))

    def _resnet(self, block, x: torch.Tensor) -> torch.Tensor:
        h = x if isinstance(block.conv_shortcut, torch.nn.Identity) else _linear(block.conv_shortcut, x)
        y = self._norm_conv(block.norm1, block.conv1, x)
        y = self._norm_conv(block.norm2, block.conv2, y, block.conv1.bias)
        return self.k.add_bias(_rows(y), block.conv2.bias, _rows(h)).view(y.shape)

    def _attention(self, attn, x: torch.Tensor) -> torch.Tensor:
        """Single-head self-attention within each frame (head dim = channels)."""
        b, t, h, w, c = x.shape
        y = self.k.rms_norm(_rows(x), self.d.norm_weights[id(attn.norm)]).view(b * t, 1, h * w, c)
        q, k, v = _linear(attn.to_qkv, y).chunk(3, dim=-1)
        y = _linear(attn.proj, F.scaled_dot_product_attention(q, k, v))
        return x + y.reshape(b, t, h, w, c)

    def _upsample(self, resample, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        if resample.mode == "upsample3d" and not self.first:  # frame 0 is not doubled in time
            x = self.k.split_time(self._plain_conv(resample.time_conv, x), resample.time_conv.bias)
        t, h, w, c = x.shape[1:]
        weight, bias = self.d.phases[id(resample.resample[1])]
        y = self.k.phases_to_pixels(self._phase_conv(x.reshape(b * t, h, w, c), weight), bias)  # [B·T, 2H, 2W, C']
        return y.reshape(b, t, 2 * h, 2 * w, -1)

    def _phase_conv(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """[N, h, w, C] → the phase conv's output [N, h+1, w+1, 4C'] (padding 1; the caller adds the bias)."""
        return F.conv2d(x.permute(0, 3, 1, 2), weight, None, padding=1).permute(0, 2, 3, 1)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.dec
        y = self._plain_conv(d.conv_in, x)
        x = self.k.add_bias(_rows(y), d.conv_in.bias, None).view(y.shape)
        mid = d.mid_block
        x = self._resnet(mid.resnets[0], x)
        for attn, resnet in zip(mid.attentions, mid.resnets[1:], strict=True):
            x = self._resnet(resnet, self._attention(attn, x))
        for block in d.up_blocks:
            shortcut = x
            for resnet in block.resnets:
                x = self._resnet(resnet, x)
            if block.upsampler is not None:
                x = self._upsample(block.upsampler, x)
            if block.avg_shortcut is not None:
                ft = block.avg_shortcut.factor_t
                x = self.k.dup_up_add(x, shortcut, ft, ft - 1 if self.first else 0)
        x = self._norm_conv(d.norm_out, d.conv_out, x)
        return self.k.to_frames(x, d.conv_out.bias, self.vae.config.patch_size)
