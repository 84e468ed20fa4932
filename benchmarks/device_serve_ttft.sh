#!/usr/bin/env bash
# Device check of `ktorch serve`'s time outside the model step (issue 33: a second request sharing a 2000-token
# prefix sees its first token in <= 15% of the first request's time), from the repo root, limit 300 s of wall clock:
# benchmarks/device_serve.sh's stages "ttft", "timeline" and "tests" on the 48-layer Q8_0 file (written first when
# absent, ~95 s), experts in host memory, the defaults (CUDA-graph steps, 16-token pages, no --step-stats):
#   ttft      bench_serve.py: 5 TTFT pairs (2000 + 8 new tokens) and their medians: the ratio; one-stream decode
#   timeline  bench_serve_timeline.py: the second request's TTFT by phase (median of 5) and the time outside the
#             step (TTFT - compute - device wait), then a decode step's host phases beside the step
#   tests     tests/test_serve_cuda.py (graphed = eager tokens, replays, step statistics' distinct experts)
#   ttft12    ttft with one pool thread fewer (KT_NUM_THREADS=12), when time is left: do the HTTP loop and the
#             client wait for a core beside the spinning workers?
#
#   bash benchmarks/device_serve_ttft.sh [FILE]    # FILE: /tmp/q8.gguf
# Prints the summary of device_serve.sh; logs under $OUT (server stderr, the load generators' output, /v1/stats).
LIMIT=${LIMIT:-300} OUT=${OUT:-/tmp/device_serve_ttft_out} exec bash "$(dirname "$0")/device_serve.sh" \
  "${1:-/tmp/q8.gguf}" "ttft timeline tests ttft12"
