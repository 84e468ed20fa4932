#!/usr/bin/env bash
# One device session as a chain of back-to-back calls on the same warm machine (a machine is given back 30 s
# after a call, so the next call must follow at once; its /tmp survives, and so does a detached llama.cpp build).
# Run from the device's repo root (the working tree copy), with carry [".whl", ".device-out"]:
#   bash scripts/device_session.sh tests       # 1: start the llama.cpp build (detached, LCPP_JOBS=6), build
#                                               #    ktorch, the GPU/compile tests (xdist), then wait for llama.cpp
#   bash scripts/device_session.sh vs          # 2: ktorch vs llama.cpp, 12 layers, VS_TYPES (default Q8_0)
#   bash scripts/device_session.sh gguf        # 3: issue 6's 48-layer Q4_K GGUF: load time, peak RSS, tok/s
# Every phase unpacks .device-out/src.tar (scripts/make_device_snapshot.sh) into /tmp/src and runs there; the
# ktorch extension built in phase 1 is kept in /tmp/prebuilt (and returned in $OUT) so later phases install it
# in seconds. The llama.cpp source is carried once, in phase 1, as .device-out/llama_cpp.tar (see
# scripts/device_step_llamacpp_build.sh); the built binaries are returned in $OUT as lcpp_bin.tgz.* chunks, and
# a cold machine takes them back from .device-out/lcpp/ (copy the chunks there) instead of building again.
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
  if [ ! -x $LCPP_BUILD/bin/llama-bench ] && ls "$REPO"/.device-out/lcpp/lcpp_bin.tgz.* > /dev/null 2>&1; then
    mkdir -p $LCPP_BUILD && cat "$REPO"/.device-out/lcpp/lcpp_bin.tgz.* | tar xzf - -C $LCPP_BUILD && log "llama.cpp binaries restored"
  fi
}

unpack_ktorch() {
  rm -rf /tmp/src && mkdir -p /tmp/src && tar xf "$REPO/.device-out/src.tar" -C /tmp/src && cp -r "$REPO/.whl" /tmp/src/
  [ -f "$REPO/.device-out/prebuilt/prebuilt.id" ] && [ ! -f /tmp/prebuilt/prebuilt.id ] && cp -r "$REPO/.device-out/prebuilt" /tmp/
  export KT_PREBUILT_DIR=/tmp/prebuilt
}

save_prebuilt() {
  if [ -f "$OUT/prebuilt.id" ]; then mkdir -p /tmp/prebuilt && cp "$OUT"/_C*.so "$OUT/prebuilt.id" /tmp/prebuilt/; fi
  rm -f "$OUT/build.log"  # (device_check.sh prints its end when a build fails)
}

phase=${1:?phase: tests, vs or gguf}
case $phase in
  tests)
    log "llama.cpp build, detached"
    restore_llamacpp
    if [ ! -x $LCPP_BUILD/bin/llama-bench ] && [ -f .device-out/llama_cpp.tar ]; then
      mkdir -p $LCPP_SRC && tar xf .device-out/llama_cpp.tar -C $LCPP_SRC
      LCPP_JOBS=${LCPP_JOBS:-6} LCPP_WAIT_S=0 bash scripts/device_step_llamacpp_build.sh
    fi
    unpack_ktorch
    cd /tmp/src || exit 1
    gpu="tests/test_compile_backend.py tests/test_compile_deferral.py tests/test_gpu_experts.py tests/test_host_tasks.py
         tests/test_integrations_transformers.py tests/test_streamed_experts.py tests/test_cli.py"
    # three xdist workers of 3 threads each (the llama.cpp build has 6 cores); without xdist (or with a pytest it
    # does not work with) one process
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    xdist="-n ${TEST_WORKERS:-3}"
    mkdir -p /tmp/xd && echo "def test_x(): pass" > /tmp/xd/test_x.py
    (cd /tmp/xd && PYTHONPATH=/tmp/site python3 -m pytest -p no:cacheprovider -q $xdist test_x.py > /dev/null 2>&1) \
      || { xdist=""; log "no xdist"; }
    OMP_NUM_THREADS=3 KT_NUM_THREADS=3 TESTS="$gpu" TESTS_ARGS="$xdist" TESTS_TIMEOUT=${TESTS_TIMEOUT:-380} \
      bash scripts/device_check.sh tests
    save_prebuilt
    cd "$REPO" || exit 1
    log "waiting for llama.cpp"
    LCPP_WAIT_S=$(( $(left) - 25 )) bash /tmp/src/scripts/device_step_llamacpp_build.sh
    if [ -x $LCPP_BUILD/bin/llama-bench ]; then
      du -sh $LCPP_BUILD/bin
      tar czf - -C $LCPP_BUILD bin | split -b 15M - "$OUT/lcpp_bin.tgz."
      ls -l "$OUT"/lcpp_bin.tgz.*
    fi ;;
  vs)
    restore_llamacpp
    LCPP_WAIT_S=${LCPP_WAIT_S:-150} bash scripts/device_step_llamacpp_build.sh
    unpack_ktorch
    cd /tmp/src || exit 1
    VS_TYPES=${VS_TYPES:-Q8_0} VS_TIMEOUT=$(( $(left) - 60 )) VS_ARGS=${VS_ARGS:---variants cuda_graphs --llama-reps 3} \
      STEP_TIMEOUT=$(( $(left) - 10 )) bash scripts/device_check.sh vs_llamacpp
    save_prebuilt ;;
  gguf)
    # a detached llama.cpp build still running takes 6 cores: load times and tokens/s would not be results
    [ -e $LCPP_BUILD/build.running ] && log "WARNING: the llama.cpp build is still running; timings are not results"
    unpack_ktorch
    cd /tmp/src || exit 1
    GGUF_TIMEOUT=$(( $(left) - 150 )) STEP_TIMEOUT=$(( $(left) - 10 )) bash scripts/device_check.sh gguf
    save_prebuilt ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
log "phase $phase done"
