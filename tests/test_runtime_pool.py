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


@pytest.mark.parametrize("env", [{"KT_SPIN_YIELD": "1"}, {"KT_SPIN_YIELD": "1", "KT_SPIN_US": "50"},
                                 {"KT_SPIN_US": "0"}, {"KT_SPIN_YIELD": "1", "KT_NUMA_SPLIT": "2"}])
def test_spin_settings_keep_results(env, tmp_path):
    """KT_SPIN_YIELD / KT_SPIN_US change only how idle workers wait: the results equal the default's bit for bit
    (the pool's tasks own disjoint outputs), with workers parking after every call or yielding while they spin;
    with KT_NUMA_SPLIT the node groups' own pools yield too (compared with the same split without yielding)."""
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
    ("ktorch.set_num_threads(2); ktorch.set_num_threads(3)", {"KT_SPIN_YIELD": "2"}),
    # a pool of the same size is rebuilt when the variables changed, so a bad value is seen there too
    ("ktorch.set_num_threads(2); os.environ['KT_SPIN_YIELD'] = '2'; ktorch.set_num_threads(2)", {}),
])
def test_spin_yield_rejects_other_values(script, env):
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items() if k != "KT_SPIN_YIELD"}
    r = subprocess.run([sys.executable, "-c", "import os, torch, ktorch; " + script],
                       env={**clean, **env}, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "KT_SPIN_YIELD must be 0 or 1, got 2" in r.stderr


_PIN_SCRIPT = """
import os, torch, ktorch

def pinned_threads():  # this process's threads whose affinity is one CPU
    out = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/status") as f:
            allowed = [l.split()[1] for l in f if l.startswith("Cpus_allowed_list")]
        if allowed and allowed[0].isdigit():
            out.append(int(allowed[0]))
    return sorted(out)

torch.manual_seed(3)
packed = ktorch.pack_experts(torch.randn(6, 128, 64) * 0.05, torch.randn(6, 64, 64) * 0.05, "int8")
x, ids, w = torch.randn(5, 64), torch.randint(0, 6, (5, 2)), torch.rand(5, 2)
cpus = sorted(os.sched_getaffinity(0))
ktorch.set_num_threads(2)
base = pinned_threads()
want = ktorch.fused_moe(x, ids, w, packed)
os.environ["KT_PIN_THREADS"] = "1"
ktorch.set_num_threads(2)  # the same size: rebuilt because KT_PIN_THREADS changed, worker 1 on the 2nd CPU
assert torch.equal(ktorch.fused_moe(x, ids, w, packed), want)
assert pinned_threads() == sorted(base + [cpus[1]]), (pinned_threads(), base, cpus)
os.environ["KT_PIN_THREADS"] = "0"
ktorch.set_num_threads(2)
assert torch.equal(ktorch.fused_moe(x, ids, w, packed), want)
assert pinned_threads() == base, (pinned_threads(), base)
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and at least 2 CPUs in the affinity mask")
def test_pin_threads_rebuilds_the_pool_and_keeps_results():
    """KT_PIN_THREADS=1 pins worker i to the i-th CPU of the process's mask; set_num_threads rebuilds a pool of
    the same size when it changed (bench_e2e --pool-sweep times both on one compile); results stay bit for bit."""
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items() if k not in ("KT_PIN_THREADS", "KT_NUM_THREADS")}
    r = subprocess.run([sys.executable, "-c", _PIN_SCRIPT], env=clean, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
