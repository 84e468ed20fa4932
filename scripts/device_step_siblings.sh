# Issue 3, T=2048: do the vCPUs share tile units? (session 18: one thread alone 4.1 TOPS, each of 8 or 16 at once
# ~1.5.) amx/test --bench-siblings times every pair of CPUs at once (tiles + tiles, then tiles beside VNNI); CPUs
# whose pair reaches ~1x of one thread share a unit. Then the Qwen3 layer (int8, bf16; T=512, 2048) on all CPUs,
# on one CPU of each unit found (when some share), and on all CPUs again (the run's spread). Log: $OUT/siblings.log.
#   SIBLING_ROUNDS=3  SIBLING_TOKENS="512 2048"  SIBLING_IMPLS="ktorch-int8 ktorch-bf16"
echo "== $(date +%T) topology"
lscpu -e=CPU,CORE,SOCKET,NODE,MAXMHZ 2>&1 | head -20
echo "== $(date +%T) siblings"
KT_BENCH_ROUNDS=${SIBLING_ROUNDS:-3} timeout 200 bash ktorch/csrc/kernels/amx/test/run.sh native --bench-siblings 2>&1 \
    | grep -v -i -e warning -e "^ *|" -e "^In " -e "inlined from" -e "^/usr" -e "^ *[0-9]* |" | tee /tmp/siblings.txt
# One CPU of each tile unit: greedy over the first matrix, a pair below 1.4x one thread sharing a unit.
one_per_unit=$(python3 - <<'EOF'
rows = {}
for line in open("/tmp/siblings.txt"):
    if line.startswith("tiles on CPU"):
        break
    f = line.split()
    if len(f) > 3 and f[0].isdigit():
        rows[int(f[0])] = [None if v == "-" else float(v) for v in f[1:-1]]
taken, keep = set(), []
for i in sorted(rows):
    if i in taken:
        continue
    keep.append(i)
    taken.update(j for j, r in enumerate(rows[i]) if r is not None and r < 1.4)
print(",".join(map(str, keep)) if len(keep) < len(rows) else "")
EOF
)
layer() {  # $1: label; the rest: the command's prefix (taskset ...)
  local label=$1; shift
  echo "== $(date +%T) the layer: $label"
  KT_CPU_KERNEL=amx timeout ${SIBLING_LAYER_TIMEOUT:-200} "$@" python3 benchmarks/bench_fused_moe.py --shapes qwen3 \
      --tokens ${SIBLING_TOKENS:-512 2048} --impls ${SIBLING_IMPLS:-ktorch-int8 ktorch-bf16} --min-calls 5 \
      --min-seconds 0.3 --profile 2>&1 | grep -E "^machine|^L3|^qwen3 |phases|Error|error" | cut -c1-520
}
n=$(nproc)
layer "all $n CPUs, $n threads" env
if [ -n "$one_per_unit" ]; then
  k=$(echo "$one_per_unit" | tr ',' '\n' | wc -l)
  layer "one CPU per tile unit ($one_per_unit), $k threads" taskset -c "$one_per_unit" env KT_NUM_THREADS=$k OMP_NUM_THREADS=$k
  layer "the same CPUs, pinned" taskset -c "$one_per_unit" env KT_NUM_THREADS=$k OMP_NUM_THREADS=$k KT_PIN_THREADS=1
  layer "all $n CPUs again" env
else
  echo "== no two CPUs share a tile unit"
fi
echo "== $(date +%T) siblings done"
