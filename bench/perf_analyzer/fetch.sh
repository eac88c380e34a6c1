#!/usr/bin/env bash
# Triton's perf_analyzer without the NGC SDK container: the binary that tritonclient 2.41.0's manylinux wheel
# carries (its last wheel to ship it; the PyPI `perf-analyzer` package is an empty placeholder), plus the two
# shared libraries it links that a plain Linux box lacks: libb64.so.0d (Debian's / Ubuntu's libb64-0d) and libcudart.so.12
# (nvidia-cuda-runtime-cu12; loaded for its CUDA shared-memory option, which we do not use). Into DIR (default
# .whl/perf_analyzer, 18 MB): DIR/bin/perf_analyzer, DIR/lib/. Run it as LD_LIBRARY_PATH=DIR/lib DIR/bin/perf_analyzer.
# perf_analyzer 2.41 (23.12) speaks the same gRPC protocol as the wheel's tritonserver 2.51 (`--streaming` included).
set -euo pipefail
dir=${1:-.whl/perf_analyzer}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir -p "$dir/bin" "$dir/lib"
pip download -q --no-deps -d "$tmp" --only-binary=:all: --platform manylinux1_x86_64 --platform manylinux2014_x86_64 \
  tritonclient==2.41.0 nvidia-cuda-runtime-cu12==12.9.79
(cd "$tmp" && apt-get download -q libb64-0d)  # Debian / Ubuntu: the library perf_analyzer links
python3 -m zipfile -e "$tmp"/tritonclient-2.41.0-*.whl "$tmp/tc"
python3 -m zipfile -e "$tmp"/nvidia_cuda_runtime_cu12-*.whl "$tmp/cu"
dpkg-deb -x "$tmp"/libb64-0d_*.deb "$tmp/b64"
install -m 755 "$tmp"/tc/tritonclient-2.41.0.data/data/bin/perf_analyzer "$dir/bin/"
cp "$tmp"/cu/nvidia/cuda_runtime/lib/libcudart.so.12 "$tmp"/b64/usr/lib/x86_64-linux-gnu/libb64.so.0d* "$dir/lib/"
LD_LIBRARY_PATH="$dir/lib" "$dir/bin/perf_analyzer" --version 2>&1 | head -1 || true
du -sh "$dir"
