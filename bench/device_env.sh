#!/usr/bin/env bash
# On the H200: a venv whose python3 the Triton Python stub will use (numpy<2 first, the base env's torch after,
# via a .pth — the recipe in shared/docs/triton.md), with the carried wheels installed into it.
set -euo pipefail
BASE_SITE=$(python3 -c "import site; print(site.getsitepackages()[0])")
[ -x /tmp/v/bin/python ] || python3 -m venv /tmp/v
# the base env after the venv; its numpy-2 builds that diffusers/transformers import when present are hidden
echo "import sys; sys.path.append('$BASE_SITE'); sys.modules.update(dict.fromkeys(['scipy', 'sklearn', 'pandas']))" \
  > /tmp/v/lib/python3.12/site-packages/zz_base.pth
/tmp/v/bin/python -m pip install -q --no-index --no-deps .whl/*.whl 2>&1 | grep -v -e "already exists" -e WARNING | tail -3 || true
echo "$PWD" > /tmp/v/lib/python3.12/site-packages/cosmos3_repo.pth
/tmp/v/bin/python -c "
import numpy, torch, tritonclient.grpc, cosmos3_core
from transformers import AutoTokenizer
from diffusers import AutoencoderKLWan, Cosmos3OmniPipeline, UniPCMultistepScheduler
print('numpy', numpy.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
