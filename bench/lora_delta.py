"""The LoRA delta's cost beside its base linear, on the GPU, at a checkpoint's layer shapes (model/lora.py).

  python -m bench.lora_delta [--variant edge] [--rows 96768] [--rank 32] [--adapters 1 4]

For each adaptable linear shape of the variant (random_checkpoint's presets: Edge's attention and MLP), bf16, a pack
of `rows` rows split into as many equal segments as adapters (a pool of max(adapters) slots): the base linear alone,
then the linear plus each kernel's delta (`grouped_delta`, `dense_delta`) — milliseconds per call (CUDA events,
median of 20 after 5 warm) and the ratio. One JSON line per (shape, adapters, kernel). The rows: Edge t2v
832×480×121, both CFG branches (2 × 48,384 tokens).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch import nn

from cosmos3_core.model.lora import AdapterRows, dense_delta, grouped_delta
from cosmos3_core.model.random_checkpoint import PRESETS


def adapted_with(kernel, lin: nn.Module, x: torch.Tensor, rows: AdapterRows) -> torch.Tensor:
    return kernel(lin(x), x, lin, rows)


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
    ap.add_argument("--rows", type=int, default=2 * 48384)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--adapters", type=int, nargs="+", default=[1, 4])
    args = ap.parse_args()
    cfg = PRESETS[args.variant]
    h, d = cfg["hidden_size"], cfg["head_dim"]
    q, kv, mlp = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["intermediate_size"]
    shapes = {"q": (h, q), "kv": (h, kv), "out": (q, h), "mlp_up": (h, mlp), "mlp_down": (mlp, h)}
    dev, dt = "cuda", torch.bfloat16
    for name, (fan_in, fan_out) in shapes.items():
        lin = nn.Linear(fan_in, fan_out, bias=False, device=dev, dtype=dt)
        slots = max(args.adapters)
        lin.register_buffer("lora_A", torch.randn(slots, args.rank, fan_in, device=dev, dtype=dt) * 0.01)
        lin.register_buffer("lora_B", torch.randn(slots, args.rank, fan_out, device=dev, dtype=dt) * 0.01)
        x = torch.randn(args.rows, fan_in, device=dev, dtype=dt)
        with torch.inference_mode():
            base = time_ms(lin, x)
            for n in args.adapters:
                seg = -(-args.rows // n // 64) * 64
                ends = [min((i + 1) * seg, args.rows) for i in range(n)] + [args.rows]
                rows = AdapterRows(
                    torch.tensor([*range(n), 0], device=dev),
                    torch.tensor([1.0] * n + [0.0], device=dev),
                    torch.tensor(ends, dtype=torch.int32, device=dev),
                )
                for kernel in (grouped_delta, dense_delta):
                    t = time_ms(adapted_with, kernel, lin, x, rows)
                    print(json.dumps({"shape": name, "in": fan_in, "out": fan_out, "rows": args.rows,
                                      "rank": args.rank, "slots": slots, "adapters": n, "kernel": kernel.__name__,
                                      "base_ms": round(base, 4), "adapted_ms": round(t, 4),
                                      "ratio": round(t / base, 3)}))  # fmt: skip


if __name__ == "__main__":
    main()
