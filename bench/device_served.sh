#!/usr/bin/env bash
# On the H200, after bench/device_env.sh on the same (warm) machine: served benchmark, then in-process vs diffusers.
set -uo pipefail
[ -x /tmp/v/bin/python ] || { echo "no /tmp/v: run bench/device_env.sh first on this machine"; exit 3; }
bash bench/device_env.sh
export COSMOS3_CACHE=/tmp/c3cache
timeout 330 /tmp/v/bin/python -m bench.served --config configs/bench_edge.yaml --c1 3 --c4 8 --json $OUT/served.json > $OUT/served.txt 2>&1
tail -8 $OUT/served.txt
timeout 170 /tmp/v/bin/python -m bench.inprocess --preset edge --compile --repeat 1 --json $OUT/inprocess.json > $OUT/inprocess.txt 2>&1
grep -v -e Warning -e "float32" $OUT/inprocess.txt | tail -12
