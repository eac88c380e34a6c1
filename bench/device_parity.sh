#!/usr/bin/env bash
# On the H200 (device tool): the real-shape parity harness (bench/parity.py) for each preset given (edge, nano).
# Carry .whl/parity: diffusers 0.42.1, flashinfer-python 0.6.1, apache-tvm-ffi, nvidia-cudnn-frontend (the rest is in
# the image). Checkpoints are written under /tmp/c3parity (Nano: 30 GB of bf16; a preset's checkpoint is removed
# before the next preset's is written, the disk is 64 GiB). FlashInfer JIT-compiles fa3 on first use (~90 s).
#   device run, carry [.whl/parity]: bash bench/device_parity.sh edge [--cases 't2v-*' ...]
# v2v and sound cases (nano; `--cases` globs, e.g. '*+sound-9f-4s-flow' 'v2v-*-9f-4s-flow') add the sound tokenizer
# (~1 GB) and the transformer's sound heads to the same checkpoint in place, on first use (~10-20 s).
# Robot-action cases (nano; e.g. --cases 'policy-480-*' 'fd-480-*' 'id-256-*': 6 cases, chunks 8 and 16, 4 steps) add
# the transformer's action heads (action_dim 64, 32 domains, ~34 MB) in place, on first use (~1 s); they are judged on
# the vision latents and the actions. ~4-5 min on a fresh machine (checkpoint ~50 s, fp32 diffusers ~80 s with its
# full-canvas clip encodes, bf16 ~20 s, SDPA ~15 s, FlashInfer ~90 s with fa3's first JIT); all 12 cases ~6-7 min.
# SeaCache: --cache '{"policy": "sea"}' (ours and diffusers' bf16 cached, the fp32 reference not; + skipped fractions).
# Noise seeds: --seeds N runs every case N times per run (N× the case time; the checkpoint is written once), e.g.
#   bash bench/device_parity.sh nano --cases 'policy-480-*' 'id-256-*' --seeds 4   (4 cases × 4 seeds: ~6-8 min fresh)
# diffusers' own FP8: --precision fp8 --fp8-reference diffusers (edge; carry .whl/fp8 too, unless the image has
# nvidia-modelopt 0.47 and its imports): tools/make_fp8 writes /tmp/c3parity/parity-edge-s0-fp8 from the bf16
# checkpoint once (calibration: diffusers fp32 on the GPU; ModelOpt's state built in fp32 on the CPU; ~2-3 min for
# Edge, ~4 GB on disk), then diffusers (ModelOpt) and ours run it. With the official policy (3 + 3 steps W8A16) a
# 4-step case never runs W8A8: pick 8-step cases, or --fp8-policy '{"first_steps": 1, "last_steps": 1}'.
# Nano's FP8 write needs ~60 GB of CPU memory and ~16 GB more disk.
set -uo pipefail
preset=$1; shift
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/parity/*.whl 2>&1 | grep -v -e WARNING -e "already exists" | tail -2
if [[ " $* " == *" --fp8-reference diffusers "* ]] && ! python3 -c "import modelopt.torch.quantization" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/fp8/*.whl 2>&1 | grep -v -e WARNING -e "already exists" | tail -2
fi
# FlashInfer's modules built ahead without a GPU (tools/warm.py --kernels-only), when carried as out/fi_aot: loaded
# from FlashInfer's workspace (caches.flashinfer_aot_dir) instead of ~90 s of JIT per module on a fresh machine
[ -d out/fi_aot ] && mkdir -p /tmp/fiws/aot/sm90a && cp -r out/fi_aot/. /tmp/fiws/aot/sm90a/
export PYTHONPATH=/tmp/site:$PWD COSMOS3_CACHE=/tmp/c3parity FLASHINFER_WORKSPACE_BASE=/tmp/fiws PYTHONUNBUFFERED=1
python3 -c "import torch, diffusers, transformers; print(torch.__version__, diffusers.__version__, transformers.__version__, torch.cuda.get_device_name())"
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
[[ " $* " == *" --fp8-reference diffusers "* ]] && python3 -c "import modelopt; print('modelopt', modelopt.__version__)" 2>&1 | tail -1
for old in /tmp/c3parity/parity-*; do [[ -e $old && $old != */parity-$preset-* ]] && rm -rf "$old"; done
df -h /tmp | tail -1
python3 -m bench.parity --preset "$preset" --json "$OUT/parity_$preset.json" "$@" 2>&1 \
  | grep -v -e Warning -e "should be kept in float32" -e deprecate -e "Loading pipeline" | tee "$OUT/parity_$preset.txt"
