"""benchmarks/bench_fused_moe.py's --env-variants: each variant string sets its knobs for the timed block only
(the op reads KT_DOWN_RANGES / KT_DOWN_GROUPS / KT_AMX_WALK on every call) and restores the environment after,
including on an error; without --env-variants a variant is a KT_AMX_WALK value."""

from __future__ import annotations

import os

import pytest

from conftest import load_benchmark

bench = load_benchmark("bench_fused_moe")


def test_env_variant_sets_and_restores(monkeypatch):
    monkeypatch.setenv("KT_DOWN_GROUPS", "2")
    monkeypatch.delenv("KT_DOWN_RANGES", raising=False)
    with bench.variant_env("KT_DOWN_RANGES=32,KT_DOWN_GROUPS=4", True):
        assert os.environ["KT_DOWN_RANGES"] == "32" and os.environ["KT_DOWN_GROUPS"] == "4"
    assert "KT_DOWN_RANGES" not in os.environ and os.environ["KT_DOWN_GROUPS"] == "2"
    with pytest.raises(RuntimeError):
        with bench.variant_env("KT_DOWN_RANGES=8", True):
            raise RuntimeError("a failing timed call")
    assert "KT_DOWN_RANGES" not in os.environ


def test_dash_is_no_change_and_walks_stay_walks(monkeypatch):
    monkeypatch.delenv("KT_AMX_WALK", raising=False)
    before = dict(os.environ)
    with bench.variant_env("-", True):
        assert dict(os.environ) == before
    with bench.variant_env("kblock:4", False):
        assert os.environ["KT_AMX_WALK"] == "kblock:4"
    assert "KT_AMX_WALK" not in os.environ
