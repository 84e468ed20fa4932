#!/usr/bin/env bash
# Builds llama.cpp's llama-bench with CUDA on the device, for benchmarks/bench_vs_llamacpp.py (issue 7).
#
#   bash scripts/device_step_llamacpp_build.sh      # from the repo root; carry .peers/llama_cpp
#
# Source: .peers/llama_cpp (git-ignored, never committed), fetched here with
#   bash /work/shared/tools/fetch_llama_cpp.sh .peers/llama_cpp
# Build folder: $LCPP_BUILD (default /tmp/lcpp), outside the repo copy, so that it survives between calls while the
# machine stays warm; the binary is $LCPP_BUILD/bin/llama-bench. When it already exists the script only prints it.
#
# The build (configure + ninja, only the llama-bench target, $LCPP_JOBS=16 jobs) takes about 5 minutes there and
# one device call is capped at 10, so it runs detached (setsid) with its log in $LCPP_BUILD/build.log, and this
# script waits for it at most $LCPP_WAIT_S seconds (default 520). Exit status: 0 when the binary is there,
# 75 when the build is still running (call again: it waits on the same build), 1 when the build failed.
# If the detached build did not survive the end of a call, calling again restarts ninja, which resumes where it
# stopped (a command cut off midway has no entry in .ninja_log, so its output is rebuilt).
set -uo pipefail
SRC=${LCPP_SRC:-$PWD/.peers/llama_cpp}
B=${LCPP_BUILD:-/tmp/lcpp}
JOBS=${LCPP_JOBS:-16}
WAIT_S=${LCPP_WAIT_S:-520}
BIN=$B/bin/llama-bench
t0=$(date +%s)

report() {
  echo "llama-bench: $BIN"
  "$BIN" --version 2>&1 | grep -E "^version|built with" | head -3
}

if [ -x "$BIN" ] && [ ! -e "$B/build.running" ]; then
  echo "already built (delete $B to rebuild)"
  report
  exit 0
fi
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  echo "no llama.cpp source at $SRC: carry .peers/llama_cpp (fetch it with /work/shared/tools/fetch_llama_cpp.sh)" >&2
  exit 1
fi
mkdir -p "$B"

# CUDA: nvcc from PATH or the usual install folder; the GPU's compute capability (9.0 on H100/H200 -> 90).
NVCC=$(command -v nvcc || true)
[ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
if [ -z "$NVCC" ]; then
  echo "nvcc not found (PATH, /usr/local/cuda/bin); set PATH or LCPP_CUDA=OFF for a CPU-only build" >&2
  [ "${LCPP_CUDA:-ON}" = ON ] && exit 1
fi
ARCH=${LCPP_CUDA_ARCH:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '. ')}
ARCH=${ARCH:-90}

progress() {  # ninja's last [done/total] since the latest start
  awk '/^== build started/ {p = "starting"} /^\[[0-9]+\/[0-9]+\]/ {p = $1} END {print p}' "$B/build.log"
}

pid_alive() {  # the detached build still runs (a zombie left by a killed call does not count)
  local pid state
  pid=$(cat "$B/build.pid" 2>/dev/null) || return 1
  state=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f1) || return 1
  [ -n "$state" ] && [ "${state:0:1}" != Z ]
}

if [ -f "$B/build.rc" ]; then
  echo "a detached build has ended since the last call"
elif pid_alive; then
  echo "a build is already running (pid $(cat "$B/build.pid")): waiting for it"
else
  touch "$B/build.running"
  [ -f "$B/build.started" ] || date +%s > "$B/build.started"
  # The header of /work/shared/tools/fetch_llama_cpp.sh (and issue 7) give this configuration.
  configure=(cmake -S "$SRC" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
             -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF)
  if [ "${LCPP_CUDA:-ON}" = ON ]; then
    configure+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DCMAKE_CUDA_COMPILER="$NVCC")
  else
    configure+=(-DGGML_CUDA=OFF)
  fi
  echo "configure: ${configure[*]}"
  echo "build: cmake --build $B -j$JOBS --target llama-bench (log: $B/build.log)"
  # configure only once (build.ninja present): re-running cmake would be harmless but costs time
  rm -f "$B/build.pid"
  echo "== build started $(date -u +%FT%TZ)" >> "$B/build.log"
  # setsid: its own session, so that it may outlive this call; it writes its own pid (setsid may fork)
  setsid nohup bash -c "
    echo \$\$ > '$B/build.pid'
    { [ -f '$B/build.ninja' ] || $(printf '%q ' "${configure[@]}"); } &&
    cmake --build '$B' -j$JOBS --target llama-bench
    echo \$? > '$B/build.rc'" >> "$B/build.log" 2>&1 < /dev/null &
  for _ in $(seq 50); do [ -s "$B/build.pid" ] && break; sleep 0.1; done
fi

# Wait: print the ninja progress every 30 s until the build ends or the wait budget is spent.
last=0
while :; do
  if [ -f "$B/build.rc" ]; then
    rc=$(cat "$B/build.rc")
    rm -f "$B/build.rc" "$B/build.running" "$B/build.pid"  # consumed: the next call starts afresh
    if [ "$rc" = 0 ] && [ -x "$BIN" ]; then
      echo "built in $(( $(date +%s) - $(cat "$B/build.started") )) s since the first start" \
           "($(( $(date +%s) - t0 )) s in this call)"
      rm -f "$B/build.started"
      report
      exit 0
    fi
    echo "build failed (rc $rc); the end of $B/build.log:" >&2
    tail -40 "$B/build.log" >&2
    exit 1
  fi
  if ! pid_alive; then  # killed with an earlier call's processes and not restarted: restart ninja
    echo "the build process is gone without a result: run this script again to resume"
    rm -f "$B/build.pid"
    exit 75
  fi
  now=$(date +%s)
  if (( now - t0 >= WAIT_S )); then
    echo "still building after $(( now - t0 )) s in this call: $(progress)"
    echo "call this script again to keep waiting (it resumes the same build)"
    exit 75
  fi
  if (( now - last >= 30 )); then
    echo "$(( now - t0 )) s: $(progress)"
    last=$now
  fi
  sleep 5
done
