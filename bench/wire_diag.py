"""Does a served pack's result follow the size of the text K/V crossing into the denoise stub? One server: packs of
a short and a long prompt, each against its solo runs.

  python -m bench.wire_diag --model nano [--precision fp8] [--pool-mb 64]

Issue 27 (BENCHMARKS.md, 14th and 15th sessions): served Nano packs came back black, and every later cell too, while
Edge passed. Nano's text K/V at the matrix prompt (473 tokens x 36 layers x 2 x 8 x 128 x 2 B = 69.7 MB) is larger
than Triton's default 64 MiB CUDA pool, Edge's (28 layers: 54 MB) fits in it: a tensor that does not fit crosses
through host shared memory, whose input buffers a decoupled model loses when `execute` returns. The server now sizes
the pool (`serve.cuda_pool_bytes`, the default here) and copies every input before `execute` returns;
`--pool-mb 64` runs with Triton's default pool, the path that failed. With FlashInfer, a non-finite value in one
request's prefix V spreads to the segment before it in the pack (FA3 reads whole K/V tiles past a request's end and
multiplies their V by 0), so one bad request blackens its pack mates.

Phases, in this order on one server (2-step 33-frame requests, the matrix's t2v, i2v, t2v with seeds 1-3, each
alone, then the three at once): `short` (one short prompt for all three, as the matrix: one prompt), `short mixed`
(three prompts of equal length: a request that reads another's freed K/V shows the other's prompt, finite but not
its solo video), `long`, `long mixed`, then a `short` solo run again (is anything left poisoned?) and a SeaCache solo
run (reused steps?). Each line: per request whether its video is one value (black: NaN) and its rel-L2 to its solo
run (> 0.05: ✗).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from client.stream import generate
from cosmos3_core.model.prompts import PromptEncoder
from cosmos3_core.triton.launcher import ServerConfig, free_port, launch_server, stop_server, wait_until_ready
from cosmos3_core.triton.serve import cuda_pool_bytes, render

from .matrix import FRAMES, MODELS, SEA, SEA_STEPS, STEPS, deployment_of, rel_l2
from .pool import run_pool
from .served import PROMPT, variant_request

SHORT = "a red cube"
# a negative prompt that doubles the uncond branch's tokens: the long case is above a 64 MiB pool
LONG_NEGATIVE = ", ".join(["blurry, low quality, distorted, jittery, overexposed, watermark, text"] * 4)


def kv_bytes(d, prompt: str, negative: str) -> tuple[int, int]:
    """(text tokens of both branches, bytes of the request's text_kv) as prefill builds them."""
    ckpt = d.open_checkpoint()
    cfg = ckpt.config
    enc = PromptEncoder(ckpt.load_tokenizer(), ckpt.default_use_system_prompt)
    size = (d.defaults.height, d.defaults.width)
    tokens = sum(len(x) for x in enc.encode(prompt, negative, FRAMES, *size, d.defaults.fps))
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * d.torch_dtype.itemsize
    return tokens, tokens * per_token


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=list(MODELS), default="nano")
    ap.add_argument("--precision", choices=["bf16", "fp8"], default="bf16")
    ap.add_argument(
        "--pool-mb",
        type=int,
        default=0,
        help="tritonserver --cuda-memory-pool-byte-size in MiB (0: as serve sizes it; 64: Triton's default)",
    )
    args = ap.parse_args()
    d = deployment_of(args.model, args.precision)
    size = (d.defaults.height, d.defaults.width)
    pool = args.pool_mb << 20 if args.pool_mb else cuda_pool_bytes(d)
    prompts = {"short": (SHORT, ""), "long": (PROMPT, LONG_NEGATIVE)}
    # three prompts of one length (a byte-level tokenizer: the same token count), one per request of a pack
    mixed = {name: [(p.replace("red", c), n) for c in ("red", "tan", "sky")] for name, (p, n) in prompts.items()}
    for name, (prompt, negative) in prompts.items():
        tokens, nbytes = kv_bytes(d, prompt, negative)
        print(f"{name}: {tokens} text tokens, text_kv {nbytes / 1e6:.1f} MB ({'over' if nbytes > pool else 'within'} "
              f"the {pool >> 20} MiB CUDA pool)", flush=True)  # fmt: skip
    workdir = Path(tempfile.mkdtemp(prefix="cosmos3-wire-"))
    repo, _ = render(d, workdir)
    ports = [free_port() for _ in range(3)]
    cpu_only = not d.torch_device.startswith("cuda")
    proc = launch_server(ServerConfig(repo, *ports, cpu_only=cpu_only, log_path=workdir / "tritonserver.log",
                                      cuda_pool_bytes=0 if cpu_only else pool))  # fmt: skip
    url, t0 = f"127.0.0.1:{ports[0]}", time.perf_counter()

    def one(request: tuple) -> dict:
        prompt, negative, kind, seed, extra_params = request
        params, image, clip, raw = variant_request(kind, {"steps": STEPS, "num_frames": FRAMES, **extra_params}, *size)
        r = generate(url, prompt, {**params, "seed": seed, "negative_prompt": negative}, image, video=clip,
                     raw_actions=raw, timeout_s=900)  # fmt: skip
        done = next(e for e in r.events if e["type"] == "done")
        return {"seed": seed, "video": r.video, "skipped": done.get("cache_skipped")}

    def show(label: str, out: dict, solo: dict | None = None) -> None:
        black = bool(np.ptp(out["video"]) == 0)
        rel = "" if solo is None else f"  rel-L2 to solo {rel_l2(out['video'], solo['video']):.3f}"
        print(f"  {label} seed {out['seed']}: {'BLACK (one value)' if black else 'ok'}{rel}", flush=True)

    try:
        wait_until_ready(ports[1], proc=proc, timeout_s=900)
        print(f"ready in {time.perf_counter() - t0:.0f}s", flush=True)
        solos: dict[str, dict[int, dict]] = {}
        phases = [(f"{size}{' mixed' if mix else ''}", mixed[size] if mix else [prompts[size]] * 3)
                  for size in prompts for mix in (False, True)]  # fmt: skip
        for name, texts in phases:
            kinds = (("t2v", 1), ("i2v", 2), ("t2v", 3))
            requests = [(prompt, negative, kind, seed, {}) for (prompt, negative), (kind, seed) in zip(texts, kinds)]
            print(f"{name}:", flush=True)
            solos[name] = {r[3]: one(r) for r in requests}
            for out in solos[name].values():
                show("solo  ", out)
            for out in sorted(run_pool(requests, 3, one), key=lambda o: o["seed"]):
                show("packed", out, solos[name][out["seed"]])
        print("short again, after the long pack:", flush=True)
        show("solo  ", one((SHORT, "", "t2v", 1, {})), solos["short"][1])
        sea = one((SHORT, "", "t2v", 1, {"cache": SEA["cache"], "steps": SEA_STEPS}))
        show(f"SeaCache solo (reused {sea['skipped']})", sea)
    finally:
        stop_server(proc)
        log = (workdir / "tritonserver.log").read_text() if (workdir / "tritonserver.log").exists() else ""
        for line in [x for x in log.splitlines() if "cosmos3:" in x][-10:]:
            print("  log:", line[:300])
    return 0


if __name__ == "__main__":
    sys.exit(main())
