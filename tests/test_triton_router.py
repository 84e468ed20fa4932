"""The router top-k kernel (``torch.ops.ktorch.router_topk``, ktorch/ops/triton_router.py) and the routers swapped
onto it in the captured decode step (ktorch/integrations/transformers_routers.py).

The kernel runs on CUDA, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 with Triton installed);
without either those tests skip, and the argument checks (which run before any kernel) still run. The kernel is
compared with a float64 reference (softmax, a stable descending sort: ties lowest expert first, renormalization)
and with transformers' own computation; the swap with tiny random transformers MoE models. The captured decode step
with and without the swap needs CUDA.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from ktorch.integrations import transformers_cache, transformers_routers
from ktorch.integrations.transformers_routers import RouterForm, router_form, swapped
from ktorch.ops import triton_router
from ktorch.ops.triton_router import router_topk
from models import (LOGIT_ATOL, ROUTER_RTOL, RoutingRecorder, assert_flip_is_near_tie, first_routing_flip,
                    tiny_model)
from reference import router_topk_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS_RUN = triton_router.triton_available() and (torch.cuda.is_available() or triton_router.interpreting())
needs_kernels = pytest.mark.skipif(
    not KERNELS_RUN,
    reason="the Triton router kernel needs Triton and a CUDA GPU, or Triton's interpreter (TRITON_INTERPRET=1)")


def transformers_topk(logits: torch.Tensor, k: int, renormalize: bool, out_dtype: torch.dtype) -> tuple:
    """What Qwen3-MoE's router does after its linear layer."""
    p = torch.softmax(logits, dtype=torch.float, dim=-1)
    w, ids = torch.topk(p, k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(out_dtype), ids


ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}  # an ulp over the value, at most
# Triton's interpreter truncates float32 to bf16/fp16 (whatever the rounding asked for); CUDA rounds to nearest
ROUNDING_ULPS = 1.0 if DEVICE == "cpu" else 0.5


def assert_weights_close(got: torch.Tensor, want64: torch.Tensor) -> None:
    """Within the kernel's float32 arithmetic (16 float32 ulps) plus one rounding to got's dtype (fp16's subnormals,
    below 2^-14, are spaced 2^-24 apart)."""
    rtol = (ROUNDING_ULPS * ULP[got.dtype] if got.dtype != torch.float32 else 0.0) + 16 * ULP[torch.float32]
    atol = 2.0**-24 if got.dtype == torch.float16 else 1e-38
    err = (got.double() - want64).abs() - rtol * want64.abs()
    assert err.max().item() <= atol, (err.max().item(), rtol)


# ---------------------------------------------------------------- the kernel


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("T,E,K", [(1, 128, 8), (3, 60, 4), (64, 128, 8), (2, 512, 16), (5, 8, 1), (4, 8, 8),
                                   (1, 1024, 32), (2, 256, 6)])
@pytest.mark.parametrize("renormalize", [True, False], ids=["norm", "raw"])
def test_kernel_matches_a_float64_reference(dtype, T, E, K, renormalize):
    gen = torch.Generator().manual_seed(T * 1000 + E + K)
    logits = (torch.randn(T, E, generator=gen, dtype=torch.float64) * 3).to(dtype)
    for out_dtype in (dtype, torch.float32):
        w, ids = router_topk(logits.to(DEVICE), K, renormalize, out_dtype)
        assert w.dtype == out_dtype and ids.dtype == torch.int64 and w.shape == ids.shape == (T, K)
        want_w, want_ids = router_topk_reference(logits, K, renormalize)
        assert torch.equal(ids.cpu(), want_ids)
        assert_weights_close(w.cpu(), want_w)
    # against transformers' ATen computation: the same ids at every rank up to the order of equal probabilities
    w, ids = router_topk(logits.to(DEVICE), K, renormalize, dtype)
    tw, tids = transformers_topk(logits, K, renormalize, dtype)
    p = torch.softmax(logits, dtype=torch.float, dim=-1)
    assert torch.equal(p.gather(1, ids.cpu()), p.gather(1, tids))
    torch.testing.assert_close(w.cpu().float(), tw.float(), rtol=ULP[dtype] + 16 * ULP[torch.float32], atol=1e-7)


@needs_kernels
def test_ties_take_the_lowest_expert_first():
    """Equal probabilities: the lowest expert first, in the ranks and at the k-th boundary (what a stable
    descending sort gives; torch.topk leaves their order unspecified)."""
    logits = torch.tensor([[0.0] * 8,                                  # all tied
                           [1.0, 2.0, 2.0, 0.5, 2.0, 1.0, 3.0, 2.0],   # 3, then four 2s across the boundary of k=3
                           [-1.0, 5.0, -1.0, 5.0, 5.0, -1.0, -1.0, 0.0]])
    w, ids = router_topk(logits.to(DEVICE), 3, True, torch.float32)
    assert ids.cpu().tolist() == [[0, 1, 2], [6, 1, 2], [1, 3, 4]]
    assert torch.equal(ids.cpu(), router_topk_reference(logits, 3, True)[1])
    torch.testing.assert_close(w[0].cpu(), torch.full((3,), 1 / 3))
    torch.testing.assert_close(w[2].cpu(), torch.full((3,), 1 / 3))
    # bf16 logits tie often (8 bits of mantissa): the reference's order exactly, over many random rows
    logits = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).round()
    w, ids = router_topk(logits.to(DEVICE), 8, True, torch.bfloat16)
    assert torch.equal(ids.cpu(), router_topk_reference(logits, 8, True)[1])


@needs_kernels
def test_strided_rows_empty_batches_and_the_dynamo_trace():
    wide = torch.randn(4, 200, generator=torch.Generator().manual_seed(2))
    logits = wide[:, 10:138]  # row stride 200
    w, ids = router_topk(logits.to(DEVICE), 8)
    assert torch.equal(ids.cpu(), router_topk_reference(logits, 8, True)[1]) and w.dtype == torch.float32
    w, ids = router_topk(torch.empty(0, 64, device=DEVICE), 4)
    assert w.shape == ids.shape == (0, 4)

    def route(x):
        w, ids = router_topk(x.float() * 2, 4, False, torch.bfloat16)
        return w.float().sum(-1), ids

    x = torch.randn(3, 64, device=DEVICE)
    got = torch.compile(route, backend="aot_eager", fullgraph=True)(x)
    want = route(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_opcheck(dtype):
    logits = torch.randn(5, 96, device=DEVICE).to(dtype)
    for args in ((logits, 6, True, dtype), (logits, 1, False, torch.float32)):
        torch.library.opcheck(torch.ops.ktorch.router_topk.default, args)


def test_bad_inputs_name_the_argument(monkeypatch):
    """Refused before any kernel runs (so these run without Triton too)."""
    x = torch.randn(2, 16)
    cases = [(dict(logits=torch.randn(16)), "logits"), (dict(logits=torch.ones(2, 16, dtype=torch.int32)), "logits"),
             (dict(logits=x.double()), "float32, bfloat16 or float16"), (dict(k=0), "k must"), (dict(k=17), "k must"),
             (dict(out_dtype=torch.int64), "out_dtype"),
             (dict(logits=torch.randn(1, triton_router.MAX_EXPERTS + 1)), "E <="),
             (dict(logits=torch.randn(1, 64), k=triton_router.MAX_TOP_K + 1), "k must")]
    for change, message in cases:
        args = {"logits": x, "k": 2, "renormalize": True, "out_dtype": torch.float32, **change}
        with pytest.raises(ValueError, match=message):
            torch.ops.ktorch.router_topk(args["logits"], args["k"], args["renormalize"], args["out_dtype"])
    with pytest.raises(RuntimeError, match="argument 'k'"):  # the op's schema refuses it first
        torch.ops.ktorch.router_topk(x, 2.0, True, torch.float32)
    monkeypatch.setattr(triton_router, "kernel_runs_on", lambda t: False)
    if triton_router.triton is not None:
        with pytest.raises(ValueError, match="logits are on"):
            router_topk(x, 2)
    monkeypatch.setattr(triton_router, "triton", None)
    with pytest.raises(RuntimeError, match="Triton is not installed"):
        router_topk(x, 2)


# ---------------------------------------------------------------- the routers swapped in the decode step


class ScaledRouter(nn.Module):
    """A router of the right shape whose weights are scaled: not the kernel's computation."""

    def __init__(self, E=16, H=32, top_k=4, scale=1.01):
        super().__init__()
        self.top_k, self.hidden_dim, self.scale = top_k, H, scale
        self.weight = nn.Parameter(torch.randn(E, H))

    def forward(self, hidden_states):
        logits = nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        w, ids = torch.topk(torch.softmax(logits, dtype=torch.float, dim=-1), self.top_k, dim=-1)
        return logits, (w / w.sum(-1, keepdim=True)) * self.scale, ids


class SigmoidRouter(ScaledRouter):
    def forward(self, hidden_states):
        logits = nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        w, ids = torch.topk(logits.float().sigmoid(), self.top_k, dim=-1)
        return logits, w / w.sum(-1, keepdim=True), ids


class LogitTopkRouter(ScaledRouter):
    """Granite-MoE's order: top-k of the logits, then a softmax over those k, weights in the input's dtype."""

    def forward(self, hidden_states):
        logits = nn.functional.linear(hidden_states, self.weight).float()
        top, ids = logits.topk(self.top_k, dim=-1)
        return logits, torch.softmax(top, dim=-1).type_as(hidden_states), ids


def _tiny(family: str, dtype: torch.dtype, **overrides):
    """A tiny random model for inference, as ``prepare`` leaves one: no parameter requires grad."""
    torch.manual_seed(0)
    return tiny_model(family, dtype=dtype, **overrides).to(DEVICE).requires_grad_(False)


@needs_kernels
def test_probe_finds_each_routers_form_and_refuses_others():
    forms = {
        ("qwen3_moe", torch.bfloat16): RouterForm(renormalize=True, cast=True, flatten=True),
        ("olmoe", torch.bfloat16): RouterForm(renormalize=False, cast=True, flatten=True),
        ("mixtral", torch.bfloat16): RouterForm(renormalize=True, cast=False, flatten=True),
        ("qwen3_moe", torch.float32): RouterForm(renormalize=True, cast=True, flatten=True),
    }
    for (family, dtype), form in forms.items():
        routers = transformers_routers._routers(_tiny(family, dtype))
        assert routers and all(router_form(m) == form for m in routers), (family, dtype)
    # qwen3_moe without renormalization is another form of the same class
    routers = transformers_routers._routers(_tiny("qwen3_moe", torch.bfloat16, norm_topk_prob=False))
    assert router_form(routers[0]) == RouterForm(renormalize=False, cast=True, flatten=True)
    # DeepSeek-V3's sigmoid, group-limited, bias-corrected router: refused by its shape, before any probe
    ds = transformers_routers._routers(_tiny("deepseek_v3", torch.float32))
    assert ds and all(router_form(m) is None for m in ds)
    assert "more than one weight" in transformers_routers._shape_fits(ds[0])
    # refused by the probe: a scale of 1.01 (in float32, beyond bf16's rounding), a sigmoid
    assert router_form(ScaledRouter().to(DEVICE)) is None
    assert router_form(ScaledRouter(scale=1.0 + 1e-3).to(DEVICE).to(torch.bfloat16)) is None
    assert router_form(SigmoidRouter().to(DEVICE)) is None
    assert router_form(ScaledRouter(scale=1.0).to(DEVICE).to(torch.bfloat16)) == RouterForm(True, False, True)
    # the same values computed in another order, its outputs keeping the input's leading dims
    assert router_form(LogitTopkRouter().to(DEVICE).to(torch.bfloat16)) == RouterForm(True, True, False)


# transformers' router classes built alone from one config namespace, bf16 (so that the weights' dtype is decided):
# module, class, the form the probe must find (None: left alone)
ROUTER_CLASSES = [
    ("qwen2_moe", "Qwen2MoeTopKRouter", RouterForm(renormalize=True, cast=True, flatten=True)),
    ("flex_olmo", "FlexOlmoTopKRouter", RouterForm(renormalize=True, cast=True, flatten=True)),
    ("minimax", "MiniMaxTopKRouter", RouterForm(renormalize=True, cast=False, flatten=True)),
    # the top-k of the logits, then a softmax over those k: the same values; outputs keep the input's leading dims
    ("granitemoe", "GraniteMoeTopKRouter", RouterForm(renormalize=True, cast=True, flatten=False)),
    ("jamba", "JambaTopKRouter", RouterForm(renormalize=False, cast=True, flatten=False)),
    ("gpt_oss", "GptOssTopKRouter", None),  # a bias
    ("deepseek_v2", "DeepseekV2TopkRouter", None),  # weights scaled by routed_scaling_factor
    ("llama4", "Llama4Router", None),  # sigmoid of the top-k logits
]


@needs_kernels
@pytest.mark.parametrize("module,name,form", ROUTER_CLASSES, ids=[c[1] for c in ROUTER_CLASSES])
def test_probe_on_transformers_router_classes(module, name, form):
    import importlib
    import types

    config = types.SimpleNamespace(num_experts_per_tok=4, num_experts=16, num_local_experts=16, n_routed_experts=16,
                                   norm_topk_prob=True, hidden_size=32, n_group=4, topk_group=2,
                                   routed_scaling_factor=2.5, topk_method="greedy", moe_num_experts=16, moe_topk=4)
    try:
        cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
    except (ImportError, AttributeError):
        import transformers

        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    torch.manual_seed(0)
    router = cls(config).to(DEVICE, torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        for p in router.parameters():
            p.normal_()
        out = router(torch.randn(3, 32, device=DEVICE, dtype=torch.bfloat16))
    if form is not None and not (isinstance(out, tuple) and len(out) == 3 and out[0].shape == (3, 16)
                                 and out[2].dtype == torch.int64):
        # another transformers' class of this name that does not return (logits, weights, ids) (GraniteMoeTopKRouter
        # in 5.17 returns (ids, weights, logits)) is not the router the form describes: refused
        form = None
    assert router_form(router) == form


class _RouterCalls:
    """Every router call's input and (logits, weights, ids), in order."""

    def __init__(self, model):
        self.calls = []
        self.handles = [m.register_forward_hook(lambda m, args, out: self.calls.append((m, args[0], out)))
                        for m in transformers_routers._routers(model)]

    def close(self):
        for h in self.handles:
            h.remove()


def assert_same_routing(got: tuple, want: tuple) -> None:
    """(logits, weights, ids) of a swapped router against the original's on the same input. The swapped forward sums
    the logits in another order (a float32 reduction, transformers_routers._decode_forward): the logits within one
    rounding of their dtype (relative to the row's largest); the picks the same up to experts whose probabilities
    (the original's) tie within what that rounding moves them (ties may be ordered otherwise too); the weights, of
    the same dtype, within one rounding plus that."""
    (lg, wg, ig), (lw, ww, iw) = got, want
    assert lg.dtype == lw.dtype and wg.dtype == ww.dtype and ig.dtype == iw.dtype and ig.shape == iw.shape
    k = iw.shape[-1]
    lg, lw = lg.reshape(-1, lg.shape[-1]).float(), lw.reshape(-1, lw.shape[-1]).float()
    ig, iw, wg, ww = (t.reshape(-1, k) for t in (ig, iw, wg, ww))
    moved = ULP[got[0].dtype] * lw.abs().amax(-1, keepdim=True) + 1e-6  # a logit's largest move, each row
    assert ((lg - lw).abs() <= moved).all(), (lg - lw).abs().max()
    p = torch.softmax(lw, dim=-1)
    picked, wanted = (p.gather(1, i.long()).sort(-1, descending=True).values for i in (ig, iw))
    assert ((picked - wanted).abs() <= 2 * moved * wanted + 1e-7).all(), (picked - wanted).abs().max()
    wg, ww = (w.float().sort(-1, descending=True).values for w in (wg, ww))
    assert ((wg - ww).abs() <= (ULP[got[1].dtype] + 16 * ULP[torch.float32] + 4 * moved) * ww.abs() + 1e-7).all(), \
        (wg - ww).abs().max()


@needs_kernels
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_swapped_routers_give_the_models_logits(family, dtype, monkeypatch):
    """A tiny random model with the swap: each router, given the input it had in the original forward, returns the
    original's routing (``assert_same_routing``); the model's logits match the original's (float32: to 1e-5, no
    routing flip; bf16: up to the first routing flip, which must be a rounding near-tie: tests/models.py); calls of
    more than DECODE_MAX_TOKENS rows (prefill) keep the class's forward; after the context the forwards are the
    classes' again."""
    model = _tiny(family, dtype)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    ref = _RouterCalls(model)
    with torch.no_grad(), RoutingRecorder(model) as ref_routing:
        want = model(ids).logits.float()
    ref.close()
    kernel_calls = []
    topk = triton_router.router_topk
    monkeypatch.setattr(triton_router, "router_topk", lambda *a: kernel_calls.append(1) or topk(*a))
    with swapped(model) as swaps, torch.no_grad():
        assert len(swaps) == model.config.num_hidden_layers
        kernel_calls.clear()  # the probe's
        for m, x, out in ref.calls:
            assert_same_routing(m(x), out)
        assert len(kernel_calls) == len(ref.calls)
        with RoutingRecorder(model) as routing:
            got = model(ids).logits.float()
        assert len(kernel_calls) == 2 * len(ref.calls)
        model(torch.zeros(1, transformers_routers.DECODE_MAX_TOKENS + 1, dtype=torch.long, device=DEVICE))
        assert len(kernel_calls) == 2 * len(ref.calls)  # a prefill-sized call: the class's forward
    assert all("forward" not in vars(m) and not hasattr(m, "kt_router_cast") for m in swaps)
    flip = first_routing_flip(ref_routing, routing)
    if dtype == torch.float32:
        assert flip is None
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    n = ids.shape[1] if flip is None else flip[0]
    if flip is not None:
        assert_flip_is_near_tie(ref_routing, routing, flip, ROUTER_RTOL[dtype])
    assert (got[0, :n] - want[0, :n]).abs().max().item() <= LOGIT_ATOL[dtype] if n else True


@needs_kernels
def test_the_swapped_router_traces_into_one_graph_with_the_op():
    """Dynamo (as the decode step's regional compile runs it) traces a swapped router with no graph break, the op a
    node of the graph; it compiles anew when the swap is undone (the A/B variants alternate)."""
    model = _tiny("qwen3_moe", torch.float32)
    gate = model.model.layers[0].mlp.gate
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def route(gate, x):
        logits, w, ids = gate(x * 2)
        return logits, w * 3, ids

    route = torch.compile(route, backend=backend, dynamic=False, fullgraph=True)
    x = torch.randn(3, model.config.hidden_size, device=DEVICE)
    with torch.no_grad():
        want = gate(x * 2)
        with swapped(model):
            got = route(gate, x)
        route(gate, x)
    uses = [any("ktorch.router_topk" in str(n.target) for n in g.graph.nodes) for g in graphs]
    assert uses == [True, False]
    assert_same_routing((got[0], got[1] / 3, got[2]), want)


@needs_kernels
def test_no_swap_for_a_trainable_model_or_an_unfit_router():
    model = _tiny("qwen3_moe", torch.float32)
    model.requires_grad_(True)  # prepare(trainable=True)
    with swapped(model) as swaps:
        assert swaps == []
    model = _tiny("deepseek_v3", torch.float32)
    with swapped(model) as swaps:
        assert swaps == []


@pytest.mark.skipif(not torch.cuda.is_available() or not triton_router.triton_available(),
                    reason="needs a CUDA GPU and Triton (the captured decode step)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_captured_generate_with_the_kernels_gives_the_same_tokens(dtype, monkeypatch):
    """ktorch.generate's captured step with the routers' top-k and the KV writes on the Triton kernels (made for
    every router and cache layer, undone after the capture) decodes the greedy tokens of the same step without them
    (turned off as bench_generate's "aten router" and "aten kv write" do). float32: both off (rounding far below the
    logits' gaps); bf16: the KV write off alone (a copy: the same bits), since a bf16 weight one rounding apart
    could flip a near-tie token."""
    import ktorch

    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", dtype=dtype)
    model.generation_config.eos_token_id = None
    ktorch.prepare(model, device="cuda", experts_dtype="bf16", gpu_memory="off")
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    fast = ktorch.generate(model, ids, 40)
    layers = model.config.num_hidden_layers
    assert fast.timings.cuda_graphs and model.kt_decoder.swapped == {"routers": layers, "cache layers": layers}
    assert all("forward" not in vars(m) for m in transformers_routers._routers(model))
    assert all("update" not in vars(layer) for layer in model.kt_decoder.cache.layers)
    model.kt_decoder = None
    if dtype == torch.float32:
        monkeypatch.setattr(transformers_routers, "swapped", lambda m: contextlib.nullcontext([]))
    monkeypatch.setattr(transformers_cache, "swapped", lambda c: contextlib.nullcontext([]))
    aten = ktorch.generate(model, ids, 40)
    routers = 0 if dtype == torch.float32 else layers
    assert model.kt_decoder.swapped == {"routers": routers, "cache layers": 0}
    assert fast.ids == aten.ids


@pytest.mark.skipif(not triton_router.triton_available() or triton_router.interpreting(),
                    reason="compiling for a GPU needs Triton, not its interpreter")
def test_kernels_compile_for_hopper():
    """Both kernels (the router's and the KV write's: tests/test_triton_kv_write.py) compile to sm_90 code through
    Triton's real compiler (no GPU needed), at the specializations a decode step launches, with programmatic
    dependent launch (PDL = 1: both griddepcontrol instructions in the PTX) and without: what the interpreter, which
    runs the kernels here, does not check."""
    import triton
    from sm90 import pdl_instructions, sm90_ptx

    from ktorch.ops.triton_kv_write import _kv_write
    from ktorch.ops.triton_router import _router_topk

    cases = [("bf16", "bf16", 8, 128, 1, True), ("bf16", "fp32", 8, 128, 1, False), ("fp32", "fp32", 16, 512, 2, True),
             ("fp16", "fp16", 32, 1024, 4, True)]

    def ptx(fn, signature: dict, constexprs: dict, warps: int) -> str:
        code = sm90_ptx(fn, signature, constexprs, warps)
        assert pdl_instructions(code) == (bool(constexprs["PDL"]),) * 2, pdl_instructions(code)
        return code

    for i, (dtype, out, K, block_e, warps, renorm) in enumerate(cases):
        signature = {"logits_ptr": "*" + dtype, "w_ptr": "*" + out, "ids_ptr": "*i64", "E": "i32", "stride_t": "i32"}
        constexprs = {"K": K, "RENORM": renorm, "BLOCK_E": block_e, "BLOCK_K": triton.next_power_of_2(K), "PDL": i % 2}
        ptx(_router_topk, signature, constexprs, warps)
    signature = {name: "*bf16" for name in ("k_new", "v_new", "keys", "values")}
    signature.update({"length_ptr": "*i64", **{n: "i32" for n in ("H", "S", "L", "skb", "skh", "sks", "svb", "svh",
                                                                  "svs", "DK", "DV")}})
    for pdl in (0, 1):
        constexprs = {"ROWS": 4, "BLOCK_R": 4, "BLOCK_DK": 128, "BLOCK_DV": 128, "PDL": pdl}
        assert "bar.sync" in ptx(_kv_write, signature, constexprs, 4)  # the barrier before the counter moves
