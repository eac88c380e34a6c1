"""A large denoise step's kernels against this card's ceiling: what the floor's 790 TF/s asks of them.

At Nano's 480p×189 step (2 CFG branches of 18,720 tokens) attention is 45 % of the step's FLOPs and the layer
linears the rest, so the step can run no faster than those two kernels do. Per size, one GEN layer's work:

- attention: q `[2·tokens, heads, d]` over each branch's `[text | own]` keys — ours (`FlashInferAttention`'s plan,
  the gather and FA3's ragged call, as the step runs it) and torch SDPA's cuDNN, Flash and efficient kernels on the
  same q/k/v (per branch, GQA expanded where a kernel needs it), and flash-attn 4's ragged call when installed
  (`flash_attn.cute`, K/V gathered ahead, so its figure leaves out the gather ours includes): ms, TF/s, rel-L2 to ours;
- linears: the layer's GEMMs at the step's rows as the tower runs them (q, k, v, out, gate, up, down: cuBLAS bf16),
  and fused (qkv, gate|up) beside them: ms, TF/s;
- the step at those rates: the layers × (attention + linears), against the floor's.

  python -m bench.kernels [--preset nano] [--sizes 832x480x189 1280x720x189] [--text 300] [--repeat 10]

Random bf16 data (timing does not depend on values). Needs CUDA and FlashInfer.
"""

from __future__ import annotations

import argparse
import json

import torch

from cosmos3_core.model.config import ModelConfig
from cosmos3_core.model.random_checkpoint import write_skeleton

from .floor import card_flops, tokens_for


def timed(fn, repeat: int) -> float:
    """Median ms of `fn()` over `repeat` runs after two warm ones (CUDA events)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def attention(cfg: ModelConfig, tokens: int, text: int, repeat: int) -> dict:
    """One layer's GEN attention for 2 branches of `tokens` rows, each over `text` prefix keys + its own."""
    from cosmos3_core.attention import FlashInferAttention
    from cosmos3_core.kv_pool import KVPool, PageList
    from cosmos3_core.rows import Segment

    dev, dt = torch.device("cuda"), torch.bfloat16
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    page = 16
    pages = -(-text // page)
    pool = KVPool(2 * pages, page, 1, nkv, d, dt, dev)
    pool.k_pages.normal_()
    pool.v_pages.normal_()
    rows = 2 * tokens
    segments = [
        Segment(start=b * tokens, length=tokens, prefix=(PageList(list(range(b * pages, (b + 1) * pages)), text),),
                collect_kv=False)
        for b in range(2)
    ]  # fmt: skip
    q = torch.randn(rows, nh, d, dtype=dt, device=dev)
    k = torch.randn(rows, nkv, d, dtype=dt, device=dev)
    v = torch.randn(rows, nkv, d, dtype=dt, device=dev)
    plan = FlashInferAttention(pool, nh, nkv, d).make_plan(rows)
    plan.update(segments)
    ours = plan(q, k, v, 0)
    flops = 2 * 4 * tokens * (tokens + text) * d * nh
    out = {"rows": rows, "keys": tokens + text, "tflop": flops / 1e12}
    out["ours"] = {"ms": timed(lambda: plan(q, k, v, 0), repeat)}

    def branch_kv(b: int, x: torch.Tensor, pages_: torch.Tensor) -> torch.Tensor:
        prefix = pages_[0, b * pages : (b + 1) * pages].flatten(0, 1)[:text]
        return torch.cat([prefix, x[b * tokens : (b + 1) * tokens]])  # [keys, kv_heads, d]

    qs = [q[b * tokens : (b + 1) * tokens].transpose(0, 1)[None] for b in range(2)]  # [1, heads, tokens, d]
    ks = [branch_kv(b, k, pool.k_pages).transpose(0, 1)[None] for b in range(2)]
    vs = [branch_kv(b, v, pool.v_pages).transpose(0, 1)[None] for b in range(2)]
    rep = nh // nkv
    ks_x = [x.repeat_interleave(rep, 1) for x in ks]
    vs_x = [x.repeat_interleave(rep, 1) for x in vs]
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):  # fmt: skip

        def run(backend=backend) -> torch.Tensor:
            with sdpa_kernel(backend):
                return torch.cat([sdpa(qs[b], ks_x[b], vs_x[b])[0].transpose(0, 1) for b in range(2)]).flatten(-2)

        try:
            got = run()
            out[name] = {"ms": timed(run, repeat), "rel_l2": rel(got, ours)}
        except Exception as e:  # a kernel that does not take this shape or card
            out[name] = {"error": str(e).splitlines()[0][:160]}
    try:  # flash-attn 4 (CuTe DSL; its own SM90 forward), when installed: GQA and ragged as ours, K/V gathered ahead
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError:
        flash_attn_varlen_func = None
    if flash_attn_varlen_func is not None:
        k_cat = torch.cat([branch_kv(b, k, pool.k_pages) for b in range(2)])
        v_cat = torch.cat([branch_kv(b, v, pool.v_pages) for b in range(2)])
        cu_q = torch.tensor([0, tokens, 2 * tokens], dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0, tokens + text, 2 * (tokens + text)], dtype=torch.int32, device=dev)

        def fa4() -> torch.Tensor:
            got = flash_attn_varlen_func(q, k_cat, v_cat, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=tokens,
                                         max_seqlen_k=tokens + text)  # fmt: skip
            return (got[0] if isinstance(got, tuple) else got).flatten(-2)  # [rows, heads·d], as ours

        try:
            got = fa4()
            out["fa4"] = {"ms": timed(fa4, repeat), "rel_l2": rel(got, ours)}
        except Exception as e:  # noqa: BLE001 - a kernel that does not take this shape or card
            out["fa4"] = {"error": str(e).splitlines()[0][:160]}
    for r in out.values():
        if isinstance(r, dict) and "ms" in r:
            r["tflops"] = flops / r["ms"] / 1e9
    return out


def linears(cfg: ModelConfig, rows: int, repeat: int) -> dict:
    """One GEN layer's linears at `rows` rows, as the tower runs them and fused."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    h, nh, nkv, d, f = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
    )
    gated = cfg.hidden_act == "silu"
    shapes = {"q": (h, nh * d), "k": (h, nkv * d), "v": (h, nkv * d), "out": (nh * d, h), "up": (h, f), "down": (f, h)}
    if gated:
        shapes["gate"] = (h, f)
    fused = {"qkv": (h, (nh + 2 * nkv) * d), "gate|up": (h, 2 * f)} if gated else {"qkv": (h, (nh + 2 * nkv) * d)}
    out: dict = {}
    for name, (i, o) in {**shapes, **fused}.items():
        x = torch.randn(rows, i, dtype=dt, device=dev)
        w = torch.randn(o, i, dtype=dt, device=dev) / i**0.5
        ms = timed(lambda x=x, w=w: torch.nn.functional.linear(x, w), repeat)
        out[name] = {"ms": ms, "tflops": 2 * rows * i * o / ms / 1e9}
    out["layer"] = {
        "ms": sum(out[n]["ms"] for n in shapes),
        "tflop": sum(2 * rows * i * o for i, o in shapes.values()) / 1e12,
    }
    out["layer"]["tflops"] = out["layer"]["tflop"] * 1e3 / out["layer"]["ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="nano")
    ap.add_argument("--sizes", nargs="+", default=["832x480x189", "1280x720x189"], help="WIDTHxHEIGHTxFRAMES")
    ap.add_argument("--text", type=int, default=300, help="prefix (text) tokens per branch")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        write_skeleton(Path(tmp), args.preset)
        cfg = ModelConfig.from_files(Path(tmp) / "transformer" / "config.json", Path(tmp) / "vae" / "config.json")
    card, peak = card_flops()
    report = {"card": torch.cuda.get_device_name(), "preset": args.preset, "sizes": {}}
    for size in args.sizes:
        w, h, n = (int(x) for x in size.split("x"))
        tokens = tokens_for(cfg, h, w, n)
        att, lin = attention(cfg, tokens, args.text, args.repeat), linears(cfg, 2 * tokens, args.repeat)
        best = min(r["ms"] for r in att.values() if isinstance(r, dict) and "ms" in r)
        layer_flop = (att["tflop"] + lin["layer"]["tflop"]) * 1e12
        step = {"floor_ms": cfg.num_hidden_layers * layer_flop / peak * 1e3,
                "ours_ms": cfg.num_hidden_layers * (att["ours"]["ms"] + lin["layer"]["ms"]),
                "best_ms": cfg.num_hidden_layers * (best + lin["layer"]["ms"])}  # fmt: skip
        report["sizes"][size] = {"tokens_per_branch": tokens, "attention": att, "linears": lin, "step": step}
        print(f"== {args.preset} {size}: {tokens} tokens a branch, 2 branches, text {args.text}; {card} "
              f"({torch.cuda.get_device_name()}), floor at {peak / 1e12:.0f} TF/s")  # fmt: skip
        print(
            f"  attention a layer: {att['tflop']:.2f} TFLOP ({att['tflop'] / (att['tflop'] + lin['layer']['tflop']):.0%} of the layer)"
        )
        for name, r in att.items():
            if isinstance(r, dict) and "ms" in r:
                extra = f"  rel-L2 to ours {r['rel_l2']:.1e}" if "rel_l2" in r else ""
                print(f"    {name:10s} {r['ms']:8.2f} ms  {r['tflops']:6.0f} TF/s{extra}")
            elif isinstance(r, dict):
                print(f"    {name:10s} {r['error']}")
        print(f"  linears a layer: {lin['layer']['tflop']:.2f} TFLOP")
        for name, r in lin.items():
            print(f"    {name:10s} {r['ms']:8.2f} ms  {r['tflops']:6.0f} TF/s")
        print(f"  a step's layers: floor {step['floor_ms']:.0f} ms; at these kernels: ours {step['ours_ms']:.0f} ms "
              f"({step['ours_ms'] / step['floor_ms']:.2f}x), the best attention {step['best_ms']:.0f} ms "
              f"({step['best_ms'] / step['floor_ms']:.2f}x)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
