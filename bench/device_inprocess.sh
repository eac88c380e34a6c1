#!/usr/bin/env bash
# On the H200 (device tool): install the carried wheels, run the GPU tests and the in-process benchmark.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD COSMOS3_CACHE=/tmp/c3cache
python3 -c "import torch, diffusers, transformers; print(torch.__version__, diffusers.__version__, transformers.__version__, torch.cuda.get_device_name())"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -3 | tee $OUT/test_gpu.txt
for flags in "$@"; do
  echo "== bench.inprocess $flags"
  timeout 400 python3 -m bench.inprocess --preset edge --repeat 2 $flags --json "$OUT/edge_inprocess${flags// /}.json" 2>&1 \
    | grep -v -e Warning -e "should be kept in float32" | tail -12 | tee -a $OUT/edge_inprocess.txt
done
