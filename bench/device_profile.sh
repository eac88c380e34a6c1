#!/usr/bin/env bash
# On the H200 (device tool): the GPU tests, then `bench.profile_phases` (kernel time by category for the Edge
# denoise step and the VAE decode, decode variants). Same carried wheels as device_inprocess.sh.
#   device run, carry [.whl_env, .whl_fi, .ficache]: bash bench/device_profile.sh [--tests] [profile_phases args]
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl_env/{diffusers,accelerate,pytest,pluggy,iniconfig}-*.whl \
  .whl_fi/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD COSMOS3_CACHE=/tmp/c3cache FLASHINFER_WORKSPACE_BASE=/tmp/fiws
[ -d /tmp/fiws ] || { [ -f .ficache/ficache.tgz ] && tar xzf .ficache/ficache.tgz -C /tmp; }
if [ "${1:-}" = "--tests" ]; then
  shift
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | grep -v Warning | tail -15 | tee $OUT/test_gpu.txt
fi
timeout 330 python3 -m bench.profile_phases "$@" 2>&1 | grep -v -e Warning -e "float32" -e USDT | tee $OUT/profile.txt | tail -90
