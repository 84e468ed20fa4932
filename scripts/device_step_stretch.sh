# Issue 3, T=2048: what one stretch of the tile unit allows (amx/test --bench-stretch: the bare L1 tile loop, the
# loop with AVX-512 VNNI products beside it, the kernel's walk at M = 128 on hot and on cold weights, taking turns
# every ~40 ms on 1, 8 and 16 threads), the vCPU topology, then the Qwen3 layer at T=512/2048 (int8, bf16) with
# phase medians. Logs: $OUT/stretch.log (this step's output). About 3 minutes after device_check's build.
#   STRETCH_THREADS=1,8,16  STRETCH_ROUNDS=12  STRETCH_VNNI=32 (VPDPBUSDs per step of 4 tile products)
echo "== $(date +%T) topology"
lscpu -e=CPU,CORE,SOCKET,NODE,MAXMHZ 2>&1 | head -20
echo "siblings of cpu0: $(cat /sys/devices/system/cpu/cpu0/topology/thread_siblings_list 2>&1)"
echo "== $(date +%T) stretch"
KT_BENCH_THREADS=${STRETCH_THREADS:-1,8,16} KT_BENCH_ROUNDS=${STRETCH_ROUNDS:-12} KT_BENCH_VNNI=${STRETCH_VNNI:-32} \
    timeout 150 bash ktorch/csrc/kernels/amx/test/run.sh native --bench-stretch 2>&1 | grep -v -i -e warning -e "^ *|" \
    -e "^In " -e "inlined from" -e "^/usr" -e "^ *[0-9]* |"
echo "== $(date +%T) the layer"
KT_CPU_KERNEL=amx timeout ${STRETCH_LAYER_TIMEOUT:-240} python3 benchmarks/bench_fused_moe.py --shapes qwen3 \
    --tokens ${STRETCH_TOKENS:-512 2048} --impls ${STRETCH_IMPLS:-ktorch-int8 ktorch-bf16} --min-calls 5 --min-seconds 0.3 \
    --profile 2>&1 | grep -E "^machine|^L3|^qwen3 |phases|Error|error" | cut -c1-500
echo "== $(date +%T) stretch done"
