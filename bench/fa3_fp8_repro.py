"""Standalone repro (torch + flashinfer only) of FlashInfer's FA3 FP8 ragged prefill being wrong on short sequences.

What an upstream bug report needs, printed in one run: the environment, then one line per case, then a summary.

Setup (every case): `BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="fa3")`, `plan(qo_indptr,
kv_indptr, heads, kv_heads, head_dim, causal=False, q_data_type=e4m3, kv_data_type=e4m3, o_data_type=bf16)`,
`run(q8, k8, v8, scale_q, scale_k, scale_v, out=bf16)`: q8 [sum qo, heads, d], k8/v8 [sum kv, kv_heads, d] E4M3,
scales fp32 [heads] / [kv_heads] (FA3's per-head descales), non-causal, heads 8, GQA (kv_heads 2) and MHA
(kv_heads 8), head_dim 128 (Cosmos3's), on one Hopper GPU. Inputs: N(0, 1) values (times per-head magnitudes
0.5..2 with `per_head` scales) rounded to E4M3. Scale modes: `unit` (the E4M3 values are the inputs, every scale 1:
no scale path at all), `per_head` (amax / 448 per head, as a server quantizes bf16 activations).

References, per sequence, fp32 on the same GPU, over the DEQUANTIZED inputs (what the kernel is given, so E4M3
input rounding is nobody's error):
- exact: softmax(q·kᵀ/√d)·v.
- sim: FA3 FP8's own maths simulated (P = exp(s − rowmax) rounded to E4M3 as P·448, PV in fp32, / 448, / the
  unrounded row sum): the error a correct kernel has (its only extra rounding is P's, plus the bf16 output).
- overhang: exact attention over the sequence's keys extended to the FP8 kernel's KV tile boundary (CTA_KV = 192
  at head_dim 128, prefill_sm90.cuh: the next sequence's keys in the buffer, zero keys past its end as TMA
  fills them). A kernel closer to this than to `exact` reads keys past kv_len (one hypothesis; the data decide).

A case is WRONG when rel-L2(kernel, exact) > RATIO × rel-L2(sim, exact) (a correct kernel: ≈ 1×).
Measured before (FlashInfer 0.6.1, H200, per-head scales): one 300-key sequence 0.122, 128 + 256 wrong, one
384-key sequence and 1500 + 2600 right. 384 = 2 × 192 is the only short length tried that is a whole number of
KV tiles; this sweep tests lengths on and off those multiples, and q and kv lengths apart.

    python bench/fa3_fp8_repro.py [--json out.json] [--modes gqa mha] [--scales unit per_head] [--backends fa3 cudnn]
    python bench/fa3_fp8_repro.py --kernel sim   # the harness itself: the simulation as the kernel, every case ok

`--backends cudnn` adds cuDNN's FP8 ragged prefill (FlashInfer's backend="cudnn"; per-tensor scales, so run on
`unit` scales only) as another FP8 kernel on the same cases. `--bf16` adds fa3's bf16 kernel on the same
(dequantized) inputs as a control (one more JIT module). Without CUDA (or off Hopper) it says why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from typing import Any

import torch

E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0
RATIO = 2.0
CTA_KV = {64: 128, 128: 192, 256: 128}  # FA3 FP8 ragged kernel's KV tile per head_dim (quantization/prefill_sm90.cuh)
MODES = {"gqa": 2, "mha": 8}  # kv_heads, at 8 query heads

# (name, [(qo_len, kv_len) per sequence]); one ragged call per case
CASES: list[tuple[str, list[tuple[int, int]]]] = [
    *[(f"self_{n}", [(n, n)]) for n in (64, 128, 191, 192, 193, 256, 300, 383, 384, 385, 576, 600, 768, 1500, 2600)],
    *[(f"q{q}_kv{k}", [(q, k)]) for q, k in ((128, 192), (128, 200), (128, 384), (128, 600), (100, 384), (300, 384))],
    ("two_128_256", [(128, 128), (256, 256)]),
    ("two_100_300", [(100, 100), (300, 300)]),
    ("two_192_384", [(192, 192), (384, 384)]),
    ("two_300_384", [(300, 300), (384, 384)]),
    ("two_1500_2600", [(1500, 1500), (2600, 2600)]),
    ("two_100_2600", [(100, 100), (2600, 2600)]),
]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def quantize(x: torch.Tensor, scales: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, heads, d] fp32 → (E4M3, fp32 descale [heads]); unit: x's E4M3 rounding, scale 1; per_head:
    amax / 448 per head; per_tensor: one amax / 448 for every head."""
    heads = x.shape[1]
    if scales == "unit":
        return x.to(E4M3), torch.ones(heads, device=x.device)
    amax = x.abs().amax(dim=(0, 2)) if scales == "per_head" else x.abs().amax().expand(heads).clone()
    s = amax.clamp_min(1e-12) / FP8_MAX
    return (x / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(E4M3), s


def make_inputs(lens: list[tuple[int, int]], heads: int, kv_heads: int, d: int, scales: str, seed: int, dev: str):
    """→ dict: q8/k8/v8 (E4M3), sq/sk/sv (fp32 descales), q/k/v dequantized (fp32), qo/kv indptr (int32)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    nq, nk = sum(q for q, _ in lens), sum(k for _, k in lens)
    mag = torch.linspace(0.5, 2.0, heads, device=dev)[:, None] if scales != "unit" else torch.ones(heads, 1, device=dev)
    x = {
        "q": torch.randn(nq, heads, d, device=dev, generator=g) * mag,
        "k": torch.randn(nk, kv_heads, d, device=dev, generator=g) * mag[:kv_heads],
        "v": torch.randn(nk, kv_heads, d, device=dev, generator=g),
    }
    out: dict[str, Any] = {}
    for name, t in x.items():
        t8, s = quantize(t, scales)
        out[name + "8"], out["s" + name], out[name] = t8, s, t8.float() * s[:, None]
    cum = lambda xs: torch.tensor([0, *torch.tensor(xs).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    out["qo_indptr"], out["kv_indptr"] = cum([q for q, _ in lens]), cum([k for _, k in lens])
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p_round: bool = False) -> torch.Tensor:
    """q [n, heads, d], k/v [m, kv_heads, d] fp32 → [n, heads, d]; GQA; p_round: FA3 FP8's P rounding."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,mhd->hnm", q, k) / math.sqrt(q.shape[-1])
    p = torch.exp(s - s.amax(dim=-1, keepdim=True))
    denom = p.sum(dim=-1, keepdim=True)
    if p_round:
        p = (p * FP8_MAX).to(E4M3).float() / FP8_MAX
    return torch.einsum("hnm,mhd->nhd", p / denom, v)


def references(x: dict, tile: int) -> dict[str, torch.Tensor]:
    """exact, sim and overhang outputs [sum qo, heads, d] (see the module docstring)."""
    q, k, v = x["q"], x["k"], x["v"]
    qo, kv = x["qo_indptr"].tolist(), x["kv_indptr"].tolist()
    refs = {name: torch.empty_like(q) for name in ("exact", "sim", "overhang")}
    for r in range(len(qo) - 1):
        qs, ks, ke = slice(qo[r], qo[r + 1]), kv[r], kv[r + 1]
        refs["exact"][qs] = attend(q[qs], k[ks:ke], v[ks:ke])
        refs["sim"][qs] = attend(q[qs], k[ks:ke], v[ks:ke], p_round=True)
        end = ks + -(-(ke - ks) // tile) * tile  # the kernel's last KV tile's end
        pad = max(0, end - len(k))  # past the buffer: TMA's zero fill
        kx = torch.cat([k[ks:end], k.new_zeros(pad, *k.shape[1:])])
        vx = torch.cat([v[ks:end], v.new_zeros(pad, *v.shape[1:])])
        refs["overhang"][qs] = attend(q[qs], kx, vx)
    return refs


class Runner:
    """The kernels under test, sharing one workspace; `sim`: the simulation itself (the harness's self-check)."""

    def __init__(self, dev: str):
        self.dev = dev
        self.workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)

    def __call__(self, backend: str, x: dict, heads: int, kv_heads: int, d: int) -> torch.Tensor:
        if backend == "sim":
            return references(x, CTA_KV[d])["sim"].to(torch.bfloat16)
        import flashinfer

        bf16 = backend == "fa3_bf16"
        w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD", backend="fa3" if bf16 else backend)
        dt = torch.bfloat16 if bf16 else E4M3
        qo, kv = x["qo_indptr"].to(self.dev), x["kv_indptr"].to(self.dev)
        w.plan(qo, kv, heads, kv_heads, d, causal=False, q_data_type=dt, kv_data_type=dt, o_data_type=torch.bfloat16)
        out = torch.empty(x["q8"].shape, dtype=torch.bfloat16, device=self.dev)
        if bf16:
            w.run(x["q"].bfloat16(), x["k"].bfloat16(), x["v"].bfloat16(), out=out)
        elif backend == "fa3":
            w.run(x["q8"], x["k8"], x["v8"], x["sq"], x["sk"], x["sv"], out=out)
        else:  # per-tensor descales as floats (cuDNN)
            w.run(x["q8"], x["k8"], x["v8"], q_scale=x["sq"][0].item(), k_scale=x["sk"][0].item(),
                  v_scale=x["sv"][0].item(), out=out)  # fmt: skip
        torch.cuda.synchronize()
        return out


def run_case(runner: Runner, backend: str, mode: str, scales: str, name: str, lens, d: int, seed: int) -> dict:
    heads, kv_heads = 8, MODES[mode]
    tile = CTA_KV[d]
    x = make_inputs(lens, heads, kv_heads, d, scales, seed, runner.dev)
    row: dict[str, Any] = {"backend": backend, "mode": mode, "scales": scales, "case": name, "lens": lens,
                           "partial_kv_tile": [k % tile != 0 for _, k in lens]}  # fmt: skip
    try:
        out = runner(backend, x, heads, kv_heads, d)
    except Exception as e:  # another backend may not take this case: say so, go on
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        return row
    refs = references(x, tile)
    qo = x["qo_indptr"].tolist()
    row.update(
        finite=bool(out.isfinite().all()),
        kernel_exact=rel(out, refs["exact"]),
        sim_exact=rel(refs["sim"], refs["exact"]),
        kernel_sim=rel(out, refs["sim"]),
        kernel_overhang=rel(out, refs["overhang"]),
        per_seq=[rel(out[a:b], refs["exact"][a:b]) for a, b in zip(qo[:-1], qo[1:])],
        per_seq_sim=[rel(refs["sim"][a:b], refs["exact"][a:b]) for a, b in zip(qo[:-1], qo[1:])],
    )
    row["ok"] = row["finite"] and row["kernel_exact"] <= RATIO * row["sim_exact"]
    return row


def line(r: dict) -> str:
    head = f"{r['backend']:8s} {r['mode']:3s} {r['scales']:8s} {r['case']:14s}"
    if "error" in r:
        return f"{head} ERROR {r['error'][:160]}"
    seqs = " ".join(f"{q}/{k}:{e:.3f}" for (q, k), e in zip(r["lens"], r["per_seq"]))
    return (f"{head} kernel~exact {r['kernel_exact']:.4f}  sim~exact {r['sim_exact']:.4f}  kernel~sim "
            f"{r['kernel_sim']:.4f}  kernel~overhang {r['kernel_overhang']:.4f}  {'ok   ' if r['ok'] else 'WRONG'}  "
            f"per seq (qo/kv:err) {seqs}")  # fmt: skip


def summary(rows: list[dict]) -> list[str]:
    out = []
    for backend in dict.fromkeys(r["backend"] for r in rows):
        mine = [r for r in rows if r["backend"] == backend and "error" not in r]
        errors = sum(1 for r in rows if r["backend"] == backend and "error" in r)
        wrong = [r for r in mine if not r["ok"]]
        out.append(f"{backend}: {len(wrong)} of {len(mine)} cases WRONG" + (f", {errors} raised" if errors else ""))
        if not wrong:
            continue
        out.append("  WRONG: " + ", ".join(f"{r['mode']}/{r['scales']}/{r['case']}" for r in wrong))
        # the tile hypothesis: is every wrong sequence one that ends inside a KV tile, and every aligned one right?
        seqs = [(r, i) for r in mine for i in range(len(r["lens"]))]
        bad = [(r, i) for r, i in seqs if r["per_seq"][i] > RATIO * r["per_seq_sim"][i]]
        bad_partial = sum(r["partial_kv_tile"][i] for r, i in bad)
        aligned = [(r, i) for r, i in seqs if not r["partial_kv_tile"][i]]
        aligned_bad = sum(1 for r, i in aligned if r["per_seq"][i] > RATIO * r["per_seq_sim"][i])
        out.append(f"  sequences wrong: {len(bad)}, of them ending inside a KV tile: {bad_partial}; sequences of whole "
                   f"KV tiles: {len(aligned)}, of them wrong: {aligned_bad}")  # fmt: skip
        closer = sum(1 for r in wrong if r["kernel_overhang"] < r["kernel_exact"])
        out.append(f"  wrong cases closer to the overhang reference than to exact: {closer} of {len(wrong)}")
        worst = max(wrong, key=lambda r: r["kernel_exact"] / max(r["sim_exact"], 1e-12))
        out.append(f"  worst: {worst['mode']}/{worst['scales']}/{worst['case']} {worst['lens']}: expected rel-L2 to "
                   f"exact ≈ {worst['sim_exact']:.4f} (sim), got {worst['kernel_exact']:.4f}")  # fmt: skip
    return out


def environment() -> dict[str, str]:
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": str(torch.version.cuda)}
    try:
        import flashinfer

        env["flashinfer"] = flashinfer.__version__
    except Exception as e:  # noqa: BLE001 - reported, not raised: the sim self-check needs no flashinfer
        env["flashinfer"] = f"not importable ({type(e).__name__}: {e})"
    if torch.cuda.is_available():
        env["gpu"] = f"{torch.cuda.get_device_name()} (sm{''.join(map(str, torch.cuda.get_device_capability()))})"
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["gqa", "mha"])
    ap.add_argument("--scales", nargs="+", choices=["unit", "per_head"], default=["unit", "per_head"])
    ap.add_argument("--backends", nargs="+", choices=["fa3", "cudnn"], default=["fa3"])
    ap.add_argument("--bf16", action="store_true", help="also fa3's bf16 kernel on the same inputs (a control)")
    ap.add_argument("--kernel", choices=["flashinfer", "sim"], default="flashinfer",
                    help="sim: the simulation as the kernel (checks the harness; runs on the CPU too)")  # fmt: skip
    ap.add_argument("--cases", nargs="+", help="case names (default: all)")
    ap.add_argument("--head-dim", type=int, choices=sorted(CTA_KV), default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a case is WRONG")
    args = ap.parse_args(argv)
    cases = [c for c in CASES if not args.cases or c[0] in args.cases]
    if args.cases and len(cases) != len(args.cases):
        ap.error(f"unknown case in {args.cases}; known: {[c[0] for c in CASES]}")
    env = environment()
    print("fa3_fp8_repro: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    if args.kernel == "sim":
        dev, backends = ("cuda" if torch.cuda.is_available() else "cpu"), ["sim"]
        cases = [c for c in cases if sum(k for _, k in c[1]) <= 1024] if dev == "cpu" else cases  # CPU: short ones
    else:
        why = ("no CUDA device" if not torch.cuda.is_available() else
               "not a Hopper GPU (FA3 is sm90)" if torch.cuda.get_device_capability()[0] != 9 else
               "flashinfer is not importable" if env["flashinfer"].startswith("not importable") else None)  # fmt: skip
        if why:
            print(f"fa3_fp8_repro: skipped: {why}")
            return 0
        dev = "cuda"
        backends = list(args.backends) + (["fa3_bf16"] if args.bf16 else [])
    runner, rows = Runner(dev), []
    for backend in backends:
        t0 = time.perf_counter()
        for mode in args.modes:
            for scales in args.scales:
                if backend == "cudnn" and scales != "unit":
                    continue  # cuDNN takes one descale per tensor
                for i, (name, lens) in enumerate(cases):
                    rows.append(run_case(runner, backend, mode, scales, name, lens, args.head_dim, args.seed + i))
                    print(line(rows[-1]), flush=True)
        jit = "" if backend == "sim" else " (its first case JIT-builds the module unless built or cached)"
        print(f"{backend}: {time.perf_counter() - t0:.1f} s{jit}")
    print("\n".join(["summary:", *summary(rows)]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "ratio": RATIO, "cta_kv": CTA_KV[args.head_dim], "rows": rows}, f, indent=1)
    wrong = any("error" not in r and not r["ok"] for r in rows)
    return 1 if args.strict and wrong else 0


if __name__ == "__main__":
    sys.exit(main())
