"""benchmarks/bench_fused_moe.py's --env-variants: each variant string sets its settings for the timed block only
(the op reads KT_CPU_KERNEL / KT_PROFILE on every call) and restores the environment after, including on an
error."""

from __future__ import annotations

import os
import time

import pytest

from conftest import load_benchmark

bench = load_benchmark("bench_fused_moe")


def test_env_variant_sets_and_restores(monkeypatch):
    monkeypatch.setenv("KT_PROFILE", "0")
    monkeypatch.delenv("KT_CPU_KERNEL", raising=False)
    with bench.variant_env("KT_CPU_KERNEL=portable,KT_PROFILE=1"):
        assert os.environ["KT_CPU_KERNEL"] == "portable" and os.environ["KT_PROFILE"] == "1"
    assert "KT_CPU_KERNEL" not in os.environ and os.environ["KT_PROFILE"] == "0"
    with pytest.raises(RuntimeError):
        with bench.variant_env("KT_CPU_KERNEL=portable"):
            raise RuntimeError("a failing timed call")
    assert "KT_CPU_KERNEL" not in os.environ


def test_dash_and_none_are_no_change():
    before = dict(os.environ)
    with bench.variant_env("-"):
        assert dict(os.environ) == before
    with bench.variant_env(None):
        assert dict(os.environ) == before


@pytest.mark.parametrize("copies", [1, 2, 7, 8, 9, 12, 15, 16, 30, 64])
def test_timed_calls_meet_every_copy_with_every_routing(copies):
    """Cold caches: the timed calls pair each layer copy with each routing before any pair repeats (8 routings beside
    8 copies met the same pair every 8th call and read its experts from the L3)."""
    routings = [(r, None, None) for r in range(bench.coprime_count(8, copies))]
    assert len(routings) >= 8
    seen = []
    calls = copies * len(routings)
    bench.time_calls(lambda layer, ids, w, x: seen.append((layer, ids)), list(range(copies)), routings,
                     min_calls=calls, min_seconds=0.0)
    pairs = seen[1:calls + 1]  # (the first call warms up)
    assert len(set(pairs)) == calls


def test_paired_rounds_continue_the_cycle_and_pair_each_round_with_its_bandwidth():
    """A decode row's rounds (paired_rows) go on through the copies and routings where the last round stopped (one
    warm-up call in all, so no round starts on the warm-up's cached pair), and each round's bytes over time is divided
    by the bandwidth measured right before it: the median of those ratios."""
    copies, routings = 3, [(r, None, None) for r in range(8)]
    seen = []
    bandwidths = iter([100.0, 50.0, 200.0, 100.0, 100.0])
    measured = []

    def read_bandwidth(tries):
        measured.append(len(seen))  # (the calls made before this measurement)
        return next(bandwidths)

    def call(layer, ids, w, x):
        seen.append((layer, ids))
        time.sleep(0.004)  # every call about as long: the rounds' times agree

    sec, ratio = bench.paired_rows(call, list(range(copies)), routings, min_calls=4, min_seconds=0.0,
                                   read_bandwidth=read_bandwidth, nbytes=1.0)
    assert len(measured) == bench.PAIRED_ROUNDS
    assert seen[0] == (0, 0) and measured[0] == 0  # the warm-up runs after the first measurement, once
    timed = seen[1:]
    assert len(timed) == 4 * bench.PAIRED_ROUNDS and len(set(timed)) == len(timed)  # 20 calls, none repeated
    assert timed == [(i % copies, i % len(routings)) for i in range(1, len(timed) + 1)]
    assert measured[1:] == [1 + 4 * r for r in range(1, bench.PAIRED_ROUNDS)]  # between rounds
    # every round takes about the same time t; the ratios are 1/(t*bw): the median is that of bw = 100
    assert sec == pytest.approx(0.004, rel=0.5)
    assert ratio == pytest.approx(1.0 / sec / 100.0, rel=0.2)


def test_cpu_experts_keeps_only_that_many_experts_pairs():
    """--cpu-experts N: each routing keeps the pairs of N experts (the other slots -1, what a prefill split leaves the
    CPU op), a random set per routing; without it every pair is routed."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    full = bench.routings_for(64, 16, 4, 32, 3)
    assert all(bool((ids >= 0).all()) and ids.shape == (64, 4) for ids, _, _ in full)
    sparse = bench.routings_for(64, 16, 4, 32, 5, cpu_experts=2)
    kept = [set(ids[ids >= 0].tolist()) for ids, _, _ in sparse]
    assert all(len(k) <= 2 for k in kept) and len({frozenset(k) for k in kept}) > 1
    for ids, w, x in sparse:
        assert bool((ids < 0).any()) and w.shape == ids.shape and x.shape == (64, 32)


def test_cpu_experts_below_one_is_refused():
    """--cpu-experts 0 or negative would route nothing (or, sliced, all but one expert): refused before any layer is
    made, naming the option."""
    import subprocess
    import sys

    bench_path = bench.__file__
    for bad in ("0", "-3"):
        proc = subprocess.run([sys.executable, bench_path, "--cpu-experts", bad, "--tokens", "1"], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and "--cpu-experts must be at least 1" in proc.stderr, proc.stderr[-500:]
