#!/usr/bin/env bash
# On the H200, after `bench/device_env.sh` and with nvidia-pytriton installed in /tmp/v (bench/device_served.sh
# does it): cold start with kernel caches built ahead. A fresh $COSMOS3_CACHE; the random:edge checkpoint is
# written first (a real deployment has its checkpoint on disk; not timed); `make warm`'s command builds the
# kernels into $COSMOS3_CACHE/kernels and times load + compile + warmup; then a new server on that cache is
# timed from launch to ready (bench.served's `server startup`), and serves one request.
#   device run, carry [.whl/pytriton] on the warm machine: bash bench/device_coldstart.sh
set -uo pipefail
[ -x /tmp/v/bin/python ] || { echo "no /tmp/v: run bench/device_env.sh first on this machine"; exit 3; }
/tmp/v/bin/python -c "import pytriton" 2>/dev/null || /tmp/v/bin/python -m pip install -q --no-index --no-deps .whl/pytriton/*.whl
unset FLASHINFER_WORKSPACE_BASE TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR
export COSMOS3_CACHE=/tmp/coldstart
rm -rf /tmp/coldstart /tmp/torchinductor_root
/tmp/v/bin/python -c "from cosmos3_core.tools.checkpoints import resolve_checkpoint; print(resolve_checkpoint('random:edge'))"
echo "== make warm (python -m cosmos3_core.tools.warm --config configs/bench_edge.yaml)"
/usr/bin/time -f "warm wall %e s" /tmp/v/bin/python -m cosmos3_core.tools.warm --config configs/bench_edge.yaml 2>&1 | grep -v -e Warning -e float32
du -sh /tmp/coldstart/kernels/* 2>/dev/null
echo "== a server on the built caches"
timeout 400 /tmp/v/bin/python -m bench.served --config configs/bench_edge.yaml --c1 1 --c4 0 --inprocess 0 --diffusers 0 \
  --json $OUT/coldstart.json 2>&1 | grep -v -e Warning -e float32 | tail -5
