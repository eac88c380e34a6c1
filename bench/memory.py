"""Each part's GPU memory against its plan (cosmos3_core/memory.py), in-process on one GPU, random weights at real
shapes.

  python -m bench.memory --preset nano [--precision fp8] [--compile] [--json out/memory.json]
  python -m bench.memory --served configs/nano.yaml [--precision fp8] [--request default largest] [--steps 2]

For each part, loaded alone as the server loads it (the plan's weights), then run at several sizes: the allocator's
own peak (`torch.cuda.max_memory_allocated`) over what was resident before, beside the plan's figure for the same
size. Rows: the GEN tower, the denoise step (through `DenoiseEngine`'s warmup: the real row builder and step, 2
steps, CUDA graphs as served), the VAE decoder per call (1 and 4 latent frames a call) and over a stream of 4-frame
pieces as served (each also as the allocator's reserved growth), the VAE encoder (an i2v frame), the UND pass at
max_prompt_tokens. Prints one line a row and the ratio measured / planned.

`--served`: the whole server on the config (random weights of its model's preset, no guardrail), each process's GPU
memory read every 10 ms through NVML (nvidia-smi's own count; nvidia-smi itself where NVML cannot be read) from
launch through its requests: each part's peak beside its plan, and the whole card's. `--request streams` runs the plan's live decoder streams at once (`MemoryPlan.
decode_streams`): an AR request at the largest frame beside the others at the default size, their windows decoded in
turn, so that the decoder holds every stream's causal state together, as the plan counts it.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from cosmos3_core import memory
from cosmos3_core.deployment import Deployment
from cosmos3_core.engine import DenoiseEngine
from cosmos3_core.model.conditioning import StreamDecoder, VaeCodec
from cosmos3_core.model.layers import GEN, UND
from cosmos3_core.model.rotary import rotary_tables, text_position_ids
from cosmos3_core.model.towers import prefill_text_kv
from cosmos3_core.requests import validate
from cosmos3_core.sampling import checkpoint_shift

from . import prom

GIB = memory.GIB
STEP_SIZES = [(480, 832, 121), (720, 1280, 121), (720, 1280, 189)]
DECODE_SIZES = [(480, 832), (720, 1280), (1280, 1280)]


def fresh() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def row(rows: list[dict], part: str, what: str, measured: int, planned: int) -> None:
    ratio = measured / planned if planned else float("nan")
    rows.append({"part": part, "what": what, "measured": measured, "planned": planned, "ratio": ratio})
    print(f"{part:<10} {what:<44} measured {measured / GIB:7.2f} GiB  plan {planned / GIB:7.2f} GiB  "
          f"ratio {ratio:5.2f}", flush=True)  # fmt: skip


PART_OF = {"cosmos3_prefill": "prefill", "cosmos3_denoise": "denoise", "cosmos3_vae_decode": "vae_decode"}


class GpuProcesses:
    """pid → bytes used on the GPUs, nvidia-smi's own count (NVML, contexts included). Read through libnvidia-ml
    directly: a query takes well under a millisecond where nvidia-smi's takes ~50 ms, so a sampler every 10 ms sees
    a warmup's peak that lasts a fraction of a second. NVML's per-process record (nvmlProcessInfo_t: pid, used bytes,
    two instance ids) is 24 bytes, 32 on R535 drivers (one field more, the same function version): the stride is the
    one whose records all name live processes. Each new set of pids is checked against nvidia-smi's; a disagreement
    or an NVML error falls back to nvidia-smi for the rest of the run (`source` says which)."""

    RECORDS = 128
    STRIDES = (24, 32)

    def __init__(self) -> None:
        self.nvml, self.known, self.stride = None, frozenset(), 0
        try:
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
            self.query = nvml.nvmlDeviceGetComputeRunningProcesses_v3
            count = ctypes.c_uint()
            if nvml.nvmlInit_v2() == 0 and nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0:
                self.handles = [ctypes.c_void_p() for _ in range(count.value)]
                if all(nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h)) == 0 for i, h in enumerate(self.handles)):
                    self.nvml = nvml
        except (OSError, AttributeError):
            pass

    @property
    def source(self) -> str:
        return "NVML" if self.nvml is not None else "nvidia-smi"

    def __call__(self) -> dict[int, int]:
        if self.nvml is not None:
            try:
                used = self._nvml()
            except (OSError, ValueError, ctypes.ArgumentError):
                used = None
            if used is not None and (frozenset(used) == self.known or self._agrees(used)):
                return used
            self.nvml = None
        return self._smi()

    def _agrees(self, used: dict[int, int]) -> bool:
        if set(used) != set(self._smi()):
            return False
        self.known = frozenset(used)
        return True

    def _nvml(self) -> dict[int, int] | None:
        """Every GPU's processes (a pid on several GPUs: summed), None on an NVML error or records no stride reads."""
        used: dict[int, int] = {}
        for handle in self.handles:
            count = ctypes.c_uint(self.RECORDS)
            raw = (ctypes.c_ubyte * (self.RECORDS * max(self.STRIDES)))()
            if self.query(handle, ctypes.byref(count), raw) != 0:
                return None
            data = bytes(raw)
            for stride in (self.stride,) if self.stride else self.STRIDES:
                records = [(int.from_bytes(data[i * stride : i * stride + 4], "little"),
                            int.from_bytes(data[i * stride + 8 : i * stride + 16], "little")) for i in range(count.value)]  # fmt: skip
                if all(os.path.exists(f"/proc/{pid}") and 0 < b < 1 << 50 for pid, b in records):
                    if count.value > 1:  # one record reads alike at either stride
                        self.stride = stride
                    break
            else:
                return None
            for pid, b in records:
                # nvidia-smi reports MiB: rounded alike, the two sources compare equal
                used[pid] = used.get(pid, 0) + b // memory.MIB * memory.MIB
        return used

    @staticmethod
    def _smi() -> dict[int, int]:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=False).stdout  # fmt: skip
        used = {}
        for line in out.strip().splitlines():
            pid, mib = (x.strip() for x in line.split(","))
            used[int(pid)] = int(mib) * memory.MIB
        return used


def part_of(pid: int) -> str:
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
    except OSError:
        return "gone"
    return next((part for name, part in PART_OF.items() if name in cmd), "server")


def peak_gauges(metrics_port: int) -> dict[str, int]:
    """part → its stub's `cosmos3_gpu_memory_bytes{kind="total", of="peak"}` (refreshed at each request's arrival)."""
    gauges = prom.samples(prom.scrape(metrics_port), "cosmos3_gpu_memory_bytes")
    return {
        labels["part"]: int(v) for labels, v in gauges if labels.get("of") == "peak" and labels.get("kind") == "total"
    }


# `--request streams`: chained AR windows of 29 frames (8 latent) overlapping by 8, two windows a request
AR_STREAM = {"window_mode": "chained", "window_frames": 29, "overlap_frames": 8, "num_frames": 53}


def requests_of(spec: str, d: Deployment, p: memory.MemoryPlan) -> list[dict]:
    """The request parameters of a `--request`, sent at once: `default` (the config's size), `largest` (the plan's
    largest admitted request), WxHxF, or `streams` (the plan's live decoder streams: an AR request at the largest
    frame and `decode_streams - 1` at the default size)."""
    if spec == "default":
        return [{"width": d.defaults.width, "height": d.defaults.height, "num_frames": d.defaults.num_frames}]
    if spec == "largest":
        return [{"width": p.largest.width, "height": p.largest.height, "num_frames": p.largest.frames}]
    if spec == "streams":
        big = {**AR_STREAM, "width": p.largest.frame_width, "height": p.largest.frame_height}
        return [big] + [{**AR_STREAM, "width": d.defaults.width, "height": d.defaults.height}] * (p.decode_streams - 1)
    w, h, f = (int(x) for x in spec.split("x"))
    return [{"width": w, "height": h, "num_frames": f}]


def send_together(url: str, params: list[dict], steps: int) -> str:
    """Send the requests at once and wait for all; → a line naming each and the time until the last ended."""
    from client.stream import generate

    errors: list[str] = []

    def one(q: dict) -> None:
        try:
            generate(url, "A robot arm stacks red and blue cubes on a wooden table.", {**q, "steps": steps})
        except Exception as e:  # noqa: BLE001 - printed with its request, the others go on
            errors.append(f"{q['width']}x{q['height']}x{q['num_frames']}: {e}")

    t = time.perf_counter()
    threads = [threading.Thread(target=one, args=(q,)) for q in params]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    sizes = " + ".join(f"{q['width']}x{q['height']}x{q['num_frames']}" + (" AR" if "window_mode" in q else "")
                       for q in params)  # fmt: skip
    return f"request {sizes}, {steps} steps: {time.perf_counter() - t:.1f}s" + "".join(f"\n  error {e}" for e in errors)


def served(args) -> None:
    from cosmos3_core.tools.plan import checkpoint_root
    from cosmos3_core.triton.launcher import stop_server, wait_until_ready
    from cosmos3_core.triton.serve import start

    d = Deployment.load(
        args.served, safety_checker="none", precision=args.precision, expandable_segments=not args.no_expandable
    )
    root, _ = checkpoint_root(d.checkpoint)
    d = replace(d, checkpoint=str(root))
    ckpt = d.open_checkpoint()
    p = memory.plan(d, ckpt.root, ckpt.config, memory.card_bytes())
    print(p.table(), "\n" + p.verdict(), flush=True)
    peaks: dict[str, int] = {}
    total_peak = [0]
    stop = threading.Event()
    gpu_processes = GpuProcesses()
    parts: dict[int, str] = {}

    def sample() -> None:
        while not stop.is_set():
            by_part: dict[str, int] = {}
            for pid, used in gpu_processes().items():
                part = parts.get(pid) or parts.setdefault(pid, part_of(pid))
                by_part[part] = by_part.get(part, 0) + used
            for part, used in by_part.items():
                peaks[part] = max(peaks.get(part, 0), used)
            total_peak[0] = max(total_peak[0], sum(by_part.values()))
            stop.wait(0.01)

    threading.Thread(target=sample, daemon=True).start()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        proc, ports, _ = start(d, Path(work))
        try:
            wait_until_ready(ports[1], proc=proc, timeout_s=900)
            ready = time.perf_counter() - t0
            print(f"ready in {ready:.0f}s; after load ({gpu_processes.source}): "
                  + ", ".join(f"{k} {v / GIB:.1f}" for k, v in peaks.items()), flush=True)  # fmt: skip
            for spec in args.request:
                for _ in range(args.requests):
                    print(send_together(f"127.0.0.1:{ports[0]}", requests_of(spec, d, p), args.steps), flush=True)
            gauges = peak_gauges(ports[2])
        finally:
            stop.set()
            stop_server(proc)
    rows: list[dict] = []
    for part in memory.PARTS:
        row(rows, part, "peak (nvidia-smi)", peaks.get(part, 0), p.part_bytes(part))
        if part in gauges:
            row(rows, part, "  torch's peak reserved + context (gauge)", gauges[part], p.part_bytes(part))
    row(rows, "all", "whole server's peak (nvidia-smi)", total_peak[0], p.total)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"config": args.served, "precision": args.precision, "request": args.request,
                       "sampler": gpu_processes.source,
                       "device": torch.cuda.get_device_name(), "rows": rows}, fh, indent=1)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--served", default=None, metavar="CONFIG", help="the whole server on CONFIG, sampled")
    ap.add_argument("--request", nargs="+", default=["default"],
                    help="--served: its requests, each `default` (the config's), `largest` (the largest the limits "
                    "admit), WxHxF, or `streams` (the plan's live decoder streams at once, AR)")  # fmt: skip
    ap.add_argument("--requests", type=int, default=2, help="--served: of each size; the gauges are read at the last")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--preset", default="nano")
    ap.add_argument("--precision", default="checkpoint", choices=["checkpoint", "fp8"])
    ap.add_argument("--compile", action="store_true", help="compiled GEN and decoder kernels, as the configs serve")
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip", nargs="*", default=[], help="parts to skip: denoise decode encode prefill")
    ap.add_argument("--no-expandable", action="store_true", help="expandable_segments: false (the allocator's default)")
    args = ap.parse_args(argv)
    if args.served:
        return served(args)
    d = Deployment.load(f"configs/{args.preset}.yaml", checkpoint=f"random:{args.preset}", safety_checker="none",
                        precision=args.precision, compile=args.compile, warmup_requests=[],
                        expandable_segments=not args.no_expandable)  # fmt: skip
    memory.use_allocator(d.expandable_segments)
    ckpt = d.open_checkpoint()
    cfg, dtype = ckpt.config, d.torch_dtype
    p = memory.plan(d, ckpt.root, cfg, memory.card_bytes())
    print(p.table(), flush=True)
    rows: list[dict] = []
    fp8 = ckpt.fp8 is not None and ckpt.fp8.quantize_at_load  # random weights: no linear is stored in E4M3

    if "denoise" not in args.skip:
        base = fresh()
        engine = DenoiseEngine.from_deployment(ckpt, replace(d, max_step_rows="auto", pool_pages=256))
        weights = sum(x.numel() * x.element_size() for x in engine.model.parameters())
        weights += sum(x.numel() * x.element_size() for x in engine.model.buffers())
        row(rows, "denoise", "GEN tower (parameters)", weights, memory.tower_bytes(cfg, GEN, dtype, fp8))
        row(rows, "denoise", "GEN tower, reserved after load", torch.cuda.memory_reserved() - base
            - engine.pool.k_pages.nbytes * 2, memory.tower_bytes(cfg, GEN, dtype, fp8))  # fmt: skip
        shift = checkpoint_shift(ckpt.scheduler_config)
        sizes = (d.defaults, d.limits, cfg.pixel_alignment, cfg.vae_scale_temporal, shift)
        for h, w, f in STEP_SIZES:
            req = validate("warmup", {"height": h, "width": w, "num_frames": f, "steps": 2, "guidance_scale": 6.0},
                           None, *sizes)  # fmt: skip
            n = engine.scheduler.rows(req, engine.scheduler.plan(req))
            before = fresh()
            reserved = torch.cuda.memory_reserved()
            t = time.perf_counter()
            engine.warmup([req])
            engine.warmup([req])  # a second run: the layout's capture (≤ max_capture_rows) and replay
            took = time.perf_counter() - t
            peak = torch.cuda.max_memory_allocated() - before
            row(rows, "denoise", f"step {w}x{h}x{f}: {n} rows ({took:.0f}s)", peak, memory.step_bytes(cfg, n, dtype))
            captured = n <= d.max_capture_rows
            row(rows, "denoise", f"  reserved growth{' (eager + graph)' if captured else ''}",
                torch.cuda.memory_reserved() - reserved,
                memory.step_bytes(cfg, n, dtype) * (1 + memory.GRAPH_POOL_SHARE * captured))  # fmt: skip
        del engine
        fresh()

    if "decode" not in args.skip:
        base = fresh()
        vae = ckpt.load_vae("cuda", dtype, ("decoder",))
        resident = torch.cuda.memory_allocated() - base
        row(rows, "vae_decode", "VAE decoder (resident)", resident, memory.vae_bytes(_vae_config(ckpt), dtype)[1])
        for frames in (1, 4):
            codec = VaeCodec(vae, args.compile, frames_per_call=lambda h, w, f=frames: f)
            codec.decode(torch.zeros(1, cfg.latent_channel, 6, 5, 7, device="cuda"))  # compiles, first use
            s = cfg.vae_scale_spatial
            for h, w in DECODE_SIZES:
                before, before_reserved = fresh(), torch.cuda.memory_reserved()
                t = time.perf_counter()
                codec.decode(torch.zeros(1, cfg.latent_channel, 1 + frames, h // s, w // s, device="cuda"))
                torch.cuda.synchronize()
                took = time.perf_counter() - t
                peak = torch.cuda.max_memory_allocated() - before
                row(rows, "vae_decode", f"decode {w}x{h}, {frames} latent frames a call ({took:.2f}s)", peak,
                    memory.decode_workspace(h * w, frames))  # fmt: skip
                row(rows, "vae_decode", "  reserved", torch.cuda.max_memory_reserved() - before_reserved,
                    memory.decode_workspace(h * w, frames))  # fmt: skip
        # as served: one stream, its pieces of `decode_chunk_frames` latent frames (the engine's), the budget's call
        codec = VaeCodec(vae, args.compile, frames_per_call=lambda h, w: memory.decode_frames_per_call(h * w * s * s))
        codec.decode(torch.zeros(1, cfg.latent_channel, 6, 5, 7, device="cuda"))  # compiles, first use
        for h, w in DECODE_SIZES[:2]:
            before, before_reserved = fresh(), torch.cuda.memory_reserved()
            stream = StreamDecoder(codec)
            for _ in range(3):
                stream.decode(torch.zeros(1, cfg.latent_channel, 4, h // s, w // s, device="cuda"))
            del stream
            budget = memory.decode_budget(h * w)
            row(rows, "vae_decode", f"a stream of 3 pieces at {w}x{h}", torch.cuda.max_memory_allocated() - before,
                budget)  # fmt: skip
            row(rows, "vae_decode", "  reserved", torch.cuda.max_memory_reserved() - before_reserved, budget)
        del vae, codec
        fresh()

    if "encode" not in args.skip:
        base = fresh()
        vae = ckpt.load_vae("cuda", dtype, ("encoder",))
        resident = torch.cuda.memory_allocated() - base
        row(rows, "prefill", "VAE encoder (resident)", resident, memory.vae_bytes(_vae_config(ckpt), dtype)[0])
        codec = VaeCodec(vae)
        for h, w in DECODE_SIZES:
            before = fresh()
            codec.encode_first_frame(np.zeros((h, w, 3), np.uint8), h, w)
            peak = torch.cuda.max_memory_allocated() - before
            row(rows, "prefill", f"encode a {w}x{h} frame", peak, int(memory.ENCODE_BYTES_PER_PIXEL * h * w))
            before = fresh()
            clip = torch.zeros(1, 3, 9, h, w, dtype=dtype, device="cuda")  # the first frame, then chunks of 4
            vae.encode(clip)
            peak = torch.cuda.max_memory_allocated() - before
            row(rows, "prefill", f"encode a {w}x{h} clip (4 frames a chunk)", peak,
                int(memory.ENCODE_BYTES_PER_PIXEL * memory.ENCODE_CLIP_FACTOR * h * w))  # fmt: skip
        del vae, codec
        fresh()

    if "prefill" not in args.skip:
        base = fresh()
        model = ckpt.load_transformer({UND}, "cuda", dtype)
        resident = torch.cuda.memory_allocated() - base
        row(rows, "prefill", "UND tower (resident)", resident, memory.tower_bytes(cfg, UND, dtype, fp8))
        tokens = d.limits.max_prompt_tokens
        cos, sin = rotary_tables(cfg, text_position_ids(tokens), dtype, "cuda")
        before = fresh()
        for _ in range(2):
            prefill_text_kv(model, torch.zeros(tokens, dtype=torch.long, device="cuda"), cos, sin)
        row(rows, "prefill", f"UND pass, {tokens} tokens x 2 branches", torch.cuda.max_memory_allocated() - before,
            memory.UND_PASS_BYTES)  # fmt: skip

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "precision": args.precision, "compile": args.compile,
                       "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)  # fmt: skip


def _vae_config(ckpt) -> dict:
    return json.loads((ckpt.root / "vae" / "config.json").read_text())


if __name__ == "__main__":
    main()
