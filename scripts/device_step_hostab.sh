# Decode overheads A/B (issues 4, 5, 7): Qwen3-30B-A3B shape cut to ${HOSTAB_LAYERS:-12} layers (the per-layer costs
# are the same, the compiles 4x shorter), CUDA graphs, int8 experts: host functions python / native x the launching
# thread's CUDA wait block (ktorch's default) / keep (CUDA's spin). Each row reports decode tok/s, the experts'
# own time per step without a profiler (cpu_experts_ms_per_step) and the same ops run back to back outside the
# model (standalone_experts_ms_per_step): their gap is what running inside the step costs the op.
# HOSTAB_START="hostfn doorbell" also compares how native calls start (KT_HOST_START; python ignores it);
# HOSTAB_THREADS="15 14 13" the experts pool size (KT_NUM_THREADS, caller included; "auto" = prepare's choice,
# one fewer than torch's): whether the launching thread, CUDA's callback thread and the pool fight for the cores;
# HOSTAB_TOKENS decode steps per row (default 64); HOSTAB_POOL_SWEEP="15:2000,14:2000,13:2000,15:300" re-times each
# row's decode on the same compile per pool size:KT_SPIN_US[:KT_SPIN_YIELD] (bench_e2e --pool-sweep; the host-task
# worker keeps the spin and yield it started with: set KT_HOST_SPIN_US / KT_SPIN_YIELD for the whole call), with the CPU calls' durations
# and the gaps between them (a thread left waiting by the scheduler shows as a ~2 ms call or gap: session 8 traces).
cd benchmarks
for hf in ${HOSTAB_HF:-native python}; do
  for sync in ${HOSTAB_SYNC:-block keep}; do
    for start in ${HOSTAB_START:-hostfn}; do
      for threads in ${HOSTAB_THREADS:-auto}; do
        [ "$hf" = python ] && [ "$start" != hostfn ] && continue
        echo "== KT_HOST_FUNCTIONS=$hf KT_CUDA_SYNC=$sync KT_HOST_START=$start KT_NUM_THREADS=$threads"
        ( [ "$threads" = auto ] || export KT_NUM_THREADS=$threads
          KT_HOST_FUNCTIONS=$hf KT_CUDA_SYNC=$sync KT_HOST_START=$start timeout ${HOSTAB_TIMEOUT:-140} python3 bench_e2e.py \
            --shape ${HOSTAB_SHAPE:-qwen3-30b-a3b} --layers ${HOSTAB_LAYERS:-12} --variants cuda_graphs --prompts 64 \
            --decode-context 64 --decode-tokens ${HOSTAB_TOKENS:-64} --repeats 1 --op-check ${HOSTAB_POOL_SWEEP:+--pool-sweep $HOSTAB_POOL_SWEEP} --json "$OUT/hostab.jsonl" 2>&1 \
            | grep -E "^\|" )
      done
    done
  done
done
