"""GEN attention kernels side by side at a real packed-step shape (GPU): torch SDPA per segment (flash, cuDNN)
vs FlashInfer (paged text prefix + ragged own tokens + merge_state; fa2 and fa3 backends).

    python -m bench.attention_probe --segments 2 --rows 12090 --text 300

Prints ms per layer call, achieved TF/s (4·N·M·d·heads per segment) and the max error against fp32 SDPA.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--segments", type=int, default=2)
    ap.add_argument("--rows", type=int, default=12090)
    ap.add_argument("--text", type=int, default=300)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    n, s, d, h, hk, ps = args.rows, args.segments, args.head_dim, args.heads, args.kv_heads, args.page_size
    q = torch.randn(s * n, h, d, device=dev, dtype=dt)
    k = torch.randn(s * n, hk, d, device=dev, dtype=dt)
    v = torch.randn(s * n, hk, d, device=dev, dtype=dt)
    pages_per = -(-args.text // ps)
    k_pages = torch.randn(s * pages_per + 8, ps, hk, d, device=dev, dtype=dt)
    v_pages = torch.randn_like(k_pages)
    page_ids = [torch.arange(i * pages_per, (i + 1) * pages_per, device=dev) for i in range(s)]

    def ours(backends):
        def run():
            out = torch.empty(s * n, h * d, device=dev, dtype=dt)
            with sdpa_kernel(backends):
                for i in range(s):
                    rows = slice(i * n, (i + 1) * n)
                    pk = k_pages[page_ids[i]].flatten(0, 1)[: args.text]
                    pv = v_pages[page_ids[i]].flatten(0, 1)[: args.text]
                    keys, values = torch.cat([pk, k[rows]]), torch.cat([pv, v[rows]])
                    o = F.scaled_dot_product_attention(
                        q[rows].transpose(0, 1)[None],
                        keys.transpose(0, 1)[None],
                        values.transpose(0, 1)[None],
                        enable_gqa=True,
                    )
                    out[rows] = o[0].transpose(0, 1).flatten(-2)
            return out

        return run

    def reference():
        out = torch.empty(s * n, h * d, device=dev, dtype=torch.float32)
        for i in range(s):
            rows = slice(i * n, (i + 1) * n)
            pk = k_pages[page_ids[i]].flatten(0, 1)[: args.text]
            pv = v_pages[page_ids[i]].flatten(0, 1)[: args.text]
            keys, values = torch.cat([pk, k[rows]]).float(), torch.cat([pv, v[rows]]).float()
            kk = keys.repeat_interleave(h // hk, 1).transpose(0, 1)
            vv = values.repeat_interleave(h // hk, 1).transpose(0, 1)
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                o = F.scaled_dot_product_attention(q[rows].float().transpose(0, 1)[None], kk[None], vv[None])
            out[rows] = o[0].transpose(0, 1).flatten(-2)
        return out

    ref = reference()
    results = {}
    flops = 4 * s * n * (n + args.text) * d * h
    for name, fn in [
        ("sdpa flash", ours([SDPBackend.FLASH_ATTENTION])),
        ("sdpa cudnn", ours([SDPBackend.CUDNN_ATTENTION])),
    ]:
        try:
            err = (fn().float() - ref).abs().max().item()
            ms = timed(fn)
            results[name] = (ms, flops / ms / 1e9, err)
        except Exception as e:  # noqa: BLE001 - a probe reports what does not run
            results[name] = (float("nan"), 0.0, repr(e)[:120])

    try:
        import flashinfer

        qo_indptr = torch.arange(0, s + 1, dtype=torch.int32) * n
        kv_indptr = torch.arange(0, s + 1, dtype=torch.int32) * pages_per
        indices = torch.cat(page_ids).int()
        last = torch.full((s,), args.text - (pages_per - 1) * ps, dtype=torch.int32)
        for backend in ("fa2", "fa3"):
            try:
                t0 = time.time()
                ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
                paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
                ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                    torch.empty(256 << 20, dtype=torch.uint8, device=dev), "NHD", backend=backend
                )
                paged.plan(
                    qo_indptr, kv_indptr, indices, last, h, hk, d, ps, causal=False, q_data_type=dt, kv_data_type=dt
                )
                ragged.plan(qo_indptr, qo_indptr, h, hk, d, causal=False, q_data_type=dt, kv_data_type=dt)

                def fi(paged=paged, ragged=ragged):
                    o1, l1 = paged.run(q, (k_pages, v_pages), return_lse=True)
                    o2, l2 = ragged.run(q, k, v, return_lse=True)
                    return flashinfer.merge_state(o1, l1, o2, l2)[0].flatten(-2)

                out = fi()
                torch.cuda.synchronize()
                jit_s = time.time() - t0
                err = (out.float() - ref).abs().max().item()
                ms = timed(fi)
                results[f"flashinfer {backend}"] = (ms, flops / ms / 1e9, err)
                print(f"flashinfer {backend}: first call (JIT) {jit_s:.1f} s", flush=True)

                def fi_ragged_only(ragged=ragged):
                    return ragged.run(q, k, v)

                ms = timed(fi_ragged_only)
                results[f"  ragged part {backend}"] = (ms, 4 * s * n * n * d * h / ms / 1e9, 0.0)

                # one ragged call per layer over [text | own] K/V copied into one buffer (the copy timed too)
                m = n + args.text
                cat_k = torch.empty(s * m, hk, d, device=dev, dtype=dt)
                cat_v = torch.empty_like(cat_k)
                joint = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                    torch.empty(256 << 20, dtype=torch.uint8, device=dev), "NHD", backend=backend
                )
                joint.plan(qo_indptr, torch.arange(0, s + 1, dtype=torch.int32) * m, h, hk, d, causal=False,
                           q_data_type=dt, kv_data_type=dt)  # fmt: skip

                def fi_joint(joint=joint, cat_k=cat_k, cat_v=cat_v, m=m):
                    for i in range(s):
                        for src, pages, dst in ((k, k_pages, cat_k), (v, v_pages, cat_v)):
                            dst[i * m : i * m + args.text] = pages[page_ids[i]].flatten(0, 1)[: args.text]
                            dst[i * m + args.text : (i + 1) * m] = src[i * n : (i + 1) * n]
                    return joint.run(q, cat_k, cat_v).flatten(-2)

                err = (fi_joint().float() - ref).abs().max().item()
                ms = timed(fi_joint)
                results[f"joint ragged {backend}"] = (ms, flops / ms / 1e9, err)
                ms = timed(lambda joint=joint, ck=cat_k, cv=cat_v: joint.run(q, ck, cv))
                results[f"  joint, no copy {backend}"] = (ms, flops / ms / 1e9, 0.0)
            except Exception as e:  # noqa: BLE001
                results[f"flashinfer {backend}"] = (float("nan"), 0.0, repr(e)[:300])
    except ImportError as e:
        results["flashinfer"] = (float("nan"), 0.0, repr(e)[:300])

    print(f"\nsegments={s} rows={n} text={args.text} heads={h}/{hk} d={d}")
    print(f"{'kernel':24} {'ms/layer':>9} {'TF/s':>7}  max err vs fp32")
    for name, (ms, tf, err) in results.items():
        print(f"{name:24} {ms:9.3f} {tf:7.1f}  {err}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: list(v) for k, v in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
