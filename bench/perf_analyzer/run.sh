#!/usr/bin/env bash
# Triton's own load generator against the ensemble, streaming (the denoise and decode steps are decoupled), on
# the request bench.served sends (Edge t2v 832x480x121, 20 steps, guidance 6): compare its latency and
# throughput with `python -m bench.served --config configs/bench_edge.yaml` on the same server.
#   perf_analyzer ships in the NGC SDK container (nvcr.io/nvidia/tritonserver:<tag>-py3-sdk); the PyPI
#   `perf-analyzer` package is an empty placeholder. Start the server first: make serve CONFIG=configs/bench_edge.yaml
#   bash bench/perf_analyzer/run.sh [GRPC_URL]
set -euo pipefail
here=$(dirname "$0")
perf_analyzer -m cosmos3 -i grpc -u "${1:-127.0.0.1:8001}" --streaming \
  --input-data "$here/edge_t2v.json" --concurrency-range 1:4:3 \
  --measurement-mode count_windows --measurement-request-count 4 --max-trials 3 --stability-percentage 50
