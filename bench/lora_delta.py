"""The LoRA delta's cost beside its base linear, on the GPU, at a checkpoint's layer shapes (model/lora.py).

  python -m bench.lora_delta [--variant edge] [--rows 24192 96768] [--rank 32] [--slots 4] [--adapters 1 4]

For each adaptable linear shape of the variant (random_checkpoint's presets: Edge's attention and MLP), bf16, a pack
of `rows` rows split into as many equal segments as adapters, over a pool of `--slots` slots (a deployment's
`max_loras`: the dense form computes every slot's columns): the base linear alone, then the linear plus each form
of the delta — milliseconds per call (CUDA events, median of 20 after 5 warm) and the ratio. Forms: `grouped_delta`
(two grouped GEMMs), `dense_delta` (what CUDA serves: one GEMM through every slot's A, then y + h·Bᵀ with the add in
the second GEMM's epilogue) and `dense_into_base` (a candidate, 16-bit linears only: d = h·Bᵀ first, then the base
GEMM accumulates into d — y is never written and read again) and, for a pack of one adapter, `merged_linear` (what
CUDA serves for a request alone: the adapter merged into the weight each call). One JSON line per (rows, shape,
adapters, form).
Rows: Edge t2v 832×480×121 has 12,090 tokens per CFG branch (12,096 aligned): 24,192 is one request (c=1), 96,768
four (c=4).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch import nn

from cosmos3_core.model.lora import AdapterRows, dense_delta, grouped_delta, merged_linear, slot_projection
from cosmos3_core.model.random_checkpoint import PRESETS


def with_delta(delta, lin: nn.Module, x: torch.Tensor, rows: AdapterRows) -> torch.Tensor:
    return delta(lin(x), x, lin, rows)


def dense_into_base(lin: nn.Module, x: torch.Tensor, rows: AdapterRows) -> torch.Tensor:
    slots, r = lin.lora_B.shape[:2]
    d = torch.mm(slot_projection(x, lin, rows), lin.lora_B.view(slots * r, -1))
    return d.addmm_(x, lin.weight.t())


FORMS = {
    "grouped_delta": lambda lin, x, rows: with_delta(grouped_delta, lin, x, rows),
    "dense_delta": lambda lin, x, rows: with_delta(dense_delta, lin, x, rows),
    "dense_into_base": dense_into_base,
    "merged_linear": merged_linear,  # one adapter only (every row on it)
}


def time_ms(fn, *args, reps: int = 20) -> float:
    """Median milliseconds of `fn(*args)` on the GPU."""
    for _ in range(5):
        fn(*args)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*args)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="edge")
    ap.add_argument("--rows", type=int, nargs="+", default=[24192, 96768])
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--adapters", type=int, nargs="+", default=[1, 4])
    args = ap.parse_args()
    cfg = PRESETS[args.variant]
    h, d = cfg["hidden_size"], cfg["head_dim"]
    q, kv, mlp = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["intermediate_size"]
    shapes = {"q": (h, q), "kv": (h, kv), "out": (q, h), "mlp_up": (h, mlp), "mlp_down": (mlp, h)}
    dev, dt = "cuda", torch.bfloat16
    for n_rows in args.rows:
        for name, (fan_in, fan_out) in shapes.items():
            lin = nn.Linear(fan_in, fan_out, bias=False, device=dev, dtype=dt)
            lin.register_buffer("lora_A", torch.randn(args.slots, args.rank, fan_in, device=dev, dtype=dt) * 0.01)
            lin.register_buffer("lora_B", torch.randn(args.slots, args.rank, fan_out, device=dev, dtype=dt) * 0.01)
            x = torch.randn(n_rows, fan_in, device=dev, dtype=dt)
            with torch.inference_mode():
                base = time_ms(lin, x)
                for n in args.adapters:
                    seg = -(-n_rows // n // 64) * 64
                    ends = [min((i + 1) * seg, n_rows) for i in range(n)] + [n_rows]
                    rows = AdapterRows(
                        torch.tensor([i % args.slots for i in range(n)] + [0], device=dev),
                        torch.tensor([1.0] * n + [0.0], device=dev),
                        torch.tensor(ends, dtype=torch.int32, device=dev),
                    )
                    for form, fn in FORMS.items():
                        if form == "merged_linear" and n > 1:
                            continue
                        at = {"rows": n_rows, "shape": name, "in": fan_in, "out": fan_out, "rank": args.rank,
                              "slots": args.slots, "adapters": n, "form": form, "base_ms": round(base, 4)}  # fmt: skip
                        try:  # one form failing (a kernel's layout rules) leaves the others' figures
                            t = time_ms(fn, lin, x, rows)
                        except RuntimeError as e:
                            print(json.dumps({**at, "error": str(e)[:300]}), flush=True)
                            continue
                        print(json.dumps({**at, "adapted_ms": round(t, 4), "ratio": round(t / base, 3)}), flush=True)


if __name__ == "__main__":
    main()
