#!/usr/bin/env bash
# On the H200 (device tool): install the carried wheels (.whl_env: diffusers, accelerate, pytest; .whl_fi:
# flashinfer-python 0.6.1 and its deps) and FlashInfer's JIT cache (.ficache, so kernels are not rebuilt),
# run the GPU tests and the in-process benchmark; the JIT cache goes back out as $OUT/ficache.tgz.
#   device run, carry [.whl_env, .whl_fi, .ficache]: bash bench/device_inprocess.sh "--compile --variants sdpa flashinfer+graphs"
set -uo pipefail
# not .whl_env's numpy 1.26 / grpc (the stub venv's): on PYTHONPATH they would shadow the base env's builds
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl_env/{diffusers,accelerate,pytest,pluggy,iniconfig}-*.whl \
  .whl_fi/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD COSMOS3_CACHE=/tmp/c3cache FLASHINFER_WORKSPACE_BASE=/tmp/fiws
[ -d /tmp/fiws ] || { [ -f .ficache/ficache.tgz ] && tar xzf .ficache/ficache.tgz -C /tmp; }
python3 -c "import torch, diffusers, flashinfer; print(torch.__version__, diffusers.__version__, flashinfer.__version__, torch.cuda.get_device_name())"
timeout 420 python3 -m pytest -q -p no:cacheprovider -x tests/test_gpu.py 2>&1 | grep -v Warning | tail -25 | tee $OUT/test_gpu.txt
for flags in "$@"; do
  echo "== bench.inprocess $flags"
  timeout 500 python3 -m bench.inprocess --preset edge --repeat 2 $flags --json "$OUT/edge_inprocess${flags// /}.json" 2>&1 \
    | grep -v -e Warning -e "should be kept in float32" | tail -12 | tee -a $OUT/edge_inprocess.txt
done
(cd /tmp && tar czf $OUT/ficache.tgz fiws)
