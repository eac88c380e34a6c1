#!/usr/bin/env bash
# On the H200, after `bench/device_env.sh`, with .whl/pytriton carried (installed into /tmp/v once; `build` and
# `decode` start no server and need none): cold start to ready of Edge (configs/bench_edge.yaml), each case on a
# fresh $COSMOS3_CACHE (/tmp/coldstart) and a fresh server, timed by bench.served's `server startup` (launch →
# ready: load, compile, warmup), which then serves one request. The random:edge checkpoint is written first (a
# real deployment has its checkpoint on disk; not timed). Cases (arguments, default: aot warm):
#   aot   a fresh machine with only FlashInfer's modules built ahead carried in: $FI_AOT, what
#         `python -m cosmos3_core.tools.warm --kernels-only --config configs/bench_edge.yaml --cuda-arch 9.0a` wrote
#         into kernels/flashinfer/aot/sm90a on a machine without a GPU, copied to $COSMOS3_CACHE/kernels/flashinfer/
#         aot/sm90a; no inductor or Triton cache: torch.compile runs at startup
#   warm  `make warm`'s command first (timed: FlashInfer's modules, kept from $FI_AOT when given, else built here;
#         torch.compile's caches), then a new server on those caches
#   build  `make warm`'s command on a fresh cache (FlashInfer's modules kept from $FI_AOT when given, else built
#         here), its `kernels/` folder tarred into $OUT as 15 MiB pieces (kernels.tgz.aa, …; Edge's: 7.9 MB, one)
#         for `carried` on another machine (no server)
#   carried  a fresh machine with build's pieces ($KERNELS_IN: the folder they were carried in) unpacked into a
#         fresh $COSMOS3_CACHE, then a new server: the acceptance's "caches built by make warm carried in"
#   cold  nothing built ahead (the 113 s reference: fa3 JIT and compile at startup)
#   decode  bench.decode_startup: the vae_decode stage's load steps one by one, cuDNN benchmark vs heuristics vs
#         eager, each in a fresh process on the caches the cases before it left (~3 min)
# After each server: the FlashInfer modules it JIT-built (none when the carried ones loaded) and its attention.
# out/fi_aot (8.2 MB: fa3 bf16 and E4M3), here, without a GPU: make warm-kernels CONFIG=configs/bench_edge.yaml CUDA_ARCH=9.0a &&
#   cp -r ~/.cache/cosmos3/kernels/flashinfer/aot/sm90a out/fi_aot
#   device run, carry [.whl/pytriton, out/fi_aot]: FI_AOT=out/fi_aot bash bench/device_coldstart.sh aot warm
#   across machines: `bash bench/device_env.sh && FI_AOT=out/fi_aot bash bench/device_coldstart.sh build` ([.whl/env,
#   .whl/parity, out/fi_aot]); copy $OUT's kernels.tgz.* into out/kernels_in here; give the machine back; on a fresh
#   one `bash bench/device_env.sh` ([.whl/env, .whl/parity, out/kernels_in]), then
#   `KERNELS_IN=out/kernels_in bash bench/device_coldstart.sh carried` ([.whl/pytriton]: out/kernels_in stays there)
set -uo pipefail
[ -x /tmp/v/bin/python ] || { echo "no /tmp/v: run bench/device_env.sh first on this machine"; exit 3; }
[ -d .whl/pytriton ] && ! /tmp/v/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('pytriton') is None)" && /tmp/v/bin/python -m pip install -q --no-index --no-deps .whl/pytriton/*.whl
unset FLASHINFER_WORKSPACE_BASE TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR FLASHINFER_CUDA_ARCH_LIST
export COSMOS3_CACHE=/tmp/coldstart
CONFIG=configs/bench_edge.yaml
FI=/tmp/coldstart/kernels/flashinfer
fresh() {  # an empty cache (and torch.compile's default folder), then the checkpoint's configs and $FI_AOT if given
  rm -rf /tmp/coldstart /tmp/torchinductor_root
  /tmp/v/bin/python -c "from cosmos3_core.model.provision import resolve_checkpoint; resolve_checkpoint('random:edge')"
  if [ "$1" = carry ] && [ -n "${FI_AOT:-}" ]; then
    mkdir -p $FI/aot && cp -r "$FI_AOT" $FI/aot/sm90a && echo "carried: $(ls $FI/aot/sm90a | wc -l) modules, $(du -sh $FI/aot | cut -f1)"
  fi
}
serve() {  # a new server on the cache: startup (launch → ready) and one request
  /tmp/v/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('pytriton') is None)" || { echo "no pytriton in /tmp/v: carry .whl/pytriton"; exit 3; }
  timeout 400 /tmp/v/bin/python -m bench.served --config $CONFIG --c1 1 --c4 0 --inprocess 0 --diffusers 0 \
    --json $OUT/coldstart_$1.json > $OUT/coldstart_$1.txt 2>&1
  grep -e "server startup" -e "^c1" -e Error $OUT/coldstart_$1.txt | tail -4
  echo "flashinfer modules JIT-built by it: $(ls $FI/.cache/flashinfer/*/*/cached_ops/*/*.so 2>/dev/null | wc -l)"
  # startup's parts: each model's ready / engine-built / warmup lines (the models load in parallel)
  # (each with its parts: the vae_decode's vae / sound tokenizer / decoder / compile warmup, the denoise warmup's bucket
  # captures / requests); the whole log (its timestamps: when each model's load began) comes back in $OUT
  local log; log="$(ls -td /tmp/cosmos3-bench-*/ | head -1)tritonserver.log"
  grep -h -e "attention auto" -e "flashinfer modules in" -e "ready in" -e "built in" -e "warmup of" "$log" | head -8
  cp "$log" "$OUT/tritonserver_$1.log"
}
cases=("$@"); [ ${#cases[@]} -gt 0 ] || cases=(aot warm)
for c in "${cases[@]}"; do
  echo "== $c"
  case $c in
    aot) [ -d "${FI_AOT:-}" ] || { echo "aot: set FI_AOT to the carried folder"; continue; }
         fresh carry; serve aot ;;
    warm) fresh carry
          t0=$SECONDS; /tmp/v/bin/python -m cosmos3_core.tools.warm --config $CONFIG 2>&1 | grep -v -e Warning -e float32
          echo "make warm wall $((SECONDS - t0)) s"
          du -sh /tmp/coldstart/kernels/* 2>/dev/null; serve warm ;;
    build) fresh carry  # make warm's caches for another machine: 15 MiB pieces in $OUT (no server)
           t0=$SECONDS; /tmp/v/bin/python -m cosmos3_core.tools.warm --config $CONFIG 2>&1 | grep -v -e Warning -e float32
           echo "make warm wall $((SECONDS - t0)) s"
           tar -C /tmp/coldstart -czf - kernels | split -b 15m - $OUT/kernels.tgz.; ls -l $OUT ;;
    carried) compgen -G "${KERNELS_IN:-/nonexistent}/kernels.tgz.*" > /dev/null \
               || { echo "carried: set KERNELS_IN to the folder of build's kernels.tgz.* pieces"; continue; }
             fresh none
             cat "$KERNELS_IN"/kernels.tgz.* | tar -C /tmp/coldstart -xzf - || { echo "carried: unpack failed"; continue; }
             du -sh /tmp/coldstart/kernels/*; serve carried ;;
    cold) fresh none; serve cold ;;
    decode) /tmp/v/bin/python -m bench.decode_startup --config $CONFIG --json $OUT/decode_startup.json 2>&1 \
              | grep -v -e Warning -e float32 ;;  # on the caches the cases before it left (after warm: warm ones)
    *) echo "unknown case $c"; exit 2 ;;
  esac
done
