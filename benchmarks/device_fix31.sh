#!/usr/bin/env bash
# Device check of branch fix31: the tests exp31 failed on the device (H200, torch 2.11, pytest -n 12 --timeout 60),
# run again after the fixes, in one call of at most 150 s (pytest limited to 130 s):
#   A. cudagraph trees refused the graphs ("Detected 2 tensor(s) in the cudagraph pool not tracked as outputs"): the
#      GPU handoff's per-task sequence word was allocated inside the recording. Now views of blocks made eagerly on
#      another thread (experts_runtime._HandoffSeqs). Tests: the 7 failing reduce-overhead tests, and the new CUDA test
#      (cudagraph trees with slow_path_cudagraph_asserts over a runtime whose first CUDA call is the warm-up) and CPU
#      test (tasks allocate no device memory).
#   B. "64 MoE calls recorded in one run, 2 in the other" (all-resident model, compiled vs eager): a test defect; the
#      recorder now leaves out what a compiled run cannot record, tokens and logits compared in full. The 2 CUDA
#      tests and the new CPU test.
#   C. the timeouts (compiles; CPU ones under oversubscription): the 8 listed tests, with their durations.
#   D. the float64 gradcheck timeouts (MKL forked 16 threads for every tiny float64 product; now one expert a worker
#      under kMinThreadedMacs): the gradcheck tests, and a timing of one tiny backward call at 1 and 16 threads.
# Prints pytest's FAILED/ERROR lines, the summary and the 30 slowest durations; logs under $OUT.
#
#   bash benchmarks/device_fix31.sh        # from the repo root, ktorch built (editable); logs under $OUT
set -uo pipefail
OUT=${OUT:-/tmp/device_fix31_out}
mkdir -p "$OUT"
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
START=$(date +%s)
lscpu | grep -E "Model name|^CPU\(s\)" | tr -s ' '
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1
python3 -c "import torch, ktorch; print('torch', torch.__version__, 'threads', torch.get_num_threads(), 'kernel levels', ktorch.cpu_features()['available'])"

echo "== D. one tiny float64 backward call (E 4, H = I = 32, T 5: the gradcheck tests' shape), 1 and 16 threads"
timeout -k 5 15 python3 - <<'EOF' 2>&1 | tee "$OUT/backward_timing.log"
import time, torch, ktorch
torch.manual_seed(0)
E, H, I, T, K = 4, 32, 32, 5, 2
packed = ktorch.pack_experts(torch.randn(E, 2 * I, H) * H**-0.5, torch.randn(E, H, I) * I**-0.5, dtype="int8")
ids = torch.randint(0, E, (T, K))
x, g, w = (torch.randn(T, H, dtype=torch.float64), torch.randn(T, H, dtype=torch.float64),
           torch.rand(T, K, dtype=torch.float64))
for threads in (1, 16):
    torch.set_num_threads(threads)
    f = lambda: torch.ops.kt.fused_moe_backward(g, x, ids, w, *packed.tensors(), "gelu", None, None)
    f()
    t0 = time.perf_counter()
    for _ in range(200):
        f()
    print(f"  {threads:2d} threads: {(time.perf_counter() - t0) / 200 * 1e3:.3f} ms a call")
EOF

TESTS=(
  # A
  "tests/test_compile_backend.py::test_cuda_graph_decode_step_costs_no_host_wait"
  "tests/test_compile_backend.py::test_cuda_graph_native_host_functions_match_python"
  "tests/test_compile_deferral.py::test_cuda_compiled_deferral_decode_matches_eager_deferral[cuda_graphs-qwen3_moe]"
  "tests/test_compile_deferral.py::test_cuda_compiled_deferral_decode_matches_eager_deferral[cuda_graphs-deepseek_v3]"
  "tests/test_compile_deferral.py::test_cuda_compiled_deferral_decode_matches_eager_deferral[cuda_graphs-mixtral]"
  "tests/test_compile_deferral.py::test_cuda_compiled_deferral_decode_matches_eager_deferral[cuda_graphs-olmoe]"
  "tests/test_compile_deferral.py::test_cuda_graph_runtime_deferral_count_changes_between_replays"
  "tests/test_gpu_handoff.py::test_cudagraph_trees_keep_no_handoff_memory_in_their_pool"
  "tests/test_gpu_handoff.py::test_captured_tasks_take_words_made_before_and_allocate_no_device_memory"
  # B
  "tests/test_compile_backend.py::test_cuda_compiled_greedy_generate_with_default_residents_matches_eager[bf16]"
  "tests/test_compile_backend.py::test_cuda_compiled_greedy_generate_with_default_residents_matches_eager[int8]"
  "tests/test_compile_backend.py::test_compiled_greedy_generate_with_every_expert_resident_matches_eager"
  # C
  "tests/test_decode_attention.py::test_cuda_captured_generate_takes_it_and_matches_sdpa"
  "tests/test_gpu_handoff.py::test_generate_through_the_gpu_handoff_gives_the_eager_tokens[0]"
  "tests/test_generation.py::test_builtin_model_and_its_end_of_sequence"
  "tests/test_generation.py::test_compiled_layers_compile_one_layer_for_all_and_recompile_only_a_changed_model"
  "tests/test_compile_backend.py::test_compiled_greedy_generate_matches_eager[deepseek_v3-bf16]"
  "tests/test_compile_backend.py::test_inductor_compiled_matches_eager[deepseek_v3-dtype0]"
  "tests/test_compile_deferral.py::test_inductor_deferral_matches_reference_and_keeps_the_wait_late"
  "tests/test_compile_deferral.py::test_runtime_deferral_count_serves_every_d_from_one_compile[inductor]"
  # D
  "tests/test_ops_fused_moe_backward.py::test_gradcheck_float64"
  "tests/test_ops_fused_moe_backward.py::test_family_gradcheck_float64"
  "tests/test_ops_fused_moe_backward.py::test_backward_with_fewer_experts_than_threads"
)
echo "== tests (pytest -n 8 --timeout 120, limit 130 s)"
timeout -k 5 130 python3 -m pytest -v -n 8 --timeout 120 -p no:cacheprovider --durations=30 "${TESTS[@]}" \
  >"$OUT/tests.log" 2>&1
echo "   rc $? ($(($(date +%s) - START)) s)"
# -v lines ("[gw3] [ 40%] PASSED tests/..."): there even when the limit cut pytest short
echo "   finished: $(grep -cE '(PASSED|SKIPPED) tests/' "$OUT/tests.log") passed or skipped, $(grep -cE '(FAILED|ERROR) tests/' "$OUT/tests.log") failed"
grep -E "(FAILED|ERROR) tests/|^(FAILED|ERROR) " "$OUT/tests.log" | cut -c1-300 | sort -u | head -30
grep -E "Timeout|not tracked as outputs|MoE calls recorded" "$OUT/tests.log" | sort | uniq -c | head -10
sed -n '/slowest 30 durations/,/^$/p' "$OUT/tests.log" | head -32
grep -E "(passed|failed|error)" "$OUT/tests.log" | tail -1
echo "== total $(($(date +%s) - START)) s"
