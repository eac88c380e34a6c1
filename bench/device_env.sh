#!/usr/bin/env bash
# On the H200: a venv whose python3 the Triton Python stub will use (numpy<2 first, the base env's torch after,
# via a .pth — the recipe in shared/docs/triton.md), with the carried wheels installed into it: .whl_env
# (numpy 1.26, tritonclient + grpc, diffusers, accelerate, pytest), .whl_fi (flashinfer-python 0.6.1 + deps),
# .ficache (FlashInfer's JIT cache, so no kernel is rebuilt). Then the GPU tests in that venv.
#   device run, carry [.whl_env, .whl_fi, .ficache]: bash bench/device_env.sh   (then bench/device_served.sh)
set -euo pipefail
BASE_SITE=$(python3 -c "import site; print(site.getsitepackages()[0])")
[ -x /tmp/v/bin/python ] || python3 -m venv /tmp/v
# the base env after the venv; its numpy-2 builds that diffusers/transformers import when present are hidden
echo "import sys; sys.path.append('$BASE_SITE'); sys.modules.update(dict.fromkeys(['scipy', 'sklearn', 'pandas']))" \
  > /tmp/v/lib/python3.12/site-packages/zz_base.pth
/tmp/v/bin/python -m pip install -q --no-index --no-deps .whl_env/*.whl 2>&1 | grep -v -e "already exists" -e WARNING | tail -3 || true
# flashinfer where its JIT cache was built (/tmp/site): the cached ninja files name these paths, elsewhere it rebuilds
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl_fi/*.whl 2>&1 | tail -2
echo /tmp/site > /tmp/v/lib/python3.12/site-packages/flashinfer_site.pth
echo "$PWD" > /tmp/v/lib/python3.12/site-packages/cosmos3_repo.pth
[ -d /tmp/fiws ] || tar xzf .ficache/ficache.tgz -C /tmp
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws COSMOS3_CACHE=/tmp/c3cache
/tmp/v/bin/python -c "
import numpy, torch, tritonclient.grpc, cosmos3_core, flashinfer
from diffusers import AutoencoderKLWan, Cosmos3OmniPipeline, UniPCMultistepScheduler
print('numpy', numpy.__version__, 'torch', torch.__version__, 'flashinfer', flashinfer.__version__, torch.cuda.get_device_name())"
if [ "${1:-}" = "--tests" ]; then
  timeout 300 /tmp/v/bin/python -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | grep -v Warning | tail -6 | tee $OUT/test_gpu.txt
fi
