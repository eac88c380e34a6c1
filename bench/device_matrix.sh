#!/usr/bin/env bash
# On the H200, right after `bench/device_env.sh` on the same (warm) machine, carrying .whl/pytriton: the GPU matrix
# (bench/matrix.py), one server per model × precision. Arguments pick them (default: all four, ~10-12 min: split
# them over two calls of ≤ 10 min, e.g. `edge:bf16 edge:fp8` then `nano:bf16 nano:fp8`):
#   edge:bf16 edge:fp8 nano:bf16 nano:fp8
# Each prints its cells (✓ or the error) and writes $OUT/matrix_<model>_<precision>.json; bench.report-style
# markdown goes into BENCHMARKS.md's "GPU matrix" by hand from those lines.
set -uo pipefail
[ -x /tmp/v/bin/python ] || { echo "no /tmp/v: run bench/device_env.sh first on this machine"; exit 3; }
/tmp/v/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('pytriton') is None)" || \
  /tmp/v/bin/python -m pip install -q --no-index --no-deps .whl/pytriton/*.whl 2>&1 | grep -v -e "already exists" -e WARNING | tail -3
export COSMOS3_CACHE=/tmp/c3cache FLASHINFER_WORKSPACE_BASE=/tmp/fiws PYTHONUNBUFFERED=1
cells=("$@"); [ ${#cells[@]} -gt 0 ] || cells=(edge:bf16 edge:fp8 nano:bf16 nano:fp8)
for cell in "${cells[@]}"; do
  model=${cell%%:*} precision=${cell##*:}
  echo "== python -m bench.matrix --model $model --precision $precision"
  timeout ${CELL_TIMEOUT:-560} /tmp/v/bin/python -m bench.matrix --model "$model" --precision "$precision" \
    --json $OUT/matrix_${model}_${precision}.json 2>&1 | grep -v -e Warning -e float32 | tee $OUT/matrix_${model}_${precision}.txt | tail -${TAIL:-20}
done
