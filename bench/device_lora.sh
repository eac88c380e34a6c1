#!/usr/bin/env bash
# On the H200, right after `bench/device_env.sh` on the same (warm) machine, carrying .whl/pytriton (and .whl/lora:
# peft 0.21.2, installed only when the image's peft is missing or older than diffusers' 0.17 floor): LoRA's GPU runs
# (issue 32). Arguments pick the parts, in order (default: served):
#   tests    tests/test_lora_gpu.py (the CUDA delta vs the CPU's, fp32/bf16/fp16/FP8 requests, captures, no sync): 2 min
#   delta    bench.lora_delta: each form of the delta beside its base linear at Edge's shapes, c=1 and c=4 rows: ~30 s
#   served   bench.lora_bench on configs/bench_edge.yaml (Edge t2v 832x480x121, 20 steps, bf16, compile, graphs):
#            rank-32 adapters on both towers, c=1 base vs adapter, c=4 base vs 4 adapters, first use, diffusers
#            without and with the adapter. ~4-4.5 min (adapters ~10 s, startup ~70-100 s, served ~2.5 min, diffusers ~50 s)
# Logs and JSON go to $OUT (lora_*.txt, lora_bench.json, lora_rows.md: the BENCHMARKS.md row to paste).
#   device run, carry [.whl/pytriton, .whl/lora]: bash bench/device_lora.sh served      (after device_env.sh)
set -uo pipefail
OUT=${OUT:-/tmp/out_lora}
mkdir -p "$OUT"
[ -x /tmp/v/bin/python ] || { echo "no /tmp/v: run bench/device_env.sh first on this machine"; exit 3; }
/tmp/v/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('pytriton') is None)" || \
  /tmp/v/bin/python -m pip install -q --no-index --no-deps .whl/pytriton/*.whl 2>&1 | grep -v -e "already exists" -e WARNING | tail -3
/tmp/v/bin/python -c "import sys, peft; sys.exit(tuple(map(int, peft.__version__.split('.')[:2])) < (0, 17))" 2>/dev/null || \
  { [ -d .whl/lora ] && /tmp/v/bin/python -m pip install -q --no-index --no-deps .whl/lora/*.whl 2>&1 | tail -2; }
/tmp/v/bin/python -c "import peft; print('peft', peft.__version__)" 2>&1 | tail -1
export COSMOS3_CACHE=/tmp/c3cache FLASHINFER_WORKSPACE_BASE=/tmp/fiws PYTHONUNBUFFERED=1
parts=("$@"); [ ${#parts[@]} -gt 0 ] || parts=(served)
for part in "${parts[@]}"; do
  echo "== $part"
  case $part in
    tests) timeout 300 /tmp/v/bin/python -m pytest -q -rfxX --tb=short -p no:cacheprovider tests/test_lora_gpu.py \
             > $OUT/lora_tests.txt 2>&1
           grep -v Warning $OUT/lora_tests.txt | tail -30 ;;
    delta) timeout 120 /tmp/v/bin/python -m bench.lora_delta > $OUT/lora_delta.txt 2>&1
           /tmp/v/bin/python -c "
import json, sys
for line in open('$OUT/lora_delta.txt'):
    if line.startswith('{'):
        r = json.loads(line)
        print(f\"{r['rows']:6d} {r['shape']:8s} adapters {r['adapters']} {r['form']:15s} base {r['base_ms']:.3f} ms  \"
              + (f\"x{r['ratio']:.3f}\" if 'ratio' in r else r['error']))
" || tail -20 $OUT/lora_delta.txt ;;
    served) timeout 560 /tmp/v/bin/python -m bench.lora_bench --config configs/bench_edge.yaml ${LORA_ARGS:-} \
              --json $OUT/lora_bench.json --md $OUT/lora_rows.md > $OUT/lora_bench.txt 2>&1
            grep -v -e Warning -e float32 -e WeightNorm $OUT/lora_bench.txt | tail -${TAIL:-30} ;;
    *) echo "unknown part $part (tests, delta, served)"; exit 2 ;;
  esac
done
