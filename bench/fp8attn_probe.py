"""Where FP8 attention's time goes at a served packed-step shape (GPU, FlashInfer fa3): one GEN attention layer call
through `FlashInferPlan` in bf16 and in FP8 (its quantization eager, and compiled as `compile: true` runs it), and its
parts alone — the [prefix | own] gather, the three per-head quantizations (`quantize_qkv`, eager and compiled), the
ragged kernel on ready inputs (bf16, and FP8 on pre-quantized ones).

    python -m bench.fp8attn_probe --shape edge     # 2 CFG branches of 12,090 rows (832x480x121), text 274 / 199
    python -m bench.fp8attn_probe --shape nano_ar  # 2 branches of 3,120 rows (an 8-latent-frame AR window)

Prints ms per layer call and the kernels' TF/s (4·rows·keys·d·heads per segment). A served FP8-attention step
costs the FP8 plan call, a bf16 one the bf16 call: their difference per layer × layers × forwards is what
`fp8_attention` adds or saves; the parts say whether the kernel or the quantization decides it.
"""

from __future__ import annotations

import argparse
import json

import torch

from cosmos3_core.attention import FlashInferAttention, gather_kv, quantize_fp8, unpack_index
from cosmos3_core.kv_pool import KVPool
from cosmos3_core.rows import Segment

from .attention_probe import timed

SHAPES = {  # rows per branch (aligned to 64 in the pack), text prefix per branch, heads, kv heads
    "edge": dict(rows=12090, text=(274, 199), heads=16, kv_heads=8),
    "nano_ar": dict(rows=3120, text=(274, 199), heads=32, kv_heads=8),  # 8 latent frames of 15 x 26 patches
    "nano_heads_12k": dict(rows=12480, text=(274, 199), heads=32, kv_heads=8),  # the 18th session's first "nano_ar"
}
HEAD_DIM, PAGE = 128, 16


def probe(shape: str) -> dict[str, float]:
    s = SHAPES[shape]
    aligned = -(-s["rows"] // 64) * 64
    rows = aligned * len(s["text"])
    pool = KVPool(256, PAGE, 1, s["kv_heads"], HEAD_DIM, torch.bfloat16, "cuda")
    pool.k_pages.normal_()
    pool.v_pages.normal_()
    segments = [Segment(i * aligned, s["rows"], (pool.alloc(t),), False) for i, t in enumerate(s["text"])]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(rows, s["heads"], HEAD_DIM, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(rows, s["kv_heads"], HEAD_DIM, device="cuda", generator=g).bfloat16() for _ in range(2))
    out: dict[str, float] = {}
    plans = {}
    for name, fp8, compiled in (("bf16", False, False), ("fp8", True, False), ("fp8 compiled", True, True)):
        attn = FlashInferAttention(pool, s["heads"], s["kv_heads"], HEAD_DIM, fp8=fp8, compiled=compiled)
        plan = attn.make_plan(rows)
        plan.update(segments)
        torch.cuda.synchronize()
        plans[name] = plan
        out[f"{name} plan call"] = timed(lambda plan=plan: plan(q, k, v, 0))
    plan = plans["fp8"]
    index = unpack_index(plan.index, rows)
    k_all, v_all = gather_kv(k, pool.k_pages[0], *index), gather_kv(v, pool.v_pages[0], *index)
    out["gather k+v"] = timed(lambda: (gather_kv(k, pool.k_pages[0], *index), gather_kv(v, pool.v_pages[0], *index)))
    valid_rows, keys = plan.valid[:rows], plan.valid[rows:]
    out["quantize q+k+v"] = timed(
        lambda: (quantize_fp8(q, valid_rows), quantize_fp8(k_all, keys), quantize_fp8(v_all, keys))
    )
    fused = plans["fp8 compiled"].attn.quantize
    out["quantize compiled"] = timed(lambda: fused(q, k_all, v_all, valid_rows, keys))
    (q8, sq), (k8, sk), (v8, sv) = quantize_fp8(q, valid_rows), quantize_fp8(k_all, keys), quantize_fp8(v_all, keys)
    o = torch.empty_like(q)
    out["fp8 kernel"] = timed(lambda: plan.ragged.run(q8, k8, v8, sq, sk, sv, out=o))
    out["bf16 kernel"] = timed(lambda: plans["bf16"].ragged.run(q, k_all, v_all))
    flops = sum(4 * s["rows"] * (s["rows"] + t) * HEAD_DIM * s["heads"] for t in s["text"])
    for name in ("fp8 kernel", "bf16 kernel"):
        out[f"{name} TF/s"] = flops / out[name] / 1e9
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    import flashinfer

    print(f"flashinfer {flashinfer.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    results = {}
    for shape in args.shape:
        results[shape] = r = probe(shape)
        print(f"== {shape} ({SHAPES[shape]})")
        for name, value in r.items():
            print(f"  {name:<18} {value:9.3f} {'TF/s' if 'TF/s' in name else 'ms'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
