"""Where the GPU time goes: kernel time by category for Edge denoise steps and for the Wan2.2 VAE decode, each
against its compute floor, with diffusers' decode and our decoder (eager, compiled kernels) side by side.

  python -m bench.profile_phases [--steps 2] [--no-denoise] [--no-decode]   (CUDA)

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

from cosmos3_core.deployment import Deployment
from cosmos3_core.generate import Generator
from cosmos3_core.model.wan_decoder import EAGER
from cosmos3_core.windows import latent_frames

from .floor import H200_BF16_FLOPS, denoise_flops, tokens_for
from .inprocess import PROMPT

CATEGORIES = (
    (
        "attention",
        ("flashinfer", "prefill", "fmha", "flash", "attn", "merge_state", "cudnn_generated_fort_native_sdpa"),
    ),
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
    print(
        "  " + "  ".join(f"{c} {ms:.1f} ms ({ms / total:.0%})" for c, ms in sorted(cats.items(), key=lambda kv: -kv[1]))
    )
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


def decode_flops(vae, latents: torch.Tensor) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        vae.decode(latents[:, :, :2])  # frame 0 (1 pixel frame) + one steady frame (4)
    two = fc.get_total_flops()
    with FlopCounterMode(display=False) as fc:
        vae.decode(latents[:, :, :1])
    first = fc.get_total_flops()
    return first + (two - first) * (latents.shape[2] - 1)


def profile_decode(gen: Generator, params: dict, top: int, repeat: int) -> None:
    """diffusers' decode (its module forward, a fresh copy of the VAE) vs ours eager vs ours compiled."""
    codec = gen.decode.codec
    cfg = gen.engine.model.cfg
    shape = (1, cfg.latent_channel, latent_frames(params["num_frames"], cfg.vae_scale_temporal),
             *cfg.latent_hw(params["height"], params["width"]))  # fmt: skip
    lat = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(codec.device)
    theirs = gen.ckpt.load_vae(codec.device, codec.dtype)
    x = lat.to(codec.dtype) / codec.inv_std.to(lat.device) + codec.mean.to(lat.device)
    flops = decode_flops(theirs, x)
    floor = flops / H200_BF16_FLOPS
    print(f"== decode {tuple(lat.shape)} latents, {flops:.3g} FLOP, floor {floor:.2f} s")

    def diffusers_decode() -> torch.Tensor:
        video = theirs.decode(x).sample.clamp(-1, 1)[0].permute(1, 2, 3, 0)
        return ((video.float() * 0.5 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).cpu()

    ref, t_ref = timed(diffusers_decode, repeat)
    rows = [("diffusers AutoencoderKLWan.decode", t_ref, 0)]
    compiled = codec.decoder.kernels
    variants = [("ours, eager kernels", EAGER)] + (
        [("ours, compiled kernels", compiled)] if compiled is not EAGER else []
    )
    for name, kernels in variants:
        codec.decoder.kernels = kernels
        out, t = timed(lambda: codec.decode(lat), repeat)
        rows.append((name, t, int((out.int() - ref.int()).abs().max())))
    with profile(activities=ACTIVITIES) as prof:
        codec.decode(lat)
        sync()
    print(f"  ours, {'compiled' if compiled is not EAGER else 'eager'} kernels, by kernel:")
    kernel_table(prof, 1, top)
    print(f"{'decode variant':36s} {'time':>7s} {'/floor':>7s} {'max|diff|':>9s}")
    for name, t, diff in rows:
        print(f"{name:36s} {t:7.2f} {t / floor:7.2f} {diff:9d}")


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
    ap.add_argument("--no-decode", action="store_true")
    args = ap.parse_args()
    d = Deployment(checkpoint=args.checkpoint, device=args.device, pool_pages=1024, compile=True,
                   attention=args.attention, cuda_graphs=False)  # fmt: skip
    gen = Generator(d)
    params = {"height": args.height, "width": args.width, "num_frames": args.frames, "steps": args.steps,
              "guidance_scale": 6.0, "shift": 5.0, "seed": 0}  # fmt: skip
    if not args.no_denoise:
        profile_denoise(gen, params, args.top)
    if not args.no_decode:
        profile_decode(gen, params, args.top, args.repeat)


if __name__ == "__main__":
    main()
