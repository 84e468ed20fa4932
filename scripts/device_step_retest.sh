# Re-runs the tests that failed on the device (tracebacks in the log), then the files not reached in time.
timeout 260 python3 -m pytest -q -p no:cacheprovider --timeout=120 --tb=short -rfE \
  "tests/test_cli.py::test_generate_builtin_streams_text_and_rates" \
  "tests/test_cli.py::test_generate_int8_experts_in_process" \
  "tests/test_cli.py::test_generate_plain_matches_prepared_bf16" \
  "tests/test_cli.py::test_chat_session" \
  "tests/test_compile_backend.py::test_cuda_graph_decode_step_costs_no_host_wait" \
  "tests/test_compile_deferral.py::test_cuda_compiled_deferral_decode_matches_eager_deferral[cuda_graphs-qwen3_moe]" \
  "tests/test_compile_deferral.py::test_cuda_compiled_deferral_decode_matches_eager_deferral[cuda_graphs-deepseek_v3]" \
  "tests/test_gpu_experts.py::test_cuda_gpu_experts_match_hf_eager_and_compile_under_cuda_graphs[grouped_mm-deepseek_v3]" \
  > "$OUT/retest.log" 2>&1
grep -E "passed|failed" "$OUT/retest.log" | tail -3
timeout 200 python3 -m pytest -q -p no:cacheprovider --timeout=120 --tb=short -rfE --durations=10 tests \
  --deselect tests/test_builtin.py --deselect tests/test_cli.py --deselect tests/test_compile_backend.py \
  --deselect tests/test_compile_deferral.py --deselect tests/test_gpu_experts.py > "$OUT/rest.log" 2>&1
tail -30 "$OUT/rest.log"
