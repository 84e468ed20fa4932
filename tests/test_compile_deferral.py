"""Expert deferral end to end on the tiny models: compiled (n_deferred_experts) and eager (prepare(deferred_experts=d))
against a plain eager reference of the semantics (docs/deferral.md), written here apart from ktorch's code.

On the CPU the compiled graphs run without Inductor (exact comparisons) except one case with Inductor; the CUDA
tests (skipped without a GPU) run Inductor/Triton with and without CUDA graphs.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ktorch
from ktorch.compile import REPORTS, RUNTIME, BackendOptions
from ktorch.integrations.transformers_experts import ktorch_experts_forward
from models import FAMILIES, PROMPT, decode_step_inputs, moe_experts_modules, teacher_forced_decode, tiny_model

FAST = {"inductor": False}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class DeferralReference:
    """Plain eager expert deferral on a prepared model (a context manager).

    Each MoE layer but the last sorts every token's K slots by weight (ties to the lower slot) in Python, runs the
    top K - d slots, adds the previous layer's deferred result, and computes its own d lowest slots for the next
    layer. Experts run through ktorch's plain (non-deferred) eager forward."""

    def __init__(self, model, n_deferred: int):
        self.modules, self.n_deferred, self.pending = moe_experts_modules(model), n_deferred, None

    def __enter__(self):
        for i, m in enumerate(self.modules):
            m.forward = lambda h, ids, w, m=m, i=i: self._forward(m, i, h, ids, w)
        return self

    def __exit__(self, *exc):
        for m in self.modules:
            del m.forward

    def _forward(self, module, index, hidden, ids, weights):
        last = index == len(self.modules) - 1
        k = ids.shape[1]
        now, later = ids.clone(), ids.clone()
        for t in range(ids.shape[0]):
            ranked = sorted(range(k), key=lambda j: (-weights[t, j].item(), j))
            for j in ranked[: k - self.n_deferred]:
                later[t, j] = -1
            for j in ranked[k - self.n_deferred:]:
                now[t, j] = -1
        if last:
            now = ids
        if index == 0:
            self.pending = None
        out = ktorch_experts_forward(module, hidden, now, weights)
        if self.pending is not None:
            out = out + self.pending
        self.pending = None if last else ktorch_experts_forward(module, hidden, later, weights)
        return out


def compiled_logits(model, ids, options):
    torch._dynamo.reset()
    REPORTS.clear()
    compiled = torch.compile(model, backend="ktorch", options=options, fullgraph=True)
    with torch.no_grad():
        logits = compiled(ids).logits
    (report,) = REPORTS
    return logits, report


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_and_eager_deferral_match_the_reference(family):
    """bf16, a 16-token prefill: d = 1 compiled and eager equal the reference bit for bit and differ from d = 0;
    d = 0 equals the graph compiled without the option bit for bit."""
    model = ktorch.prepare(tiny_model(family, dtype=torch.bfloat16), device="cpu")
    n_moe = len(moe_experts_modules(model))
    ids = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        with DeferralReference(model, 1):
            want = model(ids).logits
        plain = model(ids).logits
        ktorch.set_deferred_experts(model, 1)
        eager = model(ids).logits
        eager_again = model(ids).logits  # nothing stale is left pending between forwards
        ktorch.set_deferred_experts(model, 0)
        assert torch.equal(model(ids).logits, plain)
    assert torch.equal(eager, want) and torch.equal(eager_again, want)
    assert not torch.equal(want, plain)
    got, report = compiled_logits(model, ids, {**FAST, "n_deferred_experts": 1})
    assert len(report.deferrals) == n_moe - 1 and report.deferral_skipped == []
    assert torch.equal(got, want)
    zero, report = compiled_logits(model, ids, {**FAST, "n_deferred_experts": 0})
    without, _ = compiled_logits(model, ids, FAST)
    assert report.deferrals == [] and torch.equal(zero, without)


def _prefill_then_step(model, ids, step_context=None) -> tuple:
    """Logits of an eager prefill of ``ids`` into a static cache, then of one decode step (its greedy token) run
    inside ``step_context`` (e.g. a DeferralReference); both [1, V]."""
    import contextlib

    from transformers import StaticCache

    n = ids.shape[1]
    cache = StaticCache(config=model.config, max_cache_len=n + 4)
    first = model(ids, past_key_values=cache, cache_position=torch.arange(n), use_cache=True).logits[:, -1]
    pos = torch.tensor([n])
    with step_context or contextlib.nullcontext():
        step = model(first.argmax(-1, keepdim=True), past_key_values=cache, cache_position=pos, position_ids=pos[None],
                     use_cache=True).logits[:, -1]
    return first, step


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_eager_deferral_leaves_prefill_sized_calls_exact(family):
    """Eager deferral applies to decode-sized calls only: a prompt of PREFILL_TOKENS tokens or more runs every
    layer's experts in full (its logits equal the plain forward's bit for bit), one token fewer defers (equal to the
    reference, not to the plain forward), and the decode step after the long prompt defers again."""
    from ktorch.integrations.deferral import PREFILL_TOKENS

    model = ktorch.prepare(tiny_model(family, dtype=torch.bfloat16), device="cpu")
    long_ids = torch.randint(0, 256, (1, PREFILL_TOKENS))
    short_ids = long_ids[:, : PREFILL_TOKENS - 1]
    with torch.no_grad():
        plain_first, plain_step = _prefill_then_step(model, long_ids)
        plain_short = model(short_ids).logits
        with DeferralReference(model, 1):
            want_short = model(short_ids).logits
        want_first, want_step = _prefill_then_step(model, long_ids, DeferralReference(model, 1))
        ktorch.set_deferred_experts(model, 1)
        try:
            got_first, got_step = _prefill_then_step(model, long_ids)
            got_short = model(short_ids).logits
        finally:
            ktorch.set_deferred_experts(model, 0)
    assert torch.equal(got_first, plain_first) and torch.equal(want_first, plain_first)
    assert torch.equal(got_short, want_short) and not torch.equal(got_short, plain_short)
    assert torch.equal(got_step, want_step) and not torch.equal(got_step, plain_step)


def test_all_but_one_slot_deferred_chains_through_every_layer():
    """d = K - 1 on a 4-layer model: three layers deferred in a chain, still equal to the reference."""
    model = ktorch.prepare(tiny_model("qwen3_moe", dtype=torch.bfloat16, num_hidden_layers=4,
                                      num_experts_per_tok=3), device="cpu")
    ids = torch.randint(0, 256, (1, 8))
    with torch.no_grad(), DeferralReference(model, 2):
        want = model(ids).logits
    got, report = compiled_logits(model, ids, {**FAST, "n_deferred_experts": 2})
    assert [d.n_deferred for d in report.deferrals] == [2, 2, 2]
    assert torch.equal(got, want)


def test_greedy_generate_with_compiled_deferral_matches_eager_deferral():
    """32 greedy tokens (static cache): generate's compiled decode steps with n_deferred_experts=1 against the
    eager model with deferred_experts=1 (prefill and decode steps), DeepSeek-V3 (shared experts in the overlap)."""
    from transformers import CompileConfig

    torch._dynamo.reset()
    model = ktorch.prepare(tiny_model("deepseek_v3", dtype=torch.bfloat16), device="cpu", deferred_experts=1)
    config = model.generation_config.compile_config  # its mode="reduce-overhead" became an option
    assert config.mode is None and config.options == {"n_deferred_experts": 1, "cuda_graphs": True}
    prompt = torch.randint(0, 256, (1, PROMPT))
    kwargs = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, cache_implementation="static",
                  output_logits=True, return_dict_in_generate=True)
    eager = model.generate(prompt, **kwargs, disable_compile=True)
    config = CompileConfig(backend="ktorch", mode=None, options={**FAST, "n_deferred_experts": 1}, fullgraph=True)
    config._compile_all_devices = True
    REPORTS.clear()
    compiled = model.generate(prompt, **kwargs, compile_config=config)
    assert REPORTS and all(len(r.deferrals) == 1 for r in REPORTS)
    assert torch.equal(compiled.sequences, eager.sequences)
    for a, b in zip(compiled.logits, eager.logits):
        assert torch.equal(a, b)
    ktorch.set_deferred_experts(model, 0)
    assert model.generation_config.compile_config.options == {"cuda_graphs": True}


def test_inductor_deferral_matches_reference_and_keeps_the_wait_late():
    """Inductor (C++ on the CPU), fp32 activations: logits match the reference, and in the generated code layer 0's
    deferred wait comes after layer 1's submit and immediate wait."""
    from torch._inductor.utils import run_and_get_code

    model = ktorch.prepare(tiny_model("qwen3_moe", num_hidden_layers=3), device="cpu")
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad(), DeferralReference(model, 1):
        want = model(ids).logits
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="ktorch", options={"n_deferred_experts": 1}, fullgraph=True)
    with torch.no_grad():
        got, (code,) = run_and_get_code(compiled, ids)
    torch.testing.assert_close(got.logits, want, rtol=0, atol=1e-2)
    calls = [line.strip() for line in code.splitlines()
             if ("ktorch.submit_experts" in line or "ktorch.wait_experts" in line)
             and not line.strip().startswith(("#", "assert"))]
    order = "".join(("S" if "submit_experts_split" in c else "s") if "submit" in c else "w" for c in calls)
    # layers 0 and 1 submit once each (split), layer 2 plainly; waits: layer 0 now | layer 1 now, layer 0 later |
    # layer 2 now, layer 1 later
    assert order == "S" + "w" + "S" + "ww" + "s" + "ww", order


@pytest.mark.parametrize("inductor", [False, True], ids=["fx", "inductor"])
def test_runtime_deferral_count_serves_every_d_from_one_compile(inductor):
    """n_deferred_experts="runtime": one compiled graph, d changed between calls with
    set_runtime_deferred_experts, no recompile; each d equals the reference for that d (the FX graph bit for bit,
    Inductor within 1e-2), and d = 0 equals the graph compiled without deferral."""
    from ktorch.compile import set_runtime_deferred_experts

    model = ktorch.prepare(tiny_model("qwen3_moe", dtype=torch.bfloat16 if not inductor else torch.float32,
                                      num_hidden_layers=3, num_experts_per_tok=3), device="cpu")
    torch.manual_seed(5)
    ids = torch.randint(0, 256, (1, 11))
    torch._dynamo.reset()
    REPORTS.clear()
    options = {"n_deferred_experts": "runtime", "inductor": inductor}
    compiled = torch.compile(model, backend="ktorch", options=options, fullgraph=True)
    try:
        got = {}
        with torch.no_grad():
            for d in (2, 0, 1, 3, 1):
                set_runtime_deferred_experts(d)
                got[d] = compiled(ids).logits
        assert len(REPORTS) == 1  # one compile for all
        assert [x.n_deferred for x in REPORTS[0].deferrals] == [None, None]
    finally:
        set_runtime_deferred_experts(0)
    with torch.no_grad():
        plain, _ = compiled_logits(model, ids, {"inductor": inductor})
        for d in (0, 1, 2, 3):
            with DeferralReference(model, min(d, 3)):
                want = model(ids).logits
            if inductor:
                torch.testing.assert_close(got[d], want, rtol=0, atol=1e-2)
            else:
                assert torch.equal(got[d], want), d
    if not inductor:
        assert torch.equal(got[0], plain)
    assert not torch.equal(got[1], got[0]) and not torch.equal(got[2], got[1])


def test_runtime_deferral_count_is_validated():
    from ktorch.compile import set_runtime_deferred_experts

    assert BackendOptions.parse(None, {"n_deferred_experts": "runtime"}).n_deferred_experts == "runtime"
    with pytest.raises(ValueError, match="'runtime'"):
        BackendOptions.parse(None, {"n_deferred_experts": "later"})
    for bad in (-1, 2.0, True, "1"):
        with pytest.raises(ValueError, match="n_deferred must be an int >= 0"):
            set_runtime_deferred_experts(bad)
    assert RUNTIME.runtime_deferred == 0


def test_runtime_deferral_count_change_waits_for_the_gpus(monkeypatch):
    """A change of the runtime count first synchronizes every CUDA device (queued replays read the count when they
    run, so they must finish under the one they were launched with); setting the same count does not; inside a
    capture a change is refused with its message. The CUDA calls are stubbed: this runs where there is no GPU (the
    device runs the real race: test_cuda_graph_runtime_deferral_count_changes_between_replays)."""
    from ktorch.compile import set_runtime_deferred_experts

    synced, capturing = [], [False]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    try:
        set_runtime_deferred_experts(0)  # unchanged: no wait
        assert synced == []
        set_runtime_deferred_experts(2)
        assert synced == [0, 1] and RUNTIME.runtime_deferred == 2
        capturing[0] = True
        with pytest.raises(RuntimeError, match="cannot change the count inside a CUDA-graph capture"):
            set_runtime_deferred_experts(1)
        assert RUNTIME.runtime_deferred == 2 and synced == [0, 1]
        set_runtime_deferred_experts(2)  # the same count inside a capture: nothing to change, no error
    finally:
        capturing[0] = False
        set_runtime_deferred_experts(0)
    assert RUNTIME.runtime_deferred == 0 and int(RUNTIME._runtime_deferred_host) == 0


def test_options_validate_n_deferred_experts():
    assert BackendOptions.parse(None, {"n_deferred_experts": 2}).n_deferred_experts == 2
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="n_deferred_experts"):
            BackendOptions.parse(None, {"n_deferred_experts": bad})
    with pytest.raises(ValueError, match="async_experts"):
        BackendOptions.parse(None, {"n_deferred_experts": 1, "async_experts": False})
    with pytest.raises(ValueError, match=">= 0"):
        ktorch.set_deferred_experts(tiny_model("qwen3_moe"), -1)


# ---------------------------------------------------------------- on a GPU


@needs_cuda
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cuda_graphs,start", [(False, "native"), (True, "native"), (True, "python")],
                         ids=["no_graphs", "cuda_graphs", "cuda_graphs-python_host_functions"])
def test_cuda_compiled_deferral_decode_matches_eager_deferral(family, cuda_graphs, start, monkeypatch):
    """fp32 activations on the GPU: 12 teacher-forced decode steps compiled with n_deferred_experts=1 (Inductor/
    Triton, CUDA graphs or not) against the same steps run eagerly with deferred_experts=1 (runtime submit/wait,
    deferred wait at the next layer): logits within 1e-2; under CUDA graphs the replays submit nothing from Python.
    A deferring layer is one split call on the CPU (both parts run back to back), started by a C host function or
    by Python ones (what captures use while a test observer watches the calls; a no-op observer here)."""
    monkeypatch.setattr(RUNTIME, "observers", [lambda *args: None] if start == "python" else [])
    torch._dynamo.reset()
    model = ktorch.prepare(tiny_model(family), device="cuda", deferred_experts=1, gpu_memory="off")
    n_moe = len(moe_experts_modules(model))
    implied_before = RUNTIME.stats["implied_joins"]
    torch.manual_seed(1)
    eager_kwargs = decode_step_inputs(model)
    compiled_kwargs = copy.copy(eager_kwargs)
    compiled_kwargs["past_key_values"] = copy.deepcopy(eager_kwargs["past_key_values"])
    tokens = torch.randint(0, 256, (12,), device="cuda")
    with torch.no_grad():
        want = teacher_forced_decode(model, eager_kwargs, tokens, False)
        options = {"n_deferred_experts": 1, "cuda_graphs": cuda_graphs}  # torch.compile takes no mode with options
        step = torch.compile(model, backend="ktorch", options=options, fullgraph=True)
        REPORTS.clear()
        got = teacher_forced_decode(step, compiled_kwargs, tokens[:4], cuda_graphs)  # warm-up and capture
        before = dict(RUNTIME.stats)
        got = torch.cat([got, teacher_forced_decode(step, compiled_kwargs, tokens[4:], cuda_graphs)])
        torch.cuda.synchronize()
    assert REPORTS and all(len(r.deferrals) == n_moe - 1 and r.cuda_graphs == cuda_graphs for r in REPORTS)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-2)
    if cuda_graphs:
        assert RUNTIME.stats["submits"] == before.get("submits", 0)
        assert RUNTIME.stats["host_waits"] == before.get("host_waits", 0)
        # native host functions: each deferred wait rides on the next layer's join (no host function of its own)
        assert RUNTIME.stats["implied_joins"] - implied_before >= (n_moe - 1 if start == "native" else 0)


@needs_cuda
def test_cuda_graph_runtime_deferral_count_changes_between_replays():
    """n_deferred_experts="runtime" under CUDA graphs: one capture, d set between replays (the count tensor is
    read by a captured copy): 12 teacher-forced fp32 decode steps per d against the eager model deferring d. The
    stream is held back before each d's steps, so the host has launched all 12 replays when it sets the next d:
    the steps must still run with the d they were launched under (set_runtime_deferred_experts waits for them)."""
    from ktorch.compile import set_runtime_deferred_experts

    torch._dynamo.reset()
    model = ktorch.prepare(tiny_model("qwen3_moe"), device="cuda", gpu_memory="off")
    torch.manual_seed(1)
    start = decode_step_inputs(model)
    tokens = torch.randint(0, 256, (12,), device="cuda")

    def fresh():
        kwargs = copy.copy(start)
        kwargs["past_key_values"] = copy.deepcopy(start["past_key_values"])
        return kwargs

    options = {"n_deferred_experts": "runtime", "cuda_graphs": True}
    step = torch.compile(model, backend="ktorch", options=options, fullgraph=True)
    got = {}
    REPORTS.clear()
    try:
        with torch.no_grad():
            for d in (1, 2, 0, 1):
                set_runtime_deferred_experts(d)
                torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: the replays below queue behind it
                got[d] = teacher_forced_decode(step, fresh(), tokens, True)
            torch.cuda.synchronize()
    finally:
        set_runtime_deferred_experts(0)
    assert len(REPORTS) == 1 and REPORTS[0].cuda_graphs
    for d in (0, 1, 2):  # eager after all compiled runs (the eager chain changes the modules)
        ktorch.set_deferred_experts(model, d)
        with torch.no_grad():
            want = teacher_forced_decode(model, fresh(), tokens, False)
        torch.testing.assert_close(got[d], want, rtol=0, atol=1e-2)
    ktorch.set_deferred_experts(model, 0)
    assert not torch.equal(got[1], got[0])
