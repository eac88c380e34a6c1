#!/usr/bin/env bash
# Triton's own load generator against the ensemble, streaming (the denoise and decode steps are decoupled), on
# the request bench.served sends (edge_t2v.json: Edge t2v 832x480x121, 20 steps, guidance 6), at concurrency 1
# and 4. perf_analyzer: `bash bench/perf_analyzer/fetch.sh` (tritonclient 2.41.0's binary + two libraries, into
# .whl/perf_analyzer), or the NGC SDK container's (PA=perf_analyzer). Start the server first:
#   make serve CONFIG=configs/bench_edge.yaml &   then   bash bench/perf_analyzer/run.sh [GRPC_URL]
# `python -m bench.served ... --perf-analyzer .whl/perf_analyzer/bin/perf_analyzer` runs it on bench.served's own
# server and request right after its c=1 / c=4 runs and prints both side by side.
set -euo pipefail
here=$(dirname "$0")
pa=${PA:-$here/../../.whl/perf_analyzer/bin/perf_analyzer}
[ "$pa" = perf_analyzer ] || export LD_LIBRARY_PATH=$(dirname "$(dirname "$pa")")/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
"$pa" -m cosmos3 -i grpc -u "${1:-127.0.0.1:8001}" --streaming \
  --input-data "$here/edge_t2v.json" --concurrency-range 1:4:3 \
  --measurement-mode count_windows --measurement-request-count 4 --max-trials 3 --stability-percentage 50
