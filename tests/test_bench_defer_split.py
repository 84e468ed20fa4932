"""benchmarks/bench_defer_split.py runs end to end on a tiny layer (a smoke run: the script must not rot between
device sessions; its numbers here mean nothing): every mode prints a row."""

from __future__ import annotations

import os

from conftest import load_benchmark

bench = load_benchmark("bench_defer_split")


def test_smoke_run_prints_every_mode(capsys):
    import ktorch

    before = ktorch.get_num_threads()
    try:
        bench.main(["--shapes", "tiny", "--tokens", "1", "3", "--threads", "2", "--deferred", "1", "--calls", "3",
                    "--max-copies", "2"])
    finally:
        ktorch.set_num_threads(before)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny")]
    modes = ["op", "task d=0", "task d=1 1 call"]
    assert [row.split(" | ")[3] for row in rows] == modes * 2
    for row in rows:
        first, total = (float(x) for x in row.split(" | ")[4:6])
        assert 0 < first <= total


def test_huge_pages_ab_prints_both_sets_and_copies_exactly():
    """--huge-pages: the op and the tasks on a 4 KiB-page set and a huge-page set of the same layers; the copies
    (madvise before their first touch) hold the same bytes."""
    import torch

    import ktorch

    before = ktorch.get_num_threads()
    try:
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            bench.main(["--shapes", "tiny", "--threads", "2", "--deferred", "1", "--calls", "3", "--max-copies", "2",
                        "--huge-pages"])
    finally:
        ktorch.set_num_threads(before)
    rows = [line.split(" | ")[3] for line in out.getvalue().splitlines() if line.startswith("| tiny")]
    assert rows == ["op/4K", "op/huge", "task d=0/4K", "task d=1 1 call/4K", "task d=0/huge", "task d=1 1 call/huge"]
    t = torch.randint(-127, 128, (9 << 20,), dtype=torch.int8)
    for huge in (False, True):
        assert torch.equal(bench.advised_copy(t, huge), t)


def test_env_variants_ab_prints_each_mode_under_each_variant_and_restores_the_environment(capsys, monkeypatch):
    """--env-variants: the op, task d=0 and task d=D under each environment setting, taking turns; the settings are
    made only around each call (a variable set before the run keeps its value after it)."""
    import ktorch

    monkeypatch.setenv("KT_PROFILE", "0")
    monkeypatch.delenv("KT_CPU_KERNEL", raising=False)
    before = ktorch.get_num_threads()
    try:
        bench.main(["--shapes", "tiny", "--threads", "2", "--deferred", "1", "--calls", "3", "--max-copies", "2",
                    "--env-variants", "-", "KT_CPU_KERNEL=portable,KT_PROFILE=0"])
    finally:
        ktorch.set_num_threads(before)
    rows = [line.split(" | ")[3] for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny")]
    assert rows == [f"{mode} [{variant}]" for variant in ("-", "KT_CPU_KERNEL=portable,KT_PROFILE=0")
                    for mode in ("op", "task d=0", "task d=1 1 call")]
    assert os.environ["KT_PROFILE"] == "0" and "KT_CPU_KERNEL" not in os.environ


def test_env_variants_and_huge_pages_are_refused_together(capsys):
    import pytest

    with pytest.raises(SystemExit):
        bench.main(["--shapes", "tiny", "--env-variants", "-", "--huge-pages"])
    assert "--env-variants and --huge-pages are separate A/Bs: give one" in capsys.readouterr().err
