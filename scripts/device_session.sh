#!/usr/bin/env bash
# One device session as a chain of back-to-back calls on the same warm machine (a machine is given back 30 s
# after a call, so the next call must follow at once; its /tmp survives, and so does a detached llama.cpp build).
# Run from the device's repo root (the working tree copy), with carry [".whl", ".device-out"] (.device-out holds
# src.tar from scripts/make_device_snapshot.sh, and optionally prebuilt/, llama_cpp.tar, lcpp/):
#   bash scripts/device_session.sh tests    # build ktorch; the test files TEST_FILES (default: all) under xdist
#                                           # (TEST_WORKERS=4 processes of 3 threads); LCPP_JOBS=n > 0 also starts
#                                           # the llama.cpp build, detached, on the cores left (default 0: none)
#   bash scripts/device_session.sh kernels  # the per-call overhead on 16 cores (KERNELS_OVERHEAD=0 skips it), then
#                                           # issue 2's AVX-512 table with eager and grouped_mm beside it (idle)
#   bash scripts/device_session.sh vs       # ktorch vs llama.cpp, 12 layers, VS_TYPES (default Q8_0)
#   bash scripts/device_session.sh gguf     # issue 6's 48-layer Q4_K GGUF: load time, peak RSS, tok/s
#   bash scripts/device_session.sh e2e      # issue 5: deferral d = DEFERRED and hot experts, Qwen3 shape
#   bash scripts/device_session.sh step S   # any device_check.sh step S (hostab, amxwalks, ...) on the idle machine
# Every phase unpacks .device-out/src.tar into /tmp/src and runs there; the ktorch extension built in the first
# phase is kept in /tmp/prebuilt (and returned in $OUT: copy _C*.so and prebuilt.id to .device-out/prebuilt/ to
# skip the build on a later fresh machine) so later phases install it in seconds. The llama.cpp source travels
# as .device-out/llama_cpp.tar (tar czf .device-out/llama_cpp.tar -C .peers/llama_cpp .); the built binaries
# come back in $OUT as lcpp_bin.tgz.* chunks, and a fresh machine takes them from .device-out/lcpp/ (copy the
# chunks there) instead of building again. Measuring phases warn while a build is running (its cores are taken).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
T0=$(date +%s)
BUDGET=${SESSION_BUDGET_S:-575}  # the phase's own end, inside the call's 600 s
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
log() { echo "== $(date +%T) [$(( $(date +%s) - T0 )) s] $*"; }
REPO=$PWD
export LCPP_BUILD=/tmp/lcpp LCPP_SRC=/tmp/lcpp_src

restore_llamacpp() {  # binaries returned by an earlier call, when this machine is a fresh one
  # (lcpp_bin.txz.*: the same binaries stripped and xz-compressed, 42 MB instead of 47, to fit the carry's 64 MiB)
  if [ ! -x $LCPP_BUILD/bin/llama-bench ] && ls "$REPO"/.device-out/lcpp/lcpp_bin.t?z.* > /dev/null 2>&1; then
    mkdir -p $LCPP_BUILD
    if ls "$REPO"/.device-out/lcpp/lcpp_bin.txz.* > /dev/null 2>&1; then
      cat "$REPO"/.device-out/lcpp/lcpp_bin.txz.* | tar xJf - -C $LCPP_BUILD
    else
      cat "$REPO"/.device-out/lcpp/lcpp_bin.tgz.* | tar xzf - -C $LCPP_BUILD
    fi && log "llama.cpp binaries restored"
  fi
}

unpack_ktorch() {
  rm -rf /tmp/src && mkdir -p /tmp/src && tar xf "$REPO/.device-out/src.tar" -C /tmp/src && cp -r "$REPO/.whl" /tmp/src/
  cp "$REPO/ktorch/builtin/model.safetensors" /tmp/src/ktorch/builtin/  # (not in the snapshot)
  [ -d "$REPO/.peers" ] && ln -sfn "$REPO/.peers" /tmp/src/.peers  # carried peers (kt_kernel) for the benchmarks
  [ -f "$REPO/.device-out/prebuilt/prebuilt.id" ] && [ ! -f /tmp/prebuilt/prebuilt.id ] && cp -r "$REPO/.device-out/prebuilt" /tmp/
  export KT_PREBUILT_DIR=/tmp/prebuilt
  cd /tmp/src || exit 1  # every phase runs there
}

save_prebuilt() {
  if [ -f "$OUT/prebuilt.id" ]; then mkdir -p /tmp/prebuilt && cp "$OUT"/_C*.so "$OUT/prebuilt.id" /tmp/prebuilt/; fi
  rm -f "$OUT/build.log"  # (device_check.sh prints its end when a build fails)
}

start_llamacpp() {  # LCPP_JOBS > 0: the detached build (device_step_llamacpp_build.sh) on that many cores
  restore_llamacpp
  if [ "${LCPP_JOBS:-0}" -gt 0 ] && [ ! -x $LCPP_BUILD/bin/llama-bench ] && [ -f .device-out/llama_cpp.tar ]; then
    log "llama.cpp build, detached, $LCPP_JOBS jobs"
    mkdir -p $LCPP_SRC && tar xf .device-out/llama_cpp.tar -C $LCPP_SRC
    LCPP_WAIT_S=0 bash scripts/device_step_llamacpp_build.sh
  fi
}

return_llamacpp() {  # the built binaries back to this machine in $OUT (at most 8 files come back in all)
  if [ -x $LCPP_BUILD/bin/llama-bench ] && [ ! -e $LCPP_BUILD/build.running ]; then
    tar czf - -C $LCPP_BUILD bin | split -b 15M - "$OUT/lcpp_bin.tgz."
    ls -l "$OUT"/lcpp_bin.tgz.*
  fi
}

busy_warning() {
  [ -e $LCPP_BUILD/build.running ] && log "WARNING: the llama.cpp build is still running; timings are not results"
}

phase=${1:?phase: tests, kernels, vs, gguf, e2e or step}
case $phase in
  tests)
    start_llamacpp
    unpack_ktorch
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    xdist="-n ${TEST_WORKERS:-4}"
    mkdir -p /tmp/xd && echo "def test_x(): pass" > /tmp/xd/test_x.py
    (cd /tmp/xd && PYTHONPATH=/tmp/site python3 -m pytest -p no:cacheprovider -q $xdist test_x.py > /dev/null 2>&1) \
      || { xdist=""; log "no xdist: one process"; }
    OMP_NUM_THREADS=${TEST_THREADS:-3} KT_NUM_THREADS=${TEST_THREADS:-3} TESTS="${TEST_FILES:-tests}" TESTS_ARGS="$xdist" \
      TESTS_TIMEOUT=${TESTS_TIMEOUT:-$(( $(left) - 80 ))} bash scripts/device_check.sh tests
    save_prebuilt
    cd "$REPO" || exit 1
    if [ -e $LCPP_BUILD/build.running ]; then
      log "waiting for llama.cpp"
      LCPP_WAIT_S=$(( $(left) - 25 )) bash /tmp/src/scripts/device_step_llamacpp_build.sh
    fi
    return_llamacpp ;;
  kernels)
    busy_warning
    unpack_ktorch
    KERNELS_OVERHEAD=${KERNELS_OVERHEAD:-1} KERNELS_AVX_TIMEOUT=${KERNELS_AVX_TIMEOUT:-$(( $(left) - 60 ))} \
      KERNELS_KT_TIMEOUT=${KERNELS_KT_TIMEOUT:-1} STEP_TIMEOUT=$(( $(left) - 10 )) bash scripts/device_check.sh kernels
    save_prebuilt ;;
  e2e)
    busy_warning
    unpack_ktorch
    DEFERRED=${DEFERRED:-0,2} GPU_EXPERTS=${GPU_EXPERTS:-0.25} DEFER_TIMEOUT=${DEFER_TIMEOUT:-$(( $(left) - 90 ))} \
      E2E_TIMEOUT=${E2E_TIMEOUT:-1} STEP_TIMEOUT=$(( $(left) - 10 )) bash scripts/device_check.sh e2e
    save_prebuilt ;;
  vs)
    restore_llamacpp
    LCPP_WAIT_S=${LCPP_WAIT_S:-150} bash scripts/device_step_llamacpp_build.sh
    unpack_ktorch
    VS_TYPES=${VS_TYPES:-Q8_0} VS_TIMEOUT=$(( $(left) - 60 )) VS_ARGS=${VS_ARGS:---variants cuda_graphs --llama-reps 3} \
      STEP_TIMEOUT=$(( $(left) - 10 )) bash scripts/device_check.sh vs_llamacpp
    save_prebuilt ;;
  gguf)
    busy_warning
    unpack_ktorch
    GGUF_TIMEOUT=$(( $(left) - 150 )) STEP_TIMEOUT=$(( $(left) - 10 )) bash scripts/device_check.sh gguf
    save_prebuilt ;;
  step)
    busy_warning
    unpack_ktorch
    STEP_TIMEOUT=$(( $(left) - 10 )) bash scripts/device_check.sh "${2:?step: which device_check.sh step}"
    save_prebuilt ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
log "phase $phase done"
