#!/usr/bin/env bash
# On the H200 (device tool): install the carried wheels, run the GPU tests and the in-process benchmark.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD COSMOS3_CACHE=/tmp/c3cache
python3 -c "import torch, diffusers, transformers; print(torch.__version__, diffusers.__version__, transformers.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -15 | tee $OUT/test_gpu.txt
timeout 420 python3 -m bench.inprocess --preset edge --repeat 2 --json $OUT/edge_inprocess.json 2>&1 | grep -v Warning | tail -20 | tee $OUT/edge_inprocess.txt
