"""Where the GPU time goes: kernel time by category for Edge denoise steps and for the Wan2.2 VAE decode, each
against its compute floor, plus the decode's variants (eager, torch.compile, channels_last_3d) side by side.

  python -m bench.profile_phases [--steps 2] [--decode-variants eager compile]   (CUDA)

Categories come from kernel names: attention (FlashInfer/flash/cuDNN attention), gemm (cuBLAS/CUTLASS),
conv (cuDNN convolutions), fused (Triton kernels from torch.compile), other (eager elementwise, copies).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from cosmos3_core.conditioning import StreamDecoder
from cosmos3_core.deployment import Deployment
from cosmos3_core.generate import Generator

from .floor import H200_BF16_FLOPS, denoise_flops, tokens_for
from .inprocess import PROMPT

CATEGORIES = (
    ("attention", ("flashinfer", "prefill", "fmha", "flash", "attn", "merge_state", "cudnn_generated_fort_native_sdpa")),
    ("conv", ("conv", "implicit", "fprop", "dgrad", "winograd")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul")),
    ("fused", ("triton",)),
)


# off CUDA (a smoke run) the CPU ops stand in for kernels; nested ops then count twice
ACTIVITIES = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
KERNELS = DeviceType.CUDA if torch.cuda.is_available() else DeviceType.CPU


def category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), "other")


def kernel_table(prof, per: float, top: int) -> dict[str, float]:
    """Print the top kernels and per-category totals (ms, divided by `per`) → category totals in s."""
    by_name: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for e in prof.events():
        if e.device_type == KERNELS:
            by_name[e.name] += e.time_range.elapsed_us() / 1e3
            counts[e.name] += 1
    cats: dict[str, float] = defaultdict(float)
    for name, ms in by_name.items():
        cats[category(name)] += ms / per
    for name, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {ms / per:9.2f} ms {counts[name] / per:7.0f}x  [{category(name):9s}] {name[:110]}")
    total = sum(cats.values())
    print("  " + "  ".join(f"{c} {ms:.1f} ms ({ms / total:.0%})" for c, ms in sorted(cats.items(), key=lambda kv: -kv[1])))
    return {c: ms / 1e3 for c, ms in cats.items()}


def profile_denoise(gen: Generator, params: dict, top: int) -> None:
    cfg = gen.engine.model.cfg
    pre = gen.prefill.run(gen.prefill.validate(PROMPT, params, None), None)
    gen.latents_from(pre)  # warm at this exact layout
    with profile(activities=ACTIVITIES) as prof:
        gen.latents_from(pre)
        sync()
    steps = params["steps"]
    print(f"== denoise, per step ({steps} steps profiled)")
    cats = kernel_table(prof, steps, top)
    tokens = tokens_for(cfg, params["height"], params["width"], params["num_frames"])
    text = pre.text_k[0].shape[1]
    step_floor = denoise_flops(cfg, tokens, text, 1, 2) / H200_BF16_FLOPS
    step_s = sum(cats.values())
    print(f"  kernel time {step_s * 1e3:.1f} ms / step; floor {step_floor * 1e3:.1f} ms ({step_s / step_floor:.2f}x)")


def decode_with(decoder_fn, codec, latents: torch.Tensor) -> torch.Tensor:
    """StreamDecoder.decode with the decoder call swapped (eager or compiled)."""
    dec = StreamDecoder(codec)
    vae = codec.vae
    original = vae.decoder.forward
    vae.decoder.forward = decoder_fn
    try:
        return dec.decode(latents)
    finally:
        vae.decoder.forward = original


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeat: int) -> tuple[torch.Tensor, float]:
    out = fn()
    ts = []
    for _ in range(repeat):
        sync()
        t = time.perf_counter()
        out = fn()
        sync()
        ts.append(time.perf_counter() - t)
    return out, min(ts)


def decode_flops(codec, latents: torch.Tensor) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        StreamDecoder(codec).decode(latents[:, :, :2])  # frame 0 (1 pixel frame) + one steady frame (4)
    one = fc.get_total_flops()
    with FlopCounterMode(display=False) as fc:
        StreamDecoder(codec).decode(latents[:, :, :1])
    first = fc.get_total_flops()
    return first + (one - first) * (latents.shape[2] - 1)


def profile_decode(gen: Generator, params: dict, variants: list[str], top: int, repeat: int) -> None:
    codec = gen.decode.codec
    cfg = gen.engine.model.cfg
    shape = (1, cfg.latent_channel, 1 + (params["num_frames"] - 1) // cfg.vae_scale_temporal,
             params["height"] // cfg.vae_scale_spatial, params["width"] // cfg.vae_scale_spatial)  # fmt: skip
    lat = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(codec.device)
    flops = decode_flops(codec, lat)
    floor = flops / H200_BF16_FLOPS
    eager = codec.vae.decoder.forward
    ref, t_eager = timed(lambda: decode_with(eager, codec, lat), repeat)
    with profile(activities=ACTIVITIES) as prof:
        decode_with(eager, codec, lat)
        sync()
    print(f"== decode {tuple(lat.shape)} latents → {tuple(ref.shape)}, {flops:.3g} FLOP, floor {floor:.2f} s")
    kernel_table(prof, 1, top)
    rows = [("eager", t_eager, 0)]
    for variant in variants:
        if variant == "eager":
            continue
        if "channels_last" in variant:
            for m in codec.vae.decoder.modules():
                if isinstance(m, torch.nn.Conv3d | torch.nn.Conv2d):
                    m.to(memory_format=torch.channels_last_3d if isinstance(m, torch.nn.Conv3d) else torch.channels_last)
        fn = torch.compile(eager, dynamic=False) if "compile" in variant else eager
        t0 = time.perf_counter()
        out, t = timed(lambda fn=fn: decode_with(fn, codec, lat), repeat)
        print(f"  {variant}: first call + timing took {time.perf_counter() - t0:.0f} s")
        rows.append((variant, t, int((out.int() - ref.int()).abs().max())))
    print(f"{'decode variant':28s} {'time':>7s} {'/floor':>7s} {'max|diff|':>9s}")
    for name, t, diff in rows:
        print(f"{name:28s} {t:7.2f} {t / floor:7.2f} {diff:9d}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default="random:edge")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--frames", type=int, default=121)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--attention", default="flashinfer")
    ap.add_argument("--no-denoise", action="store_true")
    ap.add_argument("--decode-variants", nargs="*", default=["eager", "compile", "channels_last+compile"])
    args = ap.parse_args()
    d = Deployment(checkpoint=args.checkpoint, device=args.device, pool_pages=1024, compile=True,
                   attention=args.attention, cuda_graphs=False)  # fmt: skip
    gen = Generator(d)
    params = {"height": args.height, "width": args.width, "num_frames": args.frames, "steps": args.steps,
              "guidance_scale": 6.0, "shift": 5.0, "seed": 0}  # fmt: skip
    if not args.no_denoise:
        profile_denoise(gen, params, args.top)
    if args.decode_variants:
        profile_decode(gen, params, args.decode_variants, args.top, args.repeat)


if __name__ == "__main__":
    main()
