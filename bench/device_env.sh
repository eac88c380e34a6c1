#!/usr/bin/env bash
# On the GPU machine (H100 or H200): a venv whose python3 the Triton Python stub will use (numpy<2 first, the base
# env's torch after, via a .pth — the recipe in shared/docs/triton.md), with the carried wheels installed into it: .whl/env
# (numpy 1.26, tritonclient 2.73, python-rapidjson) in the venv; .whl/parity (diffusers 0.42.1, flashinfer-python
# 0.6.1 + deps) in /tmp/site unless an earlier call on this warm machine (bench/device_parity.sh) put it there.
# FlashInfer's JIT cache stays in /tmp/fiws while the machine is warm. .whl/perf_analyzer (bench/perf_analyzer/
# fetch.sh, 18 MB), when carried, goes to /tmp/perf_analyzer for bench/device_served.sh. Then the GPU tests
# (tests/test_gpu*.py, tests/test_decoder.py) in that venv.
#   device run, carry [.whl/env] (+ .whl/parity on a fresh machine, + .whl/perf_analyzer): [GPU_TESTS=...] bash bench/device_env.sh [--tests]
#   (then bench/device_served.sh; the wheels: `make device-wheels`)
set -euo pipefail
BASE_SITE=$(python3 -c "import site; print(site.getsitepackages()[0])")
[ -x /tmp/v/bin/python ] || python3 -m venv /tmp/v
# the base env after the venv; its numpy-2 builds that diffusers/transformers import when present are hidden
echo "import sys; sys.path.append('$BASE_SITE'); sys.modules.update(dict.fromkeys(['scipy', 'sklearn', 'pandas']))" \
  > /tmp/v/lib/python3.12/site-packages/zz_base.pth
/tmp/v/bin/python -m pip install -q --no-index --no-deps .whl/env/*.whl 2>&1 | grep -v -e "already exists" -e WARNING | tail -3 || true
# flashinfer where its JIT cache is built (/tmp/site): the cached ninja files name these paths, elsewhere it rebuilds
[ -d /tmp/site/flashinfer ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/parity/*.whl 2>&1 | tail -2
echo /tmp/site > /tmp/v/lib/python3.12/site-packages/flashinfer_site.pth
echo "$PWD" > /tmp/v/lib/python3.12/site-packages/cosmos3_repo.pth
# FlashInfer's modules built ahead without a GPU (tools/warm.py --kernels-only), when carried as out/fi_aot: loaded
# from FlashInfer's workspace (caches.flashinfer_aot_dir) instead of ~90 s of JIT per module on a fresh machine
[ -d out/fi_aot ] && mkdir -p /tmp/fiws/aot/sm90a && cp -r out/fi_aot/. /tmp/fiws/aot/sm90a/
[ -x .whl/perf_analyzer/bin/perf_analyzer ] && rm -rf /tmp/perf_analyzer && cp -r .whl/perf_analyzer /tmp/perf_analyzer
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws COSMOS3_CACHE=/tmp/c3cache
/tmp/v/bin/python -c "
import numpy, torch, tritonclient.grpc, cosmos3_core, flashinfer
from diffusers import AutoencoderKLWan, Cosmos3OmniPipeline, UniPCMultistepScheduler
print('numpy', numpy.__version__, 'torch', torch.__version__, 'flashinfer', flashinfer.__version__, torch.cuda.get_device_name())"
if [ "${1:-}" = "--tests" ]; then
  # the whole log comes back in $OUT (a failure's traceback is what the next CPU session works from); the tail here
  # GPU_TESTS: a subset (e.g. GPU_TESTS=tests/test_gpu_fp8attn.py) when device time is short
  timeout 540 /tmp/v/bin/python -m pytest -q -rfxX --tb=short -p no:cacheprovider ${GPU_TESTS:-tests/test_gpu*.py tests/test_decoder.py} \
    > $OUT/test_gpu.txt 2>&1 || true
  grep -v Warning $OUT/test_gpu.txt | tail -40
fi
