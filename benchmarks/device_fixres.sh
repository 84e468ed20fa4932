#!/usr/bin/env bash
# Device check of the fix-res branch (resident experts on CUDA), one call of at most 150 s:
#   tests/test_resident_rows.py on CUDA (the Triton decode kernels, a tiny model decoding through them on CUDA,
#   captured steps against the same compiled step run eagerly, the side-stream swaps behind decode), the swap
#   policy's tests (tests/test_resident_swaps.py) and test_routed_experts' CUDA swap test. Prints pytest's summary,
#   its FAILED lines and the first assertion lines; the log is $OUT/tests.log.
#
#   bash benchmarks/device_fixres.sh        # from the repo root, ktorch built; logs under $OUT
set -uo pipefail
OUT=${OUT:-/tmp/device_fixres_out}
mkdir -p "$OUT"
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
START=$(date +%s)
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
XDIST=""
python3 -c "import xdist" 2>/dev/null && XDIST="-n 6"
timeout -k 5 140 python3 -m pytest -q -p no:cacheprovider $XDIST tests/test_resident_rows.py tests/test_resident_swaps.py \
  "tests/test_routed_experts.py::test_cuda_captured_decode_after_a_swap_matches_eager" >"$OUT/tests.log" 2>&1
RC=$?
echo "rc $RC ($(($(date +%s) - START)) s)"
grep -E "passed|failed|error" "$OUT/tests.log" | tail -2
[ "$RC" = 124 ] && { echo "timed out; the log's last lines:"; tail -c 600 "$OUT/tests.log"; echo; }
grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -20
grep -E "^E  " "$OUT/tests.log" | head -12
