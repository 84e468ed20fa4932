"""ktorch's CPU worker pool seen from Python: resizing (ktorch.set_num_threads) and calls from several threads."""

from __future__ import annotations

import os

import pytest
import torch

import ktorch


def test_pool_resize_keeps_results():
    """ktorch.set_num_threads resizes the worker pool; results do not depend on the thread count beyond fp32
    reduction order (tasks own disjoint outputs: here they are identical)."""
    torch.manual_seed(11)
    E, H, I, T = 12, 256, 192, 37
    packed = ktorch.pack_experts(torch.randn(E, 2 * I, H) * 0.05, torch.randn(E, H, I) * 0.05, "int8")
    x, ids, w = torch.randn(T, H), torch.randint(-1, E, (T, 4)), torch.rand(T, 4)
    before = ktorch.get_num_threads()
    try:
        results = []
        for n in (1, 3, 2):
            ktorch.set_num_threads(n)
            assert ktorch.get_num_threads() == n
            results.append(ktorch.fused_moe(x, ids, w, packed))
        assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
        with pytest.raises(ValueError, match="at least 1 thread"):
            ktorch.set_num_threads(0)
    finally:
        ktorch.set_num_threads(before)


def test_pool_calls_from_several_threads():
    """Calls from several Python threads at once (the pool runs them one after another) stay correct."""
    import threading

    torch.manual_seed(12)
    E, H, I = 8, 128, 64
    packed = ktorch.pack_experts(torch.randn(E, 2 * I, H) * 0.05, torch.randn(E, H, I) * 0.05, "bf16")
    cases = [(torch.randn(t, H), torch.randint(0, E, (t, 2)), torch.rand(t, 2)) for t in (1, 5, 33, 2)]
    want = [ktorch.fused_moe(*c, packed) for c in cases]
    errors = []

    def hammer(i):
        try:
            for _ in range(50):
                if not torch.equal(ktorch.fused_moe(*cases[i], packed), want[i]):
                    errors.append(i)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


_LAUNCHER_SCRIPT = """
import torch, ktorch
from ktorch._library import leave_cores_for_the_gpu_side
torch.set_num_threads(5)
leave_cores_for_the_gpu_side()
first = ktorch.get_num_threads()
ktorch.set_num_threads(4)
leave_cores_for_the_gpu_side()
second = ktorch.get_num_threads()
torch.set_num_threads(2)
ktorch._library._threads_chosen = False
leave_cores_for_the_gpu_side()  # never below one thread
print(first, second, ktorch.get_num_threads())
"""


@pytest.mark.parametrize("env,want", [({}, "2 4 1"), ({"KT_NUM_THREADS": "2"}, "2 4 4")])
def test_hybrid_placement_leaves_cores_unless_the_size_was_chosen(env, want):
    """prepare(device="cuda") takes HYBRID_SPARE_CORES (3) pool threads fewer than torch's (at least one), but
    never overrides KT_NUM_THREADS or an explicit ktorch.set_num_threads."""
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items() if k != "KT_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", _LAUNCHER_SCRIPT], env={**clean, **env}, check=True, timeout=120,
                         capture_output=True, text=True).stdout.split()
    assert " ".join(out[-3:]) == want


_SPIN_SCRIPT = """
import torch, ktorch
torch.manual_seed(13)
E, H, I, T = 10, 128, 96, 29
packed = ktorch.pack_experts(torch.randn(E, 2 * I, H) * 0.05, torch.randn(E, H, I) * 0.05, "int8")
x, ids, w = torch.randn(T, H), torch.randint(-1, E, (T, 3)), torch.rand(T, 3)
outs = [ktorch.fused_moe(x, ids, w, packed) for _ in range(20)]
assert all(torch.equal(o, outs[0]) for o in outs)
ktorch.set_num_threads(2)  # a pool rebuilt from the environment too
outs.append(ktorch.fused_moe(x, ids, w, packed))
torch.save(outs, {path!r})
"""


@pytest.mark.parametrize("env", [{"KT_SPIN_US": "50"}, {"KT_SPIN_US": "0"}, {"KT_SPIN_US": "0", "KT_NUMA_SPLIT": "2"}])
def test_spin_settings_keep_results(env, tmp_path):
    """KT_SPIN_US changes only how long idle workers spin before they park: the results equal the default's bit for
    bit (the pool's tasks own disjoint outputs), with workers parking after every call; with KT_NUMA_SPLIT the node
    groups' own pools park too (compared with the same split at the default spin)."""
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("KT_SPIN") and k not in ("KT_NUM_THREADS", "KT_NUMA_SPLIT")}
    results = []
    baseline = {"KT_NUMA_SPLIT": env["KT_NUMA_SPLIT"]} if "KT_NUMA_SPLIT" in env else {}
    for i, extra in enumerate((baseline, env)):
        path = str(tmp_path / f"out{i}.pt")
        subprocess.run([sys.executable, "-c", _SPIN_SCRIPT.format(path=path)],
                       env={**clean, "KT_NUM_THREADS": "3", **extra}, check=True, timeout=120)
        results.append(torch.load(path))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("script,env", [
    ("ktorch.set_num_threads(2); ktorch.set_num_threads(3)", {"KT_SPIN_US": "2ms"}),
    # a pool of the same size is rebuilt when the value changed, so a bad value is seen there too, set either way
    ("ktorch.set_num_threads(2); os.environ['KT_SPIN_US'] = '2ms'; ktorch.set_num_threads(2)", {}),
    ("ktorch.set_num_threads(2); torch.ops.kt.set_option('KT_SPIN_US', '2ms'); ktorch.set_num_threads(2)", {}),
])
def test_spin_us_rejects_other_values(script, env):
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items() if k != "KT_SPIN_US"}
    r = subprocess.run([sys.executable, "-c", "import os, torch, ktorch; " + script],
                       env={**clean, **env}, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "KT_SPIN_US must be an integer, got '2ms'" in r.stderr


_RESPIN_SCRIPT = """
import os, torch, ktorch

def threads():
    # ktorch's live pool workers, by the name the pool gives them: torch and Python start and end threads of
    # their own, and a joined thread can stay listed for a moment as exiting (state Z or X)
    found = set()
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/stat") as f:
                name, state = f.read().split("(", 1)[1].rsplit(")", 1)
        except FileNotFoundError:  # ended while listed
            continue
        if name == "kt-pool" and state.split()[0] not in ("Z", "X"):
            found.add(t)
    return found

torch.manual_seed(3)
packed = ktorch.pack_experts(torch.randn(6, 128, 64) * 0.05, torch.randn(6, 64, 64) * 0.05, "int8")
x, ids, w = torch.randn(5, 64), torch.randint(0, 6, (5, 2)), torch.rand(5, 2)
ktorch.set_num_threads(3)
want = ktorch.fused_moe(x, ids, w, packed)
before = threads()
ktorch.set_num_threads(3)  # the same size, the same spin: kept
assert threads() == before, (threads(), before)
ktorch.config.set_spin_us(0)
ktorch.set_num_threads(3)  # the same size, another spin: rebuilt with new worker threads
after = threads()
assert len(before) == 2 and len(after) == 2 and not (after & before), (after, before)
assert ktorch.config.value("KT_SPIN_US") == "0" and ktorch.get_num_threads() == 3
assert torch.equal(ktorch.fused_moe(x, ids, w, packed), want)
ktorch.config.set_spin_us(None)  # back to the variable (unset: 2000): rebuilt again
ktorch.set_num_threads(3)
again = threads()
assert len(again) == 2 and not (again & after) and ktorch.config.value("KT_SPIN_US") is None, (again, after)
assert torch.equal(ktorch.fused_moe(x, ids, w, packed), want)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc/self/task")
def test_spin_set_from_python_rebuilds_the_pool_and_keeps_results():
    """ktorch.config.set_spin_us overrides KT_SPIN_US; set_num_threads rebuilds a pool of the same size when the
    spin changed (new worker threads) and keeps it otherwise; results stay bit for bit."""
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items() if k not in ("KT_SPIN_US", "KT_NUM_THREADS")}
    r = subprocess.run([sys.executable, "-c", _RESPIN_SCRIPT], env=clean, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
