#!/usr/bin/env bash
# On the H200, after bench/device_env.sh on the same warm machine (its venv /tmp/v; /tmp/site with tvm-ffi 0.1.15 and
# cudnn-frontend 1.32, which 0.7.4 takes as they are): FlashInfer 0.7.4 (.whl/fi074: the wheel without its unused
# CUDA sources, bench/slim_wheel.py, 54 MiB) into /tmp/site074, ahead of /tmp/site for this script's processes only
# (PYTHONPATH): /tmp/site keeps 0.6.1 for later calls. Its JIT cache: /tmp/fiws074 (0.6.1's /tmp/fiws untouched).
# Issue 30's lever "a newer FlashInfer", in one call (~2-3 min with the FP8 module's JIT, ~1.5 min without):
#   1. bench/fa3_fp8_repro.py: the standalone repro (torch + flashinfer), FA3 FP8 vs fp32 per case ($OUT/repro.*);
#      REPRO_ARGS adds e.g. '--backends fa3 cudnn' (cuDNN's FP8 prefill) or '--bf16' (fa3 bf16, a second JIT)
#   2. tests/test_gpu_fp8attn.py (the load check and the kernel matrix; FI074_K='' runs the whole file: with
#      the defect gone, its engine test JIT-builds the bf16 module too) ($OUT/test_fp8attn.txt)
#   3. bench/fp8attn_fidelity.py: the 1.25x bar on a tiny model, when the load check passes ($OUT/fidelity.*)
#   4. PROBE=1: bench/fp8attn_probe.py (one attention layer call split; the compiled quantization's rows) ($OUT/probe.*)
#   REPRO_061=1 first runs the repro against the pinned 0.6.1 too ($OUT/repro061.*), for the bug report's before
#   device run, carry [.whl/fi074] (+ out/fi074_aot, the FP8 module built ahead without a GPU, when there):
#     bash bench/device_env.sh && bash bench/device_fi074.sh
#   (`make device-wheels` makes .whl/fi074; a fresh machine: carry .whl/env + .whl/parity for device_env.sh in
#   one call, then .whl/fi074 in the next: 54 MiB does not fit beside them)
set -uo pipefail
OUT=${OUT:-/tmp/out_fi074}
mkdir -p "$OUT"
t0=$SECONDS
if [ ! -x /tmp/v/bin/python ] || [ ! -d /tmp/site/tvm_ffi ]; then
  echo "device_fi074: run bench/device_env.sh on this machine first (/tmp/v, /tmp/site)"; exit 2
fi
if [ ! -d /tmp/site074/flashinfer ]; then
  ls .whl/fi074/flashinfer_python-0.7.4-*.whl >/dev/null || { echo "device_fi074: carry .whl/fi074"; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site074 .whl/fi074/*.whl 2>&1 \
    | grep -v -e WARNING -e "already exists" | tail -2
fi
# FlashInfer's own prebuilt-module folder (flashinfer/data/aot/<name>/<name>.so): found there, a module is not JIT-built
# (an unloadable one is: flashinfer falls back to the JIT). out/fi074_aot (1.9 MB, the FP8 module only) was built
# without a GPU from .whl/fi074 installed to a folder (+ this Python's tvm-ffi 0.1.15): FLASHINFER_CUDA_ARCH_LIST=9.0a,
# flashinfer.jit.build_jit_specs(attention.flashinfer_module_specs("fa3", torch.bfloat16, 128, fp8=True)), CPATH with
# curand's headers, linked against CUDA 13.0's libcudart (no -lcuda: it calls no driver API); ~50 min on 2 busy cores
[ -d out/fi074_aot ] && mkdir -p /tmp/site074/flashinfer/data/aot && cp -r out/fi074_aot/. /tmp/site074/flashinfer/data/aot/
export PYTHONPATH=/tmp/site074 FLASHINFER_WORKSPACE_BASE=/tmp/fiws074 COSMOS3_CACHE=/tmp/c3cache074 PYTHONUNBUFFERED=1
PY=/tmp/v/bin/python
$PY -c "
import flashinfer, tvm_ffi, torch
assert flashinfer.__version__ == '0.7.4' and flashinfer.__file__.startswith('/tmp/site074/'), flashinfer.__file__
print('flashinfer', flashinfer.__version__, flashinfer.__file__, '| tvm_ffi', tvm_ffi.__version__, '| torch',
      torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
from flashinfer.jit import env; print('prebuilt modules:', sorted(p.name for p in env.FLASHINFER_AOT_DIR.glob('*')))
" || exit 1
echo "install + import: $((SECONDS - t0)) s"

# 0. REPRO_061=1: the repro against the pinned 0.6.1 first (/tmp/site, its JIT cache /tmp/fiws: ~90 s more unless
#    an earlier call built its FP8 module there)
if [ -n "${REPRO_061:-}" ]; then
  PYTHONPATH= FLASHINFER_WORKSPACE_BASE=/tmp/fiws timeout 300 $PY bench/fa3_fp8_repro.py --json "$OUT/repro061.json" \
    ${REPRO_ARGS:-} > "$OUT/repro061.txt" 2>&1
  echo "repro 0.6.1 rc=$? ($((SECONDS - t0)) s)"
  grep -v -e Warning -e "^fa3 " -e "^cudnn " -e "^fa3_bf16 " "$OUT/repro061.txt" | tail -12
fi

# 1. the standalone repro (its first case JIT-builds the FP8 module unless prebuilt: ~90 s)
timeout 300 $PY bench/fa3_fp8_repro.py --json "$OUT/repro.json" ${REPRO_ARGS:-} > "$OUT/repro.txt" 2>&1
echo "repro rc=$? ($((SECONDS - t0)) s)"
grep -v -e Warning -e "^fa3 " -e "^cudnn " -e "^fa3_bf16 " "$OUT/repro.txt" | tail -25
grep -c WRONG "$OUT/repro.txt" | sed 's/^/repro lines WRONG: /'

# 2. the kernel matrix and the load check through cosmos3_core, against 0.7.4
timeout 240 $PY -m pytest -q -rfxXP --tb=short -p no:cacheprovider tests/test_gpu_fp8attn.py \
  -k "${FI074_K-load_check or kernel_matrix}" > "$OUT/test_fp8attn.txt" 2>&1
echo "tests rc=$? ($((SECONDS - t0)) s)"
grep -v Warning "$OUT/test_fp8attn.txt" | grep -E "passed|failed|skipped|XFAIL|XPASS|FAILED|Error" | cut -c1-300 | tail -30

# 3. the fidelity bar on a tiny model (skips FA3 by itself when the load check refuses it)
timeout 240 $PY -m bench.fp8attn_fidelity --json "$OUT/fidelity.json" > "$OUT/fidelity.txt" 2>&1
echo "fidelity rc=$? ($((SECONDS - t0)) s)"
grep -v -e Warning -e warn "$OUT/fidelity.txt" | tail -12
# 4. PROBE=1: one attention layer call split, bf16 / FP8 eager / FP8 compiled quantization (bench/fp8attn_probe.py)
if [ -n "${PROBE:-}" ]; then
  timeout 180 $PY -m bench.fp8attn_probe --json "$OUT/probe.json" > "$OUT/probe.txt" 2>&1
  echo "probe rc=$? ($((SECONDS - t0)) s)"
  grep -v -e Warning -e warn "$OUT/probe.txt" | tail -30
fi
echo "device_fi074: $((SECONDS - t0)) s"
