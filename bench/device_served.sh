#!/usr/bin/env bash
# On the H200, right after `bench/device_env.sh` on the same (warm) machine, carrying .whl/pytriton (nvidia-pytriton 0.7.0):
# served benchmarks, each on a fresh server. Arguments pick them (default: edge nano_chained):
#   edge          Edge t2v 832x480x121, 20 steps, single-shot at c=1 (3 requests) and c=4 ($C4, default 8), then the
#                 same request in-process (2) and through diffusers (2), in the same run
#   edge_sea      the Edge request uncached and with SeaCache at diffusers' defaults (variants t2v, t2v+sea) on one
#                 bf16 server: c=1 ($C1, default 3) each, c=4 ($C4, default 8) with SeaCache, then diffusers (2 each,
#                 uncached and with its own SeaCache). ~4-5 min (startup ~70 s, diffusers ~1.5 min)
#   edge_fp8      the same on configs/bench_edge_fp8.yaml (precision fp8, compile on), diffusers included (the
#                 targets are FP8 + SeaCache against diffusers in one run); then perf_analyzer on the same server
#                 (t2v+sea at c=1 and c=4) when device_env.sh put it in /tmp/perf_analyzer. ~6-7 min
#   edge_fp8attn  edge_fp8 with fp8_attention on, without diffusers (FlashInfer fa3 FP8 over [prefix | own]): reported apart.
#                 ~4-5 min (+ minutes of FP8-module JIT unless built ahead into the AOT folder)
#   nano_chained  Nano AR chained streams, 832x480, 45 frames (2 windows), config steps (35), c=1 and c=4
#   nano_kv       the same with kv windows (context K/V kept in the pool)
#   nano_sound    Nano 832x480x121, 35 steps, guidance 6, one server (random:nano_sound: ~1 GB sound tokenizer written
#                 first, ~10 s): t2v, t2v+sound and v2v (2 latent frames kept) at c=1 ($C1, default 1 request each,
#                 after a 2-step one of each kind), then diffusers for t2v+sound and v2v (1 each, after a 2-step one);
#                 prints sound's cost over video-only. Budget: startup ~1-3 min (compile, fa3 JIT unless cached),
#                 ~30 s a served request, ~45 s a diffusers one: ~5-7 min in all, under the 560 s timeout
#   nano_action   Nano robot actions, one server (random:nano_action: random:nano plus the action heads, action_dim
#                 64, 32 domains; configs only), 35 steps, guidance 6: policy at tier 480 (the 832x480 condition
#                 image fills the 480x832 canvas: 1950 vision + 16 action tokens per branch), chunk 16, droid_lerobot,
#                 c=1 ($C1, default 3, after a 2-step one) and c=8 ($C8, default 16 requests, after an untimed burst of
#                 8 2-step ones; actions/s = 16 x requests / wall), forward dynamics c=1 ($C1), then diffusers policy
#                 ($DIFFUSERS, default 2, after a 2-step one); each kind's floor on the card it ran on printed beside.
#                 Budget (a 121-frame t2v step is ~0.70 s served at 24,180 rows; a policy step packs 3,932, ~0.1 s):
#                 startup ~70 s (+~90 s if fa3 is not JIT-cached yet), policy c=1 ~5 s each (~20 s with the 2-step),
#                 c=8 ~0.75 s per packed step x 35 x 2 waves ~60 s (+ burst ~10 s), fd ~20 s, diffusers ~10 s load +
#                 ~7 s each ~30 s: ~3.5-5 min in all, under the 560 s timeout
set -uo pipefail
[ -x /tmp/v/bin/python ] || { echo "no /tmp/v: run bench/device_env.sh first on this machine"; exit 3; }
/tmp/v/bin/python -m pip install -q --no-index --no-deps .whl/pytriton/*.whl 2>&1 | grep -v -e "already exists" -e WARNING | tail -3
export COSMOS3_CACHE=/tmp/c3cache FLASHINFER_WORKSPACE_BASE=/tmp/fiws
# FI074=1: FlashInfer 0.7.4 (the carried .whl/fi074 wheel, installed into /tmp/site074 once; fp8_attention needs it:
# on the pinned 0.6.1 the load refuses it) ahead of /tmp/site's 0.6.1 for every process of this call, the servers'
# stubs included (they ignore PYTHONPATH: the venv's .pth), with its own JIT cache (/tmp/fiws074)
if [ -n "${FI074:-}" ]; then
  [ -d /tmp/site074/flashinfer ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site074 \
    .whl/fi074/*.whl 2>&1 | grep -v -e WARNING -e "already exists" | tail -2
  [ -d /tmp/site074/flashinfer ] || { echo "FI074: carry .whl/fi074 (flashinfer-python 0.7.4)"; exit 3; }
  printf '/tmp/site074\n/tmp/site\n' > /tmp/v/lib/python3.12/site-packages/flashinfer_site.pth
  export FLASHINFER_WORKSPACE_BASE=/tmp/fiws074
else  # a call after an FI074 one on the same machine gets the pinned 0.6.1 back
  echo /tmp/site > /tmp/v/lib/python3.12/site-packages/flashinfer_site.pth
fi
/tmp/v/bin/python -c "import flashinfer; print('flashinfer', flashinfer.__version__, flashinfer.__file__)"
runs=("$@"); [ ${#runs[@]} -gt 0 ] || runs=(edge nano_chained)
for run in "${runs[@]}"; do
  case $run in
    edge) args=(--config configs/bench_edge.yaml --c1 3 --c4 ${C4:-8} --inprocess ${INPROCESS:-2} --diffusers ${DIFFUSERS:-2}) ;;
    edge_sea) args=(--config configs/bench_edge.yaml --variants t2v t2v+sea --c1 ${C1:-3} --c4 ${C4:-8} --c4-variants t2v+sea
                    --diffusers ${DIFFUSERS:-2}) ;;
    edge_fp8) args=(--config configs/bench_edge_fp8.yaml --variants t2v t2v+sea --c1 ${C1:-3} --c4 ${C4:-8} --c4-variants t2v+sea
                    --diffusers ${DIFFUSERS:-2}
                    $([ -x /tmp/perf_analyzer/bin/perf_analyzer ] && echo --perf-analyzer /tmp/perf_analyzer/bin/perf_analyzer)) ;;
    edge_fp8attn) args=(--config configs/bench_edge_fp8attn.yaml --variants t2v t2v+sea --c1 ${C1:-3} --c4 ${C4:-8} --c4-variants t2v+sea) ;;
    nano_ar_fp8) args=(--config configs/bench_nano_ar.yaml --set precision=fp8 $([ -n "${FP8ATTN:-}" ] && echo --set fp8_attention=true)
                      --c1 0 --c4 0 --ar 1 --ar-params '{"window_mode": "chained", "num_frames": 45, "cache": {"policy": "sea"}}') ;;
    nano_chained) args=(--config configs/bench_nano_ar.yaml --c1 0 --c4 0 --ar 1 --ar-params '{"window_mode": "chained", "num_frames": 45}') ;;
    nano_kv) args=(--config configs/bench_nano_ar.yaml --c1 0 --c4 0 --ar 1 --ar-params '{"window_mode": "kv", "num_frames": 45}') ;;
    nano_sound) args=(--config configs/bench_nano_sound.yaml --c1 ${C1:-1} --c4 0 --variants t2v t2v+sound v2v
                      --diffusers ${DIFFUSERS:-1} --diffusers-variants t2v+sound v2v) ;;
    nano_action) args=(--config configs/bench_nano_action.yaml --c1 ${C1:-3} --c4 0 --variants policy fd
                       --c8 ${C8:-16} --c8-variants policy --diffusers ${DIFFUSERS:-2} --diffusers-variants policy) ;;
    *) echo "unknown run $run"; exit 2 ;;
  esac
  echo "== $run: python -m bench.served ${args[*]}"
  timeout 560 /tmp/v/bin/python -m bench.served "${args[@]}" --json $OUT/served_$run.json > $OUT/served_$run.txt 2>&1
  grep -v -e Warning -e float32 $OUT/served_$run.txt | tail -${TAIL:-24}
done
