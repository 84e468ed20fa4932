"""benchmarks/bench_e2e.py's decode-profile arithmetic on hand-made trace events (no GPU): the union and
intersection of busy intervals, and the GPU work that ran while a CPU experts call was in flight, read off the
GPU timeline alone (between a call's last input copy and its result copy)."""

from __future__ import annotations


import pytest

from conftest import load_benchmark

e2e = load_benchmark("bench_e2e")


def kernel(ts, dur):
    return {"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": dur}


def copy(ts, dur, direction):
    name = "Memcpy DtoH (Device -> Pinned)" if direction == "DtoH" else "Memcpy HtoD (Pinned -> Device)"
    return {"ph": "X", "cat": "gpu_memcpy", "name": name, "ts": ts, "dur": dur}


def test_union_and_intersection():
    assert e2e._union([(0, 10), (5, 15), (20, 30)]) == 25
    assert e2e._union([]) == 0
    assert e2e._intersection([(0, 10), (20, 30)], [(5, 25)]) == 10
    assert e2e._intersection([(0, 10)], [(10, 20)]) == 0


def test_gpu_work_under_experts_counts_kernels_between_input_and_result_copies():
    # layer 1: inputs copied (three copies), a 25 us kernel (shared experts) and a 5 us one, the result copy;
    # then kernels outside any call (attention of the next layer); layer 2: inputs, nothing, result
    events = [copy(0, 2, "DtoH"), copy(3, 2, "DtoH"), copy(6, 2, "DtoH"),
              kernel(60, 25), kernel(90, 5),
              copy(400, 3, "HtoD"),
              kernel(410, 80),
              copy(500, 2, "DtoH"), copy(503, 2, "DtoH"),
              copy(900, 3, "HtoD"),
              kernel(910, 10)]
    us, windows = e2e.gpu_work_under_experts(events, 0, 1000)
    assert windows == 2
    assert us == pytest.approx(30)


def test_gpu_work_under_experts_clips_to_the_window_and_to_the_step():
    events = [copy(0, 2, "DtoH"), kernel(1, 10), copy(50, 2, "HtoD"),  # a kernel overlapping the input copy
              copy(100, 2, "DtoH"), kernel(120, 10), copy(200, 2, "HtoD")]
    us, windows = e2e.gpu_work_under_experts(events, 0, 1000)
    assert windows == 2 and us == pytest.approx(9 + 10)  # 2..11 of the first kernel, all of the second
    us, windows = e2e.gpu_work_under_experts(events, 90, 1000)  # the step starts after the first call
    assert windows == 1 and us == pytest.approx(10)


def test_a_result_copy_without_input_copies_opens_no_window():
    events = [copy(0, 2, "HtoD"), kernel(10, 10), copy(30, 2, "HtoD")]
    assert e2e.gpu_work_under_experts(events, 0, 100) == (0, 0)


def test_call_gap_stats_show_a_stalled_call_and_gap():
    # (start_ns, end_ns, tokens): 20 calls of 400 us with 200 us gaps, one call stretched by 1.9 ms and one gap too
    timeline, t = [], 0
    for i in range(20):
        dur = 400_000 + (1_900_000 if i == 7 else 0)
        timeline.append((t, t + dur, 1))
        t += dur + 200_000 + (1_900_000 if i == 12 else 0)
    stats = e2e.call_gap_stats(timeline)
    assert stats["call_us_p50"] == pytest.approx(400) and stats["call_us_max"] == pytest.approx(2300)
    assert stats["gap_us_p50"] == pytest.approx(200) and stats["gap_us_max"] == pytest.approx(2100)
    assert stats["calls_over_1ms"] == 1 and stats["gaps_over_1ms"] == 1
    assert e2e.call_gap_stats(timeline[:1]) == {}


def test_parse_pool_sweep(monkeypatch):
    monkeypatch.setenv("KT_SPIN_US", "777")
    assert e2e.parse_pool_sweep("15:2000, 13,") == [(15, 2000), (13, 777)]
    assert e2e.parse_pool_sweep("13:0,12:") == [(13, 0), (12, 777)]
    monkeypatch.delenv("KT_SPIN_US")
    assert e2e.parse_pool_sweep("12") == [(12, 2000)]
    assert e2e.parse_pool_sweep("") == []
    for bad in ("x:1", "0:100", "4:-1", "4:100:1", "4:100:1:0", "4:y"):
        with pytest.raises(SystemExit, match="--pool-sweep"):
            e2e.parse_pool_sweep(bad)


def test_split_decode_deferral():
    assert e2e.split_decode_deferral(None) == (None, None)
    assert e2e.split_decode_deferral({"n_deferred_experts": 2}) == ({"n_deferred_experts": 2}, None)
    assert e2e.split_decode_deferral({"decode_deferred_experts": 3}) == ({"n_deferred_experts": "runtime"}, 3)
    assert e2e.split_decode_deferral({"decode_deferred_experts": 0, "n_deferred_experts": "runtime"}) == (
        {"n_deferred_experts": "runtime"}, 0)
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="decode_deferred_experts"):
            e2e.split_decode_deferral({"decode_deferred_experts": bad})
    with pytest.raises(ValueError, match="n_deferred_experts='runtime'"):
        e2e.split_decode_deferral({"decode_deferred_experts": 2, "n_deferred_experts": 2})


def test_decode_only_deferral_runs_prefill_at_zero_and_decode_at_d():
    import torch

    import ktorch.compile

    seen = []

    class FakeRunner:
        def prefill(self, ids):
            assert not torch.is_grad_enabled()  # the timed forwards build no autograd graph
            seen.append(("prefill", ids.shape[1], ktorch.compile.RUNTIME.runtime_deferred))
            return torch.zeros(1, 1, dtype=torch.long)

        def decode(self, first, n):
            seen.append(("decode", n, ktorch.compile.RUNTIME.runtime_deferred))
            return first

    ktorch.compile.set_runtime_deferred_experts(5)  # whatever was set before is not what prefill runs with
    r = e2e.time_variant(None, "compiled", "cpu", [7], 4, 3, 1, 50, options={"decode_deferred_experts": 2},
                         runner=FakeRunner())
    assert r["decode_deferred_experts"] == 2 and "decode_tok_s" in r and "prefill_7_tok_s" in r
    assert {d for kind, _, d in seen if kind == "prefill"} == {0}
    assert {d for kind, _, d in seen if kind == "decode"} == {2}
    assert ktorch.compile.RUNTIME.runtime_deferred == 0  # reset after the decode


def test_host_cpu_shares():
    before = dict(user=100, nice=0, system=50, idle=800, iowait=10, irq=5, softirq=5, steal=30)
    after = dict(user=160, nice=0, system=70, idle=880, iowait=10, irq=5, softirq=5, steal=50)  # 180 ticks
    shares = e2e.host_cpu_shares(before, after)
    assert shares["host_busy_pct"] == pytest.approx(100 * 80 / 180)
    assert shares["host_idle_pct"] == pytest.approx(100 * 80 / 180)
    assert shares["host_steal_pct"] == pytest.approx(100 * 20 / 180)
    assert e2e.host_cpu_shares({}, after) == {} and e2e.host_cpu_shares(after, after) == {}
    now = e2e.host_cpu_times()  # this machine's, where /proc/stat exists
    assert not now or {"user", "idle", "steal"} <= now.keys()


@pytest.mark.parametrize("spec,want", [
    ("auto", ("auto", True)),
    (" off ", ("off", True)),
    ("512:0.4,2048:45", ({512: 0.4, 2048: 45}, True)),
    ("512:0.4,2048:0.45@serial", ({512: 0.4, 2048: 0.45}, False)),
    ("auto@serial", ("auto", False)),
])
def test_parse_stream_setting(spec, want):
    """--stream-experts settings: what set_stream_experts takes, and whether copies go a layer ahead."""
    assert e2e.parse_stream_setting(spec) == want


def test_parse_stream_setting_errors():
    with pytest.raises(ValueError, match="expected off, auto or MIN_TOKENS:SHARE"):
        e2e.parse_stream_setting("512=0.4@serial")


def test_profiles_run_on_the_cpu(tmp_path):
    """profile_decode and profile_prefill (one profiling helper) on the tiny model on the CPU: they write their
    traces and report a step; no GPU, so no copies or kernels (their device figures are read on the device)."""
    model, _ = e2e.build_model("tiny", "eager", "cpu", "int8")
    runner = e2e.Runner(model, "eager", "cpu", 128)
    decode = e2e.profile_decode(runner, 3, str(tmp_path), "tiny")
    prefill = e2e.profile_prefill(runner, 17, str(tmp_path), "tiny")
    assert decode["step_ms"] > 0 and decode["gpu_busy_ms"] == 0
    assert prefill["tokens"] == 17 and prefill["prefill_ms"] > 0
    assert prefill["h2d_gb"] == 0 and prefill["h2d_gbps"] == 0 and prefill["kernels_busy_ms"] == 0
    assert (tmp_path / "trace_tiny.json").exists() and (tmp_path / "trace_prefill_tiny_17.json").exists()
