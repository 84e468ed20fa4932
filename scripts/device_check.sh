#!/usr/bin/env bash
# One device call: build ktorch from source, run the test suite (every kernel level the CPU offers),
# then the benchmarks. Logs go to $OUT (the device tool brings them back). Usage from the repo root:
#   bash scripts/device_check.sh [tests|ptests] [amxtests] [forcedtests] [bench] [STEP] ...   (default: tests bench;
#   STEP runs scripts/device_step_STEP.sh; TESTS="paths" narrows the tests step). Run it from a snapshot of HEAD: scripts/make_device_snapshot.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
steps=${*:-tests bench}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
log() { echo "== $(date +%T) $*"; }
# pytest under `timeout` dies alone: its xdist workers (execnet children) go on running tests, and a measurement
# after them reads a loaded machine (seen: Qwen3 decode at half speed). Every test step ends with this sweep.
sweep() { pkill -9 -f "exec\(eval\(sys.stdin" 2> /dev/null; sleep 1; }  # (no command line of ours holds it)
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
log "machine"
{ lscpu | grep -E "Model name|^CPU\(s\)|Thread|NUMA node\(s\)|L3|Flags" | cut -c1-300; nvidia-smi -L; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; } 2>&1 | tee "$OUT/machine.txt"
# editable install: builds the extension in place and registers the torch.compile backend entry point. A build
# costs a minute of device time per call (a machine is given back 30 s after each call), so each fresh build leaves
# its extension (stripped) and an id of its sources + torch + python in $OUT; copied back into
# .device-out/prebuilt/ (git-ignored) and carried, a later call with the same id installs it without compiling:
#   mkdir -p .device-out/prebuilt && cp /work/.device/N/_C*.so /work/.device/N/prebuilt.id .device-out/prebuilt/
#   carry [..., ".device-out/prebuilt"], and in the command: cp -r .device-out/prebuilt /tmp/src/.device-out/
src_id=$({ cat setup.py pyproject.toml; find ktorch/csrc -type f -not -path '*/test/*' | LC_ALL=C sort | xargs cat; } | sha256sum | cut -c1-16)
src_id="$src_id-$(python3 -c 'import sys, torch; print(torch.__version__, *sys.version_info[:2], sep="-")')"
pre=${KT_PREBUILT_DIR:-.device-out/prebuilt}
prebuilt=""
if [ -f "$pre/prebuilt.id" ] && [ "$(cat "$pre/prebuilt.id")" = "$src_id" ] && ls "$pre"/_C*.so > /dev/null 2>&1; then
  prebuilt=$(ls "$pre"/_C*.so | head -1)
fi
log "build (${prebuilt:+prebuilt extension, }$src_id)"
KT_PREBUILT_EXTENSION=$prebuilt python3 -m pip install -v --no-deps --no-build-isolation --no-index -e . > "$OUT/build.log" 2>&1 \
  || { tail -50 "$OUT/build.log"; exit 1; }
if [ -z "$prebuilt" ]; then
  so=$(ls ktorch/_C*.so | head -1)
  strip --strip-debug -o "$OUT/$(basename "$so")" "$so" && echo "$src_id" > "$OUT/prebuilt.id"
fi
python3 -c "import ktorch; print(ktorch.cpu_features())" 2>&1 | tee -a "$OUT/machine.txt"
# what else runs (a measurement on a busy machine is not a result): the top CPU users, over 5% of a core
ps -eo pcpu=,comm=,args= --sort=-pcpu | awk '$1 > 5' | head -5 | cut -c1-160 | sed 's/^/busy: /'
for s in $steps; do
  case $s in
    tests)
      log "tests"
      KT_FAILURES_LOG="$OUT/failures.log" timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider --timeout=240 --durations=15 --tb=short -rfE ${TESTS_ARGS:-} ${TESTS:-tests} \
        > "$OUT/tests.log" 2>&1; sweep; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | tail -40 ;;
    ptests)
      # the whole suite as two concurrent halves (the GPU/compile files, and the rest with half the cores each)
      log "tests, two halves at once"
      gpu="tests/test_compile_backend.py tests/test_compile_deferral.py tests/test_gpu_experts.py tests/test_host_tasks.py
           tests/test_integrations_transformers.py tests/test_streamed_experts.py tests/test_cli.py"
      cpu=$(ls tests/test_*.py | grep -vxF "$(echo $gpu | tr ' ' '\n')")
      half=$(( $(nproc) / 2 ))
      for part in gpu cpu; do
        KT_FAILURES_LOG="$OUT/failures_$part.log" OMP_NUM_THREADS=$half KT_NUM_THREADS=$(( half - 1 )) timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q \
          -p no:cacheprovider --timeout=240 --durations=10 --tb=short -rfE ${!part} > "$OUT/tests_$part.log" 2>&1 &
      done
      wait; sweep
      for part in gpu cpu; do echo "[$part]"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests_$part.log" | tail -25; done ;;
    forcedtests)
      # issue 3: the whole suite with the AMX kernels and a 2-way NUMA split forced (FORCED_TESTS: a part of it;
      # FORCED_ARGS: e.g. "-n 4" for xdist)
      log "full suite, AMX and NUMA split forced: ${FORCED_TESTS:-tests}"
      KT_CPU_KERNEL=amx KT_NUMA_SPLIT=2 timeout ${FORCED_TIMEOUT:-480} python3 -m pytest -q -p no:cacheprovider --timeout=240 \
        --tb=short -rfE ${FORCED_ARGS:-} ${FORCED_TESTS:-tests} > "$OUT/forcedtests.log" 2>&1; sweep
      grep -E "passed|failed|^FAILED|^ERROR" "$OUT/forcedtests.log" | tail -30 ;;
    amxtests)
      # the op suite with the AMX kernels forced (KT_CPU_KERNEL=amx: an error where AMX is absent)
      log "op tests, AMX forced"
      KT_CPU_KERNEL=amx timeout ${AMXTESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider --timeout=200 --tb=short -rfE \
        tests/test_ops_fused_moe.py tests/test_ops_pack.py > "$OUT/amxtests.log" 2>&1; sweep; tail -15 "$OUT/amxtests.log" ;;
    bench)
      log "bench_fused_moe"
      python3 benchmarks/bench_fused_moe.py --min-seconds 1 > "$OUT/bench_fused_moe.log" 2>&1; grep -E "^\||machine|L3|skip|fail" "$OUT/bench_fused_moe.log" ;;
    *)
      log "step $s"
      timeout ${STEP_TIMEOUT:-600} bash "scripts/device_step_$s.sh" > "$OUT/$s.log" 2>&1; tail -40 "$OUT/$s.log" ;;
  esac
done
log "done"
