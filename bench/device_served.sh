#!/usr/bin/env bash
# On the H200, right after `bench/device_env.sh` on the same (warm) machine, carrying .whl (nvidia-pytriton only):
# the served benchmarks — Edge t2v single-shot at c=1 and c=4, then Nano AR chained streams at c=1 and c=4.
set -uo pipefail
[ -x /tmp/v/bin/python ] || { echo "no /tmp/v: run bench/device_env.sh first on this machine"; exit 3; }
/tmp/v/bin/python -m pip install -q --no-index --no-deps .whl/*.whl 2>&1 | grep -v -e "already exists" -e WARNING | tail -3
export COSMOS3_CACHE=/tmp/c3cache FLASHINFER_WORKSPACE_BASE=/tmp/fiws
timeout 240 /tmp/v/bin/python -m bench.served --config configs/bench_edge.yaml --c1 3 --c4 8 --json $OUT/served_edge.json \
  > $OUT/served_edge.txt 2>&1
tail -6 $OUT/served_edge.txt
timeout 300 /tmp/v/bin/python -m bench.served --config configs/bench_nano_ar.yaml --c1 0 --c4 0 --ar 1 \
  --ar-params "${NANO_AR:-{\"window_mode\": \"chained\", \"num_frames\": 45, \"steps\": 10}}" \
  --json $OUT/served_nano_ar.json > $OUT/served_nano_ar.txt 2>&1
tail -6 $OUT/served_nano_ar.txt
