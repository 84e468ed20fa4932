"""The gradients of kt.fused_moe (kt.fused_moe_backward) and the LoRA forward kt.fused_moe_delta.

Against: the float64 reference (tests/reference.py) differentiated by torch.autograd on the weights the packing
stands for (kt.unpack), finite differences (torch.autograd.gradcheck in float64), opcheck with autograd, and
transformers' eager experts on random layers.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import ktorch
from conftest import DRIVER_ONLY_SKIPS
from reference import ACTIVATION_ALIASES, ACTIVATIONS, fused_moe_reference, relative_error

SKIP_KERNEL_LEVELS = DRIVER_ONLY_SKIPS  # tests/conftest.py: avx2 runs this file's code as portable does

FORMATS = ("bf16", "int8", "int4")
OP_ACTIVATIONS = ("silu", "gelu_tanh", "gelu", "relu")


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _packed(E, H, I, fmt, group_size=32):
    gate_up = torch.randn(E, 2 * I, H) * H**-0.5
    down = torch.randn(E, H, I) * I**-0.5
    return ktorch.pack_experts(gate_up, down, dtype=fmt, group_size=group_size if fmt == "int4" else None)


def _routing(T, K, E, pattern):
    if pattern == "random":
        ids = torch.randint(0, E, (T, K))
    elif pattern == "skips":  # negative ids skip their slot; the first token keeps its first slot, so that at
        ids = torch.randint(-1, E, (T, K))  # small T not every slot is skipped (1 in 512 at T=1, K=3)
        ids[0, 0] = ids[0, 0].clamp(min=0)
    elif pattern == "repeats":  # one expert in several slots of a token, and every token on expert 0
        ids = torch.randint(0, E, (T, K))
        ids[:, 0] = 0
        ids[:, 1] = 0
    else:
        raise ValueError(pattern)
    return ids, torch.rand(T, K)


def _reference_grads(hidden, ids, weights, packed, activation, grad_out):
    gate_up, down = packed.dequantize()
    x = hidden.double().requires_grad_()
    w = weights.double().requires_grad_()
    out = fused_moe_reference(x, ids, w, gate_up, down, activation, gate_up_bias=packed.w13_bias,
                              down_bias=packed.w2_bias)
    return torch.autograd.grad(out, (x, w), grad_out.double())


# the families' forms (issue 32): activations with parameters (limits and caps small enough that the clamps and caps
# act on a good share of the unit-sized pre-activations here; values exact in float32, which the op parses them to,
# so the float64 comparisons see the same function), relu2, biases, gateless experts
FAMILY_ACTIVATIONS = ("relu2", "swiglu_oai(alpha=1.703125, limit=0.75)", "silu_clamped(limit=0.625)",
                      "softcap_swiglu(gate=1.5, up=0.75)")
GATELESS_ACTIVATIONS = ("silu", "gelu_tanh", "gelu", "relu", "relu2")


def _family_packed(E, H, I, fmt, gated=True, biases=True, group_size=32):
    w13 = torch.randn(E, (2 if gated else 1) * I, H) * H**-0.5
    down = torch.randn(E, H, I) * I**-0.5
    kw = dict(dtype=fmt, group_size=group_size if fmt == "int4" else None,
              gate_up_bias=torch.randn(E, w13.shape[1]) * 0.5 if biases else None,
              down_bias=torch.randn(E, H) * 0.5 if biases else None)
    return ktorch.pack_experts(w13, down, **kw) if gated else ktorch.pack_experts(up_proj=w13, down_proj=down, **kw)


def _family_cases():
    for fmt in FORMATS:
        for biases in (True, False):
            for act in FAMILY_ACTIVATIONS:
                yield fmt, True, act, biases
            for act in GATELESS_ACTIVATIONS:
                yield fmt, False, act, biases


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("activation", OP_ACTIVATIONS)
@pytest.mark.parametrize("pattern", ["random", "skips", "repeats"])
def test_backward_op_equals_float64_reference_gradient(fmt, activation, pattern):
    E, H, I, T, K = 6, 64, 64, 11, 3
    packed = _packed(E, H, I, fmt)
    ids, weights = _routing(T, K, E, pattern)
    hidden, grad_out = torch.randn(T, H, dtype=torch.float64), torch.randn(T, H, dtype=torch.float64)
    dx, dw, dd = torch.ops.kt.fused_moe_backward(grad_out, hidden, ids, weights.double(), *packed.tensors(), activation)
    rx, rw = _reference_grads(hidden, ids, weights, packed, activation, grad_out)
    assert dd.numel() == 0
    assert dx.dtype == torch.float64 and dw.dtype == torch.float64
    torch.testing.assert_close(dx, rx, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dw, rw, rtol=1e-10, atol=1e-12)
    if pattern == "skips":
        assert (dw[ids < 0] == 0).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2), (torch.float16, 2e-2)])
def test_autograd_of_fused_moe(fmt, dtype, tol):
    """loss.backward() through ktorch.fused_moe: gradients in the inputs' dtypes, close to the float64 reference."""
    E, H, I, T, K = 8, 96, 64, 13, 4
    packed = _packed(E, H, I, fmt)
    ids, weights = _routing(T, K, E, "skips")
    hidden = torch.randn(T, H).to(dtype).requires_grad_()
    w = weights.requires_grad_()
    grad_out = torch.randn(T, H)
    ktorch.fused_moe(hidden, ids, w, packed).backward(grad_out.to(dtype))
    rx, rw = _reference_grads(hidden.detach(), ids, w.detach(), packed, "silu", grad_out.to(dtype).float())
    assert hidden.grad.dtype == dtype and w.grad.dtype == torch.float32
    assert relative_error(hidden.grad, rx) < tol
    assert relative_error(w.grad, rw) < tol


class _ReferenceForwardKtBackward(torch.autograd.Function):
    """The float64 reference as the forward, kt.fused_moe_backward as the backward: gradcheck compares the op's
    backward against finite differences of exactly the function the packed weights stand for."""

    @staticmethod
    def forward(ctx, hidden, weights, ids, packed, dequantized, activation):
        ctx.save_for_backward(hidden, weights, ids)
        ctx.packed, ctx.activation = packed, activation
        return fused_moe_reference(hidden, ids, weights, *dequantized, activation, gate_up_bias=packed.w13_bias,
                                   down_bias=packed.w2_bias)

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weights, ids = ctx.saved_tensors
        dx, dw, _ = torch.ops.kt.fused_moe_backward(grad_out, hidden, ids, weights, *ctx.packed.tensors(),
                                                    ctx.activation, None, None, *ctx.packed.biases())
        return dx, dw, None, None, None, None


def _kink_distance(hidden, ids, packed, activation, delta=None):
    """How far the pre-activations (x W13^T + bias + delta) of the routed pairs lie from the activation's clamps
    (swiglu_oai's and silu_clamped's: gate at +limit, up at +-limit; inf without clamps). gradcheck's central
    differences (eps 1e-6) straddling a clamp measure no derivative: the inputs are drawn again when one is close."""
    m = re.search(r"limit=([0-9.]+)", activation)
    if m is None:
        return math.inf
    limit = float(m.group(1))
    w13 = packed.dequantize()[0].double()
    half = w13.shape[1] // 2
    pairs = (ids >= 0).nonzero().tolist()
    pre = torch.stack([hidden[t].detach() @ w13[ids[t, k]].T for t, k in pairs])
    if packed.w13_bias is not None:
        pre = pre + torch.stack([packed.w13_bias[ids[t, k]].double() for t, k in pairs])
    if delta is not None:
        pre = pre + torch.stack([delta[t, k].detach() for t, k in pairs])
    gate, up = pre[:, :half], pre[:, half:]
    return min((gate - limit).abs().min().item(), (up.abs() - limit).abs().min().item())


def _gradcheck_through_reference(packed, T, H, K, E, activation):
    """gradcheck of the op's backward against finite differences of the float64 reference forward
    (_ReferenceForwardKtBackward), on random float64 inputs; returns (ids, weights, hidden, w) for further checks."""
    ids, weights = _routing(T, K, E, "skips")
    hidden = torch.randn(T, H, dtype=torch.float64)
    while _kink_distance(hidden, ids, packed, activation) < 1e-4:
        hidden = torch.randn(T, H, dtype=torch.float64)
    hidden.requires_grad_()
    w = weights.double().requires_grad_()
    dequantized = packed.dequantize()
    assert torch.autograd.gradcheck(
        lambda x, w: _ReferenceForwardKtBackward.apply(x, w, ids, packed, dequantized, activation), (hidden, w))
    return ids, weights, hidden, w


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_gradcheck_float64(fmt, activation):
    E, H, I, T, K = 4, 32, 32, 5, 2
    packed = _packed(E, H, I, fmt)
    ids, weights, hidden, w = _gradcheck_through_reference(packed, T, H, K, E, activation)
    # kt.fused_moe_delta runs in float64 itself: gradcheck of the op, deltas included, and of its h output
    delta = (torch.randn(T, K, 2 * I, dtype=torch.float64) * 0.3).requires_grad_()

    def op(x, w, d):
        return torch.ops.kt.fused_moe_delta(x, ids, w, *packed.tensors(), d, activation)

    assert torch.autograd.gradcheck(op, (hidden, w, delta), fast_mode=True)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("activation", OP_ACTIVATIONS)
def test_fused_moe_delta_forward(fmt, activation):
    """out equals kt.fused_moe's reference with the deltas added to the pre-activations; h is act(g) * u."""
    E, H, I, T, K = 5, 64, 32, 9, 3
    packed = _packed(E, H, I, fmt)
    ids, weights = _routing(T, K, E, "skips")
    hidden = torch.randn(T, H, dtype=torch.float64)
    delta = torch.randn(T, K, 2 * I, dtype=torch.float64) * 0.5
    out, h, gu = torch.ops.kt.fused_moe_delta(hidden, ids, weights.double(), *packed.tensors(), delta, activation)
    torch.testing.assert_close(gu, _reference_pre_activations(hidden, ids, packed, delta), rtol=1e-10, atol=1e-12)
    gate_up, down = packed.dequantize()
    act = ACTIVATIONS[ACTIVATION_ALIASES.get(activation, activation)]
    ref_out = torch.zeros(T, H, dtype=torch.float64)
    ref_h = torch.zeros(T, K, I, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            if e < 0:
                continue
            gu = hidden[t] @ gate_up[e].double().T + delta[t, k]
            ref_h[t, k] = act(gu[:I]) * gu[I:]
            ref_out[t] += weights[t, k].double() * (ref_h[t, k] @ down[e].double().T)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(h, ref_h, rtol=1e-10, atol=1e-12)
    # zero deltas: kt.fused_moe's function (fp32 against the fused kernels, which round the activations to bf16 or int8)
    zero = torch.zeros(T, K, 2 * I)
    out32, _, _ = torch.ops.kt.fused_moe_delta(hidden.float(), ids, weights, *packed.tensors(), zero, activation)
    fused = torch.ops.kt.fused_moe(hidden.float(), ids, weights, *packed.tensors(), activation)
    assert relative_error(out32, fused) < 2e-2


@pytest.mark.parametrize("fmt", FORMATS)
def test_opcheck_with_autograd(fmt):
    E, H, I, T, K = 4, 32, 32, 6, 2
    packed = _packed(E, H, I, fmt)
    ids, weights = _routing(T, K, E, "skips")
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    hidden = torch.randn(T, H, requires_grad=True)
    w = weights.clone().requires_grad_()
    torch.library.opcheck(torch.ops.kt.fused_moe.default, (hidden, ids, w, *packed.tensors(), "silu"), test_utils=utils)
    delta = torch.randn(T, K, 2 * I, requires_grad=True)
    torch.library.opcheck(torch.ops.kt.fused_moe_delta.default, (hidden, ids, w, *packed.tensors(), delta, "silu"),
                          test_utils=utils)
    grad_out = torch.randn(T, H)
    torch.library.opcheck(torch.ops.kt.fused_moe_backward.default,
                          (grad_out, hidden.detach(), ids, weights, *packed.tensors(), "silu", delta.detach(),
                           torch.randn(T, K, I)),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    gu = torch.ops.kt.fused_moe_delta(hidden.detach(), ids, weights, *packed.tensors(), delta.detach(), "silu")[2]
    torch.library.opcheck(torch.ops.kt.fused_moe_backward.default,
                          (grad_out, hidden.detach(), ids, weights, *packed.tensors(), "silu", delta.detach(),
                           torch.randn(T, K, I), None, None, gu),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_numa_split_gradients_equal_unsplit():
    E, H, I, T, K = 6, 64, 128, 7, 3
    packed = _packed(E, H, I, "int8")
    split = packed.split_numa(2)
    ids, weights = _routing(T, K, E, "random")
    grads = []
    for experts in (packed, split):
        hidden = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).requires_grad_()
        w = weights.clone().requires_grad_()
        ktorch.fused_moe(hidden, ids, w, experts).sum().backward()
        grads.append((hidden.grad, w.grad))
    # the halves' partial sums add in another order: d hidden up to ~3 here, its partial sums larger, and an element
    # near zero differed by 1.19e-6 (one fp32 ulp at 8; KT_TEST_SEED=3154702948), past an atol of 1e-6
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-5, atol=4e-6)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=1e-5, atol=4e-6)


def test_gradients_match_transformers_eager_experts():
    """A random Qwen3-MoE experts layer in bf16: transformers' eager experts and the packed kt.fused_moe give the
    same d hidden and d routing weights within bf16 tolerance."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=128, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=3)
    eager = Qwen3MoeExperts(config).to(torch.bfloat16)
    with torch.no_grad():
        eager.gate_up_proj.normal_(0, 128**-0.5)
        eager.down_proj.normal_(0, 64**-0.5)
    config._experts_implementation = "eager"
    packed = ktorch.pack_experts(eager.gate_up_proj.detach().float(), eager.down_proj.detach().float(), dtype="bf16")
    T = 33
    ids = torch.stack([torch.randperm(8)[:3] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, 3), -1)
    x = torch.randn(T, 128, dtype=torch.bfloat16)
    grad_out = torch.randn(T, 128, dtype=torch.bfloat16)
    grads = []
    for run in ("eager", "ktorch"):
        h = x.clone().requires_grad_()
        w = weights.to(torch.bfloat16).requires_grad_()
        if run == "eager":
            out = eager(h, ids, w)
        else:
            out = ktorch.fused_moe(h, ids, w, packed)
        out.backward(grad_out)
        grads.append((h.grad, w.grad))
    assert relative_error(grads[1][0], grads[0][0]) < 2e-2
    assert relative_error(grads[1][1], grads[0][1]) < 2e-2


def test_errors_name_the_problem():
    packed = _packed(4, 32, 32, "int8")
    ids, weights = _routing(3, 2, 4, "random")
    hidden, grad_out = torch.randn(3, 32), torch.randn(3, 32)
    with pytest.raises(RuntimeError, match="grad_out must be a float CPU tensor shaped like hidden"):
        torch.ops.kt.fused_moe_backward(grad_out[:2], hidden, ids, weights, *packed.tensors())
    bad = ids.clone()
    bad[1, 1] = 4
    with pytest.raises(RuntimeError, match=r"topk_ids\[1, 1\] = 4 is out of range for 4 experts"):
        torch.ops.kt.fused_moe_backward(grad_out, hidden, bad, weights, *packed.tensors())
    with pytest.raises(RuntimeError, match="gate_up_delta must be a float CPU tensor"):
        torch.ops.kt.fused_moe_delta(hidden, ids, weights, *packed.tensors(), torch.zeros(3, 2, 32))
    with pytest.raises(RuntimeError, match="hidden size mismatch"):
        torch.ops.kt.fused_moe_backward(torch.randn(3, 64), torch.randn(3, 64), ids, weights, *packed.tensors())
    with pytest.raises(RuntimeError, match="activation must be one of"):
        torch.ops.kt.fused_moe_backward(grad_out, hidden, ids, weights, *packed.tensors(), "tanh")
    bf16 = _packed(4, 32, 32, "bf16")
    w13 = bf16.w13.clone().requires_grad_()  # packed bf16 weights asked to train are refused, not silently frozen
    with pytest.raises(RuntimeError, match="frozen"):
        torch.ops.kt.fused_moe(hidden.requires_grad_(), ids, weights, w13, *bf16.tensors()[1:], "silu")


# ---------------------------------------------------------------- the families' forms: parametrized activations,
# relu2, biases, gateless experts


@pytest.mark.parametrize("fmt,gated,activation,biases", list(_family_cases()))
def test_family_backward_equals_float64_reference_gradient(fmt, gated, activation, biases):
    E, H, I, T, K = 6, 64, 64, 13, 3
    packed = _family_packed(E, H, I, fmt, gated, biases)
    ids, weights = _routing(T, K, E, "skips")
    hidden, grad_out = torch.randn(T, H, dtype=torch.float64), torch.randn(T, H, dtype=torch.float64)
    dx, dw, _ = torch.ops.kt.fused_moe_backward(grad_out, hidden, ids, weights.double(), *packed.tensors(), activation,
                                                None, None, *packed.biases())
    rx, rw = _reference_grads(hidden, ids, weights, packed, activation, grad_out)
    torch.testing.assert_close(dx, rx, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dw, rw, rtol=1e-10, atol=1e-12)
    assert (dw[ids < 0] == 0).all()
    # kt.fused_moe_delta with zero deltas is the reference's forward, biases included; its h is the GLU's output
    zero = torch.zeros(T, K, packed.w13.shape[1] * 16, dtype=torch.float64)
    out, h, _ = torch.ops.kt.fused_moe_delta(hidden, ids, weights.double(), *packed.tensors(), zero, activation,
                                          *packed.biases())
    gate_up, down = packed.dequantize()
    want = fused_moe_reference(hidden, ids, weights, gate_up, down, activation, gate_up_bias=packed.w13_bias,
                               down_bias=packed.w2_bias)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    assert h.shape == (T, K, I) and (h[ids < 0] == 0).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("gated,activation", [(True, a) for a in FAMILY_ACTIVATIONS] + [(False, "silu"),
                                                                                         (False, "relu2")])
def test_family_gradcheck_float64(fmt, gated, activation):
    """Finite differences against the op's backward (through the reference forward), and gradcheck of
    kt.fused_moe_delta itself (deltas and h included), with biases."""
    E, H, I, T, K = 4, 32, 32, 5, 2
    packed = _family_packed(E, H, I, fmt, gated, biases=True)
    ids, weights, hidden, w = _gradcheck_through_reference(packed, T, H, K, E, activation)
    delta = torch.randn(T, K, packed.w13.shape[1] * 16, dtype=torch.float64) * 0.3
    while _kink_distance(hidden, ids, packed, activation, delta) < 1e-4:
        delta = torch.randn(T, K, packed.w13.shape[1] * 16, dtype=torch.float64) * 0.3
    delta.requires_grad_()

    def op(x, w, d):
        return torch.ops.kt.fused_moe_delta(x, ids, w, *packed.tensors(), d, activation, *packed.biases())

    assert torch.autograd.gradcheck(op, (hidden, w, delta), fast_mode=True)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("gated,activation", [(True, "swiglu_oai(alpha=1.703125, limit=0.75)"),
                                              (True, "softcap_swiglu(gate=1.5, up=0.75)"), (False, "relu2")])
def test_family_autograd_of_fused_moe(fmt, gated, activation):
    """loss.backward() through ktorch.fused_moe on biased experts: the fused kernels forward, this backward."""
    E, H, I, T, K = 8, 96, 64, 13, 4
    packed = _family_packed(E, H, I, fmt, gated, biases=True)
    ids, weights = _routing(T, K, E, "skips")
    hidden = torch.randn(T, H).requires_grad_()
    w = weights.requires_grad_()
    grad_out = torch.randn(T, H)
    ktorch.fused_moe(hidden, ids, w, packed, activation).backward(grad_out)
    rx, rw = _reference_grads(hidden.detach(), ids, w.detach(), packed, activation, grad_out)
    assert relative_error(hidden.grad, rx) < 1e-5
    assert relative_error(w.grad, rw) < 1e-5


@pytest.mark.parametrize("fmt", FORMATS)
def test_family_opcheck_with_autograd(fmt):
    E, H, I, T, K = 4, 32, 32, 6, 2
    ids, weights = _routing(T, K, E, "skips")
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for gated, activation in ((True, "swiglu_oai(alpha=1.703125, limit=0.75)"), (False, "relu2")):
        packed = _family_packed(E, H, I, fmt, gated, biases=True)
        hidden = torch.randn(T, H, requires_grad=True)
        w = weights.clone().requires_grad_()
        torch.library.opcheck(torch.ops.kt.fused_moe.default,
                              (hidden, ids, w, *packed.tensors(), activation, *packed.biases()), test_utils=utils)
        delta = torch.randn(T, K, packed.w13.shape[1] * 16, requires_grad=True)
        torch.library.opcheck(torch.ops.kt.fused_moe_delta.default,
                              (hidden, ids, w, *packed.tensors(), delta, activation, *packed.biases()),
                              test_utils=utils)
        torch.library.opcheck(torch.ops.kt.fused_moe_backward.default,
                              (torch.randn(T, H), hidden.detach(), ids, weights, *packed.tensors(), activation,
                               delta.detach(), torch.randn(T, K, I), *packed.biases()),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_family_errors_name_the_problem():
    packed = _family_packed(4, 32, 32, "int8", gated=False, biases=True)
    ids, weights = _routing(3, 2, 4, "random")
    hidden, grad_out = torch.randn(3, 32), torch.randn(3, 32)
    with pytest.raises(RuntimeError, match="needs a gate, but w13 holds only up projections"):
        torch.ops.kt.fused_moe_backward(grad_out, hidden, ids, weights, *packed.tensors(), "silu_clamped(limit=1)",
                                        None, None, *packed.biases())
    with pytest.raises(RuntimeError, match=r"w2_bias must be a contiguous float32 CPU tensor \[E=4, 32\]"):
        torch.ops.kt.fused_moe_backward(grad_out, hidden, ids, weights, *packed.tensors(), "relu2", None, None,
                                        packed.w13_bias, packed.w2_bias[:, :16].contiguous())
    with pytest.raises(RuntimeError, match=r"gate_up_delta must be a float CPU tensor \[T=3, K=2, I=32\]"):
        torch.ops.kt.fused_moe_delta(hidden, ids, weights, *packed.tensors(), torch.zeros(3, 2, 64), "relu2")
    with pytest.raises(RuntimeError, match="limit of swiglu_oai must be positive"):
        torch.ops.kt.fused_moe_backward(grad_out, hidden, ids, weights, *_packed(4, 32, 32, "int8").tensors(),
                                        "swiglu_oai(alpha=1, limit=0)")
    b13 = packed.w13_bias.clone().requires_grad_()  # biases asked to train are refused, not silently frozen
    with pytest.raises(RuntimeError, match="w13_bias requires grad"):
        torch.ops.kt.fused_moe(hidden.requires_grad_(), ids, weights, *packed.tensors(), "relu2", b13, packed.w2_bias)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_backward_in_slices_equals_float64_reference_gradient(fmt, gated, dtype):
    """At H = 2048 every product decodes its weights in several slices (256 KiB of rows each; gated, float64: dY W2
    in 4 slices of 32 of I's 128 rows, [dg | du] W13 in 16 of 128 of H's 2048 rows, the recompute's x W13^T in 4 of
    32 gate rows with their up rows; int4 groups of 64, which the 32-row slices cut): float64 equals the float64
    reference to rounding, bf16 is within the bf16 tolerances, with and without the saved pre-activations."""
    E, H, I, T, K = 4, 2048, 128, 13, 2
    packed = _family_packed(E, H, I, fmt, gated, biases=False, group_size=64)
    activation = "silu" if gated else "relu2"
    ids, weights = _routing(T, K, E, "skips")
    n13 = packed.w13.shape[1] * 16
    hidden, grad_out = torch.randn(T, H).to(dtype), torch.randn(T, H).to(dtype)
    delta = torch.randn(T, K, n13, dtype=torch.float64) * 0.3
    w = weights.to(torch.float64 if dtype == torch.float64 else torch.float32)
    _, _, gu = torch.ops.kt.fused_moe_delta(hidden, ids, w, *packed.tensors(), delta.to(w.dtype), activation)
    args = (grad_out, hidden, ids, w, *packed.tensors(), activation, delta.to(w.dtype), None)
    gate_up, down = packed.dequantize()
    rx, rw, rd = (t.double().clone().requires_grad_() for t in (hidden, w, delta))
    ref = fused_moe_reference(rx, ids, rw, gate_up, down, activation, gate_up_delta=rd)
    ref.backward(grad_out.double())
    for how, got in (("recomputed", torch.ops.kt.fused_moe_backward(*args)),
                     ("saved", torch.ops.kt.fused_moe_backward(*args, None, None, gu))):
        for name, a, b in zip(("hidden", "weights", "delta"), got, (rx.grad, rw.grad, rd.grad)):
            what = f"{fmt} gated={gated} {dtype} {how} d {name}"
            if dtype == torch.float64:
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=lambda m: f"{what}: {m}")
            else:
                tol = {"bf16": 2e-2, "int8": 4e-2, "int4": 8e-2}[fmt]
                assert relative_error(a, b) < tol, f"{what}: {relative_error(a, b):.4g} from the reference"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("threads", [2, 4])
def test_busy_expert_cut_into_pieces_equals_float64_reference_gradient(fmt, dtype, threads, capfd):
    """Skewed routing, as a random model's busiest experts take nearly every token: every token's first slot goes to
    expert 0 (600 of 1200 pairs), so the backward cuts its pairs into pieces for several workers (the profile line
    counts more tasks than experts), each piece's rows of d hidden, d weights and d delta written where they belong:
    float64 equals the float64 reference to rounding, bf16 is within the bf16 tolerances."""
    E, H, I, T, K = 8, 64, 32, 600, 2
    packed = _packed(E, H, I, fmt)
    ids, weights = _routing(T, K, E, "random")
    ids[:, 0] = 0
    ids[::7, 1] = -1  # some skipped slots too
    n13 = 2 * I
    hidden, grad_out = torch.randn(T, H).to(dtype), torch.randn(T, H).to(dtype)
    delta = torch.randn(T, K, n13, dtype=torch.float64) * 0.3
    w = weights.to(torch.float64 if dtype == torch.float64 else torch.float32)
    _, _, gu = torch.ops.kt.fused_moe_delta(hidden, ids, w, *packed.tensors(), delta.to(w.dtype), "silu")
    dh = torch.randn(T, K, I, dtype=torch.float64)
    gate_up, down = packed.dequantize()
    rx, rw, rd = (t.double().clone().requires_grad_() for t in (hidden, w, delta))
    ref, ref_h = fused_moe_reference(rx, ids, rw, gate_up, down, "silu", gate_up_delta=rd, return_h=True)
    torch.autograd.backward((ref, ref_h), (grad_out.double(), dh.to(dtype).double()))
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ktorch.config.set_profile(True)
        got = torch.ops.kt.fused_moe_backward(grad_out, hidden, ids, w, *packed.tensors(), "silu", delta.to(w.dtype),
                                              dh.to(dtype), None, None, gu)
    finally:
        ktorch.config.set_profile(False)
        torch.set_num_threads(n)
    line = [l for l in capfd.readouterr().err.splitlines() if "fused_moe_backward" in l][-1]
    experts, tasks = (int(re.search(rf"{k}=(\d+)", line).group(1)) for k in ("experts", "tasks"))
    assert experts == E and tasks > experts, line
    for name, a, b in zip(("hidden", "weights", "delta"), got, (rx.grad, rw.grad, rd.grad)):
        what = f"{fmt} {dtype} {threads} threads d {name}"
        if dtype == torch.float64:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=lambda m: f"{what}: {m}")
        else:
            tol = {"bf16": 2e-2, "int8": 4e-2, "int4": 8e-2}[fmt]
            assert relative_error(a, b) < tol, f"{what}: {relative_error(a, b):.4g} from the reference"


@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_decode_is_the_weights_rounded_to_bf16(kernel, fmt, one_thread):
    """bf16 hidden states run the backward on experts decoded to bf16 (rounded to nearest even) by its own block walks:
    W13 as stored for the recompute x W13^T, W2 and W13 transposed for dY W2 and [dg | du] W13 (into the packed bf16
    kernels' layout at the avx512 and amx levels, row-major for ATen's matmul at the portable one). With one-hot rows of x and
    dY every product reads single weights: with relu, routing weights 1 and zero deltas, d delta = [dh * u * (g > 0) |
    dh * relu(g)], [g | u] = x W13^T and dh = dY W2, equals torch's fp32 arithmetic on kt.unpack's weights rounded
    to bf16 bit for bit (every row of W2 read by the transposed decode, both halves of every 64-row gate/up block,
    every int4 group); d hidden ([dg | du] W13 through the transposed gate/up decode, each pair's row rounded to
    bf16, summed over slots in fp32 and rounded once) within that rounding of the float64 product (relative norm)."""
    E, H, I, K = 3, 256, 96, 2
    T = H
    packed = _packed(E, H, I, fmt)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    eye = torch.eye(H, dtype=torch.bfloat16)
    x = eye[(torch.arange(T) * 7 + 3) % H]  # token t reads column (7 t + 3) % H of W13
    dy = eye  # token t reads row t of W2: every row
    dx, _, dd = torch.ops.kt.fused_moe_backward(dy, x, ids, torch.ones(T, K), *packed.tensors(), "relu",
                                                torch.zeros(T, K, 2 * I), None)
    gate_up, down = (w.to(torch.bfloat16).float() for w in packed.dequantize())
    want_dx = torch.zeros(T, H, dtype=torch.float64)
    for e in range(E):
        t, k = (ids == e).nonzero(as_tuple=True)
        gu = x[t].float() @ gate_up[e].t()  # one-hot rows: single weights, exact in fp32
        dh = dy[t].float() @ down[e]
        g, u = gu[:, :I], gu[:, I:]
        want = torch.cat([torch.where(g > 0, dh * u, torch.zeros_like(g)), dh * torch.relu(g)], 1)
        got = dd[t, k]
        assert torch.equal(got, want), f"expert {e}: {(got != want).sum()} of {want.numel()} differ"
        want_dx.index_add_(0, t, want.to(torch.bfloat16).double() @ gate_up[e].double())
    assert relative_error(dx, want_dx) < 5e-3  # bf16 rounding of the pairs' rows and of the sum: ~2e-3


# ---------------------------------------------------------------- kt.fused_moe_delta on the packed kernels (bf16 and
# fp16 hidden states): kt.fused_moe's path, with the deltas added to each kernel call's gate/up output


def _delta_case(E, H, I, T, K, fmt, gated=True, biases=False, delta_scale=0.5, delta_dtype=torch.bfloat16):
    packed = _family_packed(E, H, I, fmt, gated, biases)
    ids, weights = _routing(T, K, E, "skips")
    hidden = torch.randn(T, H).to(torch.bfloat16)
    delta = (torch.randn(T, K, packed.w13.shape[1] * 16) * delta_scale).to(delta_dtype)
    return packed, ids, weights, hidden, delta


def _reference_pre_activations(hidden, ids, packed, delta):
    """[T, K, N13] float64: each routed pair's x W13_e^T + its gate/up bias + its delta (zeros for skipped slots), on
    kt.unpack's weights: what kt.fused_moe_delta's third output holds."""
    gate_up, _ = packed.dequantize()
    T, K = ids.shape
    gu = torch.zeros(T, K, gate_up.shape[1], dtype=torch.float64)
    for t, k in (ids >= 0).nonzero().tolist():
        e = int(ids[t, k])
        gu[t, k] = hidden[t].double() @ gate_up[e].double().T + delta[t, k].double()
        if packed.w13_bias is not None:
            gu[t, k] += packed.w13_bias[e].double()
    return gu


def _check_delta_forward(out, h, hidden, ids, weights, packed, delta, activation, what, pre=None):
    """out and h (and pre, kt.fused_moe_delta's third output: the pre-activations, when given) against the float64 reference with the deltas,
    within kt.fused_moe's own tolerances (its kernels round the activations to bf16, or to int8 for int formats:
    tests/test_ops_fused_moe.py, TOLERANCE); skipped slots' h and gate_up rows exactly zero."""
    gate_up, down = packed.dequantize()
    ref, ref_h = fused_moe_reference(hidden, ids, weights, gate_up, down, activation, gate_up_bias=packed.w13_bias,
                                     down_bias=packed.w2_bias, gate_up_delta=delta, return_h=True)
    T, K = ids.shape
    assert out.shape == hidden.shape and out.dtype == hidden.dtype, what
    assert h.shape == (T, K, down.shape[2]) and h.dtype == hidden.dtype and h.is_contiguous(), what
    tol = DELTA_TOLERANCE[packed.format] * (4 / 3 if packed.format != "bf16" and T < 4 else 1)
    err_out, err_h = relative_error(out, ref), relative_error(h, ref_h)
    assert err_out <= tol, f"{what}: out relative error {err_out:.4g} > {tol}"
    assert err_h <= tol, f"{what}: h relative error {err_h:.4g} > {tol}"
    assert (h[ids < 0] == 0).all(), what
    if pre is not None:
        ref_pre = _reference_pre_activations(hidden, ids, packed, delta)
        assert pre.shape == ref_pre.shape and pre.dtype == hidden.dtype and pre.is_contiguous(), what
        err_pre = relative_error(pre, ref_pre)
        assert err_pre <= tol, f"{what}: gate_up relative error {err_pre:.4g} > {tol}"
        assert (pre[ids < 0] == 0).all(), what


# kt.fused_moe's tolerances against the float64 reference (tests/test_ops_fused_moe.py, TOLERANCE)
DELTA_TOLERANCE = {"bf16": 1e-2, "int8": 3e-2, "int4": 8e-2}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("T", [1, 6, 45, 300])
def test_delta_forward_on_the_packed_kernels(kernel, fmt, T, seed):
    """bf16 hidden: each task plan of kt.fused_moe (split channels with a separate h quantization at small T, whole
    experts a task with the GLU as the next call's side work at large T) with bf16 deltas, at every kernel level
    here: out and h within kt.fused_moe's tolerance of the float64 reference; zero deltas give kt.fused_moe's output
    bit for bit; a repeat is the same bit for bit."""
    E, K, H, I = 7, 3, 192, 320
    packed, ids, weights, hidden, delta = _delta_case(E, H, I, T, K, fmt)
    what = f"seed={seed} {kernel} {fmt} T={T}"
    out, h, gu = torch.ops.kt.fused_moe_delta(hidden, ids, weights, *packed.tensors(), delta, "silu")
    _check_delta_forward(out, h, hidden, ids, weights, packed, delta, "silu", what, gu)
    again, h_again, _ = torch.ops.kt.fused_moe_delta(hidden, ids, weights, *packed.tensors(), delta, "silu")
    assert torch.equal(again, out) and torch.equal(h_again, h), f"{what}: a repeat differs"
    zero, _, _ = torch.ops.kt.fused_moe_delta(hidden, ids, weights, *packed.tensors(), torch.zeros_like(delta), "silu")
    assert torch.equal(zero, torch.ops.kt.fused_moe(hidden, ids, weights, *packed.tensors(), "silu")), what
    # the deltas do change the result (B != 0: the test means something)
    assert relative_error(out, zero) > 0.05, what


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("gated,activation,biases",
                         [(True, a, b) for a in OP_ACTIVATIONS[1:] + FAMILY_ACTIVATIONS for b in (False, True)]
                         + [(False, a, True) for a in GATELESS_ACTIVATIONS])
def test_delta_forward_activations_biases_gateless(kernel, fmt, gated, activation, biases, seed):
    """The kernels' GLU (silu .. relu without biases) and the driver's epilogue (biases, relu2, the clamped and
    softcapped activations, gateless experts) both see the deltas, added before them."""
    E, K, H, I, T = 5, 2, 96, 96, 37  # I = 96: gateless experts' last gate/up call covers 32 channels
    packed, ids, weights, hidden, delta = _delta_case(E, H, I, T, K, fmt, gated, biases)
    out, h, gu = torch.ops.kt.fused_moe_delta(hidden, ids, weights, *packed.tensors(), delta, activation,
                                              *packed.biases())
    _check_delta_forward(out, h, hidden, ids, weights, packed, delta, activation,
                         f"seed={seed} {kernel} {fmt} {activation} biases={biases} gated={gated}", gu)
    zero = torch.zeros_like(delta)
    z, _, _ = torch.ops.kt.fused_moe_delta(hidden, ids, weights, *packed.tensors(), zero, activation, *packed.biases())
    assert torch.equal(z, torch.ops.kt.fused_moe(hidden, ids, weights, *packed.tensors(), activation,
                                                 *packed.biases()))


@pytest.mark.parametrize("fmt", FORMATS)
def test_delta_dtypes_and_layouts_and_fp16_hidden(kernel, fmt, seed):
    """bf16 deltas are read in place, any other float dtype or layout through fp32: the same values give the same
    output bit for bit. fp16 hidden gives fp16 out and h, within tolerance."""
    E, K, H, I, T = 6, 3, 128, 64, 29
    packed, ids, weights, hidden, delta = _delta_case(E, H, I, T, K, fmt)
    base = torch.ops.kt.fused_moe_delta(hidden, ids, weights, *packed.tensors(), delta, "gelu")
    strided = delta.float().transpose(0, 1).contiguous().transpose(0, 1)  # [T, K, 2I] with T not outermost
    for d in (delta.float(), delta.double(), strided, delta.half()):
        got = torch.ops.kt.fused_moe_delta(hidden, ids, weights, *packed.tensors(), d, "gelu")
        assert all(torch.equal(g, b) for g, b in zip(got, base)), f"seed={seed} delta {d.dtype}"
    h16 = hidden.half()
    out, h, gu = torch.ops.kt.fused_moe_delta(h16, ids, weights, *packed.tensors(), delta.float(), "gelu")
    _check_delta_forward(out, h, h16, ids, weights, packed, delta.float(), "gelu", f"seed={seed} {kernel} fp16", gu)


@pytest.mark.parametrize("fmt", FORMATS)
def test_autograd_through_the_packed_delta_forward(fmt):
    """A bf16 LoRA-style step: the packed-kernel forward, the decoded-expert backward; d hidden, d weights and
    d delta (what trains the gate/up adapters) within bf16 tolerance of torch.autograd on the float64 reference,
    with a down-side loss term on h too (grad_h)."""
    E, K, H, I, T = 6, 3, 96, 64, 21
    packed, ids, weights, hidden, delta = _delta_case(E, H, I, T, K, fmt, delta_scale=0.3)
    x = hidden.clone().requires_grad_()
    w = weights.clone().requires_grad_()
    d = delta.clone().requires_grad_()
    grad_out, grad_h = torch.randn(T, H), torch.randn(T, K, I)
    out, h, _ = torch.ops.kt.fused_moe_delta(x, ids, w, *packed.tensors(), d, "silu")
    torch.autograd.backward((out, h), (grad_out.to(out.dtype), grad_h.to(h.dtype)))
    gate_up, down = packed.dequantize()
    rx, rw, rd = (t.detach().double().requires_grad_() for t in (hidden, weights, delta))
    ref, ref_h = fused_moe_reference(rx, ids, rw, gate_up, down, "silu", gate_up_delta=rd, return_h=True)
    torch.autograd.backward((ref, ref_h), (grad_out.to(torch.bfloat16).double(), grad_h.to(torch.bfloat16).double()))
    tol = {"bf16": 2e-2, "int8": 4e-2, "int4": 8e-2}[fmt]  # the forward's activation rounding feeds h into d weights
    assert x.grad.dtype == torch.bfloat16 and d.grad.dtype == torch.bfloat16
    for name, got, want in (("hidden", x.grad, rx.grad), ("weights", w.grad, rw.grad), ("delta", d.grad, rd.grad)):
        err = relative_error(got, want)
        assert err < tol, f"{fmt} d {name}: relative error {err:.4g}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_delta_autograd_with_unused_outputs(fmt):
    """kt.fused_moe_delta's autograd makes no zero gradients for outputs nothing differentiated (gate_up always, h
    or out when unused): the gradients are those of the same loss with a zero term on them, bit for bit."""
    E, K, H, I, T = 6, 3, 96, 64, 21
    packed, ids, weights, hidden, delta = _delta_case(E, H, I, T, K, fmt, delta_scale=0.3)
    grad_out, grad_h = torch.randn(T, H).to(hidden.dtype), torch.randn(T, K, I).to(hidden.dtype)

    def grads(use_out: bool, use_h: bool, zero_terms: bool):
        x, w, d = (t.clone().requires_grad_() for t in (hidden, weights, delta))
        out, h, _ = torch.ops.kt.fused_moe_delta(x, ids, w, *packed.tensors(), d, "silu")
        loss = (out.float() * grad_out.float()).sum() if use_out else (out.float() * 0).sum() if zero_terms else 0
        loss = loss + ((h.float() * grad_h.float()).sum() if use_h else (h.float() * 0).sum() if zero_terms else 0)
        return torch.autograd.grad(loss, (x, w, d))

    for use_out, use_h in ((True, False), (False, True)):
        for a, b in zip(grads(use_out, use_h, False), grads(use_out, use_h, True)):
            assert torch.equal(a, b), (fmt, use_out, use_h)

    from torch.utils._python_dispatch import TorchDispatchMode

    class Shapes(TorchDispatchMode):  # every tensor the backward makes
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.made += [(str(func), tuple(o.shape)) for o in (out if isinstance(out, (tuple, list)) else (out,))
                          if isinstance(o, torch.Tensor)]
            return out

    x = hidden.clone().requires_grad_()
    out, h, _ = torch.ops.kt.fused_moe_delta(x, ids, weights, *packed.tensors(), delta, "silu")
    loss = (out.float() * grad_out.float()).sum()
    with Shapes() as mode:
        loss.backward()
    # only the op itself makes pair-sized tensors (its d delta); no zeros for gate_up or h
    assert not [m for m in mode.made if m[1] in ((T, K, 2 * I), (T, K, I)) and "fused_moe_backward" not in m[0]], mode.made


@pytest.mark.parametrize("hidden_dtype", [torch.bfloat16, torch.float32])
def test_delta_autograd_keeps_no_hidden_or_deltas(hidden_dtype):
    """kt.fused_moe_delta's autograd saves the pre-activations, and for hidden and the deltas (whose values its
    backward does not read) stride-0 stand-ins: no memory kept; the gradients are unchanged (the backward with the
    real tensors, called directly)."""
    E, K, H, I, T = 6, 3, 96, 64, 21
    packed, ids, weights, hidden, delta = _delta_case(E, H, I, T, K, "int8", delta_scale=0.3)
    hidden, delta = hidden.to(hidden_dtype), delta.to(hidden_dtype)
    x, w, d = (t.clone().requires_grad_() for t in (hidden, weights, delta))
    packs = []

    def pack(t):
        packs.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, h, gu = torch.ops.kt.fused_moe_delta(x, ids, w, *packed.tensors(), d, "silu")
    for shape in (tuple(hidden.shape), tuple(delta.shape)):
        kept = [t for t in packs if tuple(t.shape) == shape and t.dtype == hidden_dtype]
        assert kept and all(t.stride() == (0,) * len(shape) for t in kept if t.data_ptr() != gu.data_ptr()), shape
    grad_out, grad_h = torch.randn(T, H).to(hidden_dtype), torch.randn(T, K, I).to(hidden_dtype)
    got = torch.autograd.grad((out, h), (x, w, d), (grad_out, grad_h))
    want = torch.ops.kt.fused_moe_backward(grad_out, hidden, ids, weights, *packed.tensors(), "silu", delta, grad_h,
                                           None, None, gu.detach())
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_packed_delta_forward_errors_and_opcheck():
    packed = _packed(4, 32, 32, "int8")
    ids, weights = _routing(6, 2, 4, "skips")
    hidden = torch.randn(6, 32).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"gate_up_delta must be a float CPU tensor \[T=6, K=2, 2I=64\]"):
        torch.ops.kt.fused_moe_delta(hidden, ids, weights, *packed.tensors(), torch.zeros(6, 2, 32))
    with pytest.raises(RuntimeError, match="gate_up_delta must be a float CPU tensor"):
        torch.ops.kt.fused_moe_delta(hidden, ids, weights, *packed.tensors(), torch.zeros(6, 2, 64, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="hidden size mismatch"):
        torch.ops.kt.fused_moe_delta(torch.randn(6, 64).bfloat16(), ids, weights, *packed.tensors(),
                                     torch.zeros(6, 2, 64))
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    delta = torch.randn(6, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    torch.library.opcheck(torch.ops.kt.fused_moe_delta.default,
                          (hidden.requires_grad_(), ids, weights.requires_grad_(), *packed.tensors(), delta, "silu"),
                          test_utils=utils)


def test_backward_with_fewer_experts_than_threads():
    """Fewer routed experts than threads: one expert at a time, its decode split over the workers by blocks and its
    products multi-threaded (fused_moe_backward.cpp, for_each_expert; the busiest expert's rows x H x 2I above
    kMinThreadedMacs, 2^20, here >= 16 x 256 x 512 with 3 experts used; tiny products run one expert a worker).
    float64: the reference gradients; bf16: the float64 op's result within bf16 rounding, d delta included."""
    E, H, I, T, K = 6, 256, 256, 23, 2
    packed = _packed(E, H, I, "int8")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        for used in (1, 3):  # experts with pairs: both fewer than the 4 threads
            ids = torch.randint(0, used, (T, K))
            ids[0, 1] = -1
            weights = torch.rand(T, K)
            hidden, grad_out = torch.randn(T, H, dtype=torch.float64), torch.randn(T, H, dtype=torch.float64)
            dx, dw, _ = torch.ops.kt.fused_moe_backward(grad_out, hidden, ids, weights.double(), *packed.tensors(),
                                                        "silu")
            rx, rw = _reference_grads(hidden, ids, weights, packed, "silu", grad_out)
            torch.testing.assert_close(dx, rx, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(dw, rw, rtol=1e-10, atol=1e-12)
            # bf16 with deltas (the bf16 products, fp32 element-wise work): within bf16 rounding of the float64 op
            delta = torch.randn(T, K, 2 * I) * 0.3
            x16, dy16 = hidden.to(torch.bfloat16), grad_out.to(torch.bfloat16)
            bx, bw, bd = torch.ops.kt.fused_moe_backward(dy16, x16, ids, weights, *packed.tensors(), "silu", delta,
                                                         None)
            fx, fw, fd = torch.ops.kt.fused_moe_backward(dy16.double(), x16.double(), ids, weights.double(),
                                                         *packed.tensors(), "silu", delta.double(), None)
            assert relative_error(bx, fx) < 2e-2 and relative_error(bw, fw) < 2e-2 and relative_error(bd, fd) < 2e-2
            assert (bd[ids < 0] == 0).all() and (bw[ids < 0] == 0).all()
    finally:
        torch.set_num_threads(threads)


def _exact_layout(kind: str, E: int, H: int, I: int):
    """Packed experts in the layouts the exact GGUF types load into (ktorch.ops.moe.pack_quantized, pack_kscales;
    docs/loading.md), codes and scales of the types' ranges: (w13, w13_scales, w2, w2_scales).

    Q4_K_M   affine int4 gate/up (Q4_K: codes 0..15, a float32 scale and minimum per 32) beside grouped int8 down
             (Q6_K: codes -32..31, a scale per 16): two formats in one call
    Q5_K_Q8_0  affine int8 gate/up (Q5_K: codes 0..31, scale and minimum per 32) beside grouped int8 down with
             float16 scales per 32 (Q8_0's d)
    Q4_K_Q6_K_two_level  Q4_K_M's codes with the scales at the file's size (pack_kscales: uint8 sub-scales and
             minimums times float32 super-scales per 256; int8 sub-scales for Q6_K), K a multiple of 256
    Q4_0     symmetric int4 per 32 (codes -8..7) beside per-channel int8"""
    from ktorch.ops.moe import pack_kscales, pack_quantized

    codes13 = torch.randint(0, 16, (E, 2 * I, H))
    if kind in ("Q4_K_M", "Q4_K_Q6_K_two_level"):
        if kind == "Q4_K_M":
            s13 = torch.rand(E, 2 * I, H // 32) * 0.02 + 0.01
            m13 = s13 * 7.5 + torch.randn(E, 2 * I, H // 32) * 0.005
        else:  # a float32 d (and dmin) per 256, 6-bit sub-scales and sub-minimums per 32
            d, dmin = torch.rand(E, 2 * I, H // 256) * 4e-4 + 2e-4, torch.rand(E, 2 * I, H // 256) * 4e-4 + 2e-4
            sub, sub_m = torch.randint(1, 64, (E, 2 * I, H // 32), dtype=torch.uint8), \
                torch.randint(0, 64, (E, 2 * I, H // 32), dtype=torch.uint8)
            s13 = d.repeat_interleave(8, dim=2) * sub.float()
            m13 = dmin.repeat_interleave(8, dim=2) * sub_m.float()
        w13, sc13 = pack_quantized(codes13, s13, m13, bits=4, gate_up=True)
        codes2 = torch.randint(-32, 32, (E, H, I))
        if kind == "Q4_K_M":
            w2, sc2 = pack_quantized(codes2, torch.rand(E, H, I // 16) * 0.004 + 0.002, None, bits=8)
        else:
            d2 = torch.rand(E, H, I // 256) * 1e-4 + 5e-5
            sub2 = torch.randint(-128, 128, (E, H, I // 16), dtype=torch.int8)
            w2, _ = pack_quantized(codes2, d2.repeat_interleave(16, dim=2) * sub2.float(), None, bits=8)
            sc13 = pack_kscales(sub, d, sub_m, dmin, gate_up=True)
            sc2 = pack_kscales(sub2, d2)
    elif kind == "Q5_K_Q8_0":
        s13 = torch.rand(E, 2 * I, H // 32) * 0.005 + 0.002
        w13, sc13 = pack_quantized(torch.randint(0, 32, (E, 2 * I, H)), s13, s13 * 15.5, bits=8, gate_up=True)
        w2, sc2 = pack_quantized(torch.randint(-127, 128, (E, H, I)), torch.rand(E, H, I // 32) * 4e-4 + 2e-4, None,
                                 bits=8)
        sc2 = sc2.half()  # Q8_0's d at the file's size
    elif kind == "Q4_0":
        w13, sc13 = pack_quantized(torch.randint(-8, 8, (E, 2 * I, H)), torch.rand(E, 2 * I, H // 32) * 0.03 + 0.01,
                                   None, bits=4, gate_up=True)
        w2, sc2 = pack_quantized(torch.randint(-127, 128, (E, H, I)), torch.rand(E, H, 1) * 4e-4 + 2e-4, None, bits=8)
    else:
        raise ValueError(kind)
    return w13, sc13, w2, sc2


EXACT_LAYOUTS = ("Q4_K_M", "Q5_K_Q8_0", "Q4_K_Q6_K_two_level", "Q4_0")


def _exact_shapes(kind):  # E, H, I, T, K (the two-level scales need H and I multiples of 256)
    return (3, 256, 256, 9, 2) if kind == "Q4_K_Q6_K_two_level" else (4, 128, 64, 19, 2)


@pytest.mark.parametrize("kind", EXACT_LAYOUTS)
def test_backward_on_exact_gguf_layouts_equals_float64_reference_gradient(kind):
    """The backward decodes every layout the exact GGUF types load into (grouped and affine int8, affine int4, float16
    and two-level scales, two formats in one call): float64 d hidden, d weights and d delta equal torch.autograd on
    the float64 reference over kt.unpack's weights (the file's values) to rounding; with the forward's saved
    pre-activations too; bf16 within bf16 rounding of the float64 op."""
    E, H, I, T, K = _exact_shapes(kind)
    tensors = _exact_layout(kind, E, H, I)
    gate_up = torch.ops.kt.unpack(tensors[0], tensors[1], gate_up=True)
    down = torch.ops.kt.unpack(tensors[2], tensors[3], gate_up=False)
    ids, weights = _routing(T, K, E, "skips")
    ids[1, 1] = ids[1, 0] = 1  # a repeated expert
    hidden = (torch.randn(T, H, dtype=torch.float64) * 2).requires_grad_()
    w = weights.double().requires_grad_()
    delta = (torch.randn(T, K, 2 * I, dtype=torch.float64) * 0.3).requires_grad_()
    ref = fused_moe_reference(hidden, ids, w, gate_up, down, "silu", gate_up_delta=delta)
    scale = ref.abs().mean()
    grad_out = torch.randn(T, H, dtype=torch.float64) / scale
    rx, rw, rd = torch.autograd.grad(ref, (hidden, w, delta), grad_out)
    args = (grad_out, hidden.detach(), ids, w.detach(), *tensors, "silu", delta.detach(), None)
    dx, dw, dd = torch.ops.kt.fused_moe_backward(*args)
    for got, want in ((dx, rx), (dw, rw), (dd, rd)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10 * want.abs().max().item())
    out, _, gu = torch.ops.kt.fused_moe_delta(hidden.detach(), ids, w.detach(), *tensors, delta.detach(), "silu")
    torch.testing.assert_close(out, ref.detach(), rtol=1e-10, atol=1e-10 * ref.abs().max().item())
    saved = torch.ops.kt.fused_moe_backward(*args, None, None, gu)
    for got, want in zip(saved, (dx, dw, dd)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10 * want.abs().max().item())
    bf = torch.ops.kt.fused_moe_backward(grad_out.bfloat16(), hidden.detach().bfloat16(), ids, weights, *tensors,
                                         "silu", delta.detach().bfloat16(), None)
    full = torch.ops.kt.fused_moe_backward(grad_out.bfloat16().double(), hidden.detach().bfloat16().double(), ids,
                                           weights.double(), *tensors, "silu", delta.detach().bfloat16().double(),
                                           None)
    # The bf16 op quantizes activations to int8 a row (the forward's own path: 2-3% a token on these layouts, the
    # forward tests' 3e-2); d weights is 18 dot products of grad_out with the recomputed expert outputs, and one
    # token's shared error reached 2.2% in CI (KT_TEST_SEED=1637122252), against a typical 0.3%.
    for got, want in zip(bf, full):
        assert relative_error(got, want) < 3e-2, kind


@pytest.mark.parametrize("kind", EXACT_LAYOUTS)
def test_exact_gguf_layouts_gradcheck_and_opcheck(kind):
    """gradcheck (float64, finite differences of the op's own forward) of kt.fused_moe_delta and the autograd of
    kt.fused_moe on the exact layouts; opcheck of the three ops with them."""
    E, H, I, T, K = (3, 256, 256, 3, 2) if kind == "Q4_K_Q6_K_two_level" else (3, 64, 32, 4, 2)
    tensors = _exact_layout(kind, E, H, I)
    ids, weights = _routing(T, K, E, "skips")
    hidden = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    w = weights.double().requires_grad_()
    delta = (torch.randn(T, K, 2 * I, dtype=torch.float64) * 0.3).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w, d: torch.ops.kt.fused_moe_delta(x, ids, w, *tensors, d, "silu"),
                                    (hidden, w, delta), fast_mode=True)
    x32, w32 = hidden.detach().float().requires_grad_(), weights.clone().requires_grad_()
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.kt.fused_moe.default, (x32, ids, w32, *tensors, "silu"), test_utils=utils)
    d32 = delta.detach().float().requires_grad_()
    torch.library.opcheck(torch.ops.kt.fused_moe_delta.default, (x32, ids, w32, *tensors, d32, "silu"),
                          test_utils=utils)
    torch.library.opcheck(torch.ops.kt.fused_moe_backward.default,
                          (torch.randn(T, H), x32.detach(), ids, weights, *tensors, "silu", d32.detach(),
                           torch.randn(T, K, I)),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_packed_weights_and_scales_errors_name_the_problem():
    """describe_packed's checks of a packed weight and its scales (fused_moe_backward.cpp), in kt.fused_moe_backward
    and kt.fused_moe_delta: each bad input passes every check before the one it is for, and the message names that
    check (its dtype, the minimums MXFP4 takes none of, two-level scales' K and rows, the group sizes)."""
    from ktorch.ops.moe import pack_quantized

    E, T, K = 4, 3, 2
    ids, weights = _routing(T, K, E, "random")

    def backward(H, w13, s13, w2, s2):
        torch.ops.kt.fused_moe_backward(torch.randn(T, H), torch.randn(T, H), ids, weights, w13, s13, w2, s2)

    def delta(H, w13, s13, w2, s2):  # gated: the delta [T, K, 2I], 2I = w13's rows
        torch.ops.kt.fused_moe_delta(torch.randn(T, H), ids, weights, w13, s13, w2, s2,
                                     torch.zeros(T, K, w13.shape[1] * 16))

    H, I = 64, 32
    w13, s13, w2, s2 = _packed(E, H, I, "int8").tensors()  # per-channel int8: scales [E, 1, N]
    for op in (backward, delta):  # scales neither float32, float16 nor two-level uint8/int8
        with pytest.raises(RuntimeError, match=r"w13_scales must be .* in float32 or float16, or two-level "
                                               r"uint8/int8 .* got Double \[4, 1, 64\]"):
            op(H, w13, s13.double(), w2, s2)
        with pytest.raises(RuntimeError, match=r"w2_scales must be .* in float32 or float16, or two-level "
                                               r"uint8/int8 .* got Int \[4, 1, 64\]"):
            op(H, w13, s13, w2, s2.int())
    # MXFP4 nibbles take scales [E, G, N]: the same scales twice as [E, 2, G, N] (scales and minimums) are refused
    m13, ms13 = pack_quantized(torch.zeros(E, 2 * I, H, dtype=torch.int8), torch.full((E, 2 * I, H // 32), 0.01),
                               bits=4, gate_up=True, mxfp4=True)
    assert m13.dtype == torch.float4_e2m1fn_x2
    backward(H, m13, ms13, w2, s2)  # without the minimums the call runs
    with pytest.raises(RuntimeError, match=r"w13 holds MXFP4 nibbles \(float4_e2m1fn_x2\), which take scales "
                                           r"\[E, G, N\], but w13_scales has minimums too"):
        backward(H, m13, torch.stack((ms13, ms13), 1), w2, s2)
    # grouped and affine int8: groups of 8 input channels (K=64, G=8)
    for bad in (torch.ones(E, 8, 2 * I), torch.ones(E, 2, 8, 2 * I)):
        with pytest.raises(RuntimeError, match="int8 w13_scales has 8 groups of 8 input channels; grouped or affine "
                                               "int8 needs groups of a multiple of 16"):
            backward(H, w13, bad, w2, s2)
    # int4: groups of 16 (K=64, G=4)
    q13, _, q2, qs2 = _packed(E, H, I, "int4").tensors()
    with pytest.raises(RuntimeError, match="int4 w13_scales has 4 groups of 16 input channels; int4 needs groups of "
                                           "a multiple of 32"):
        delta(H, q13, torch.ones(E, 4, 2 * I), q2, qs2)
    # groups that do not divide K (3 of K=64), or none
    for G in (3, 0):
        with pytest.raises(RuntimeError, match=f"w13_scales has {G} groups, which do not divide K=64"):
            backward(H, w13, torch.ones(E, G, 2 * I), w2, s2)
    # two-level (uint8/int8 sub-scales, then the float32 super-scales per 256 input channels as K/64 byte rows)
    with pytest.raises(RuntimeError, match=r"two-level w13_scales \[4, 2, 3, 64\] needs K a multiple of 256 and "
                                           r"more than K/64 rows, K=64"):
        backward(H, q13, torch.ones(E, 2, 3, 2 * I, dtype=torch.uint8), q2, qs2)
    H, I = 256, 256
    t13, ts13, t2, ts2 = _exact_layout("Q4_K_Q6_K_two_level", 2, H, I)  # ts13 [2, 2, 8 + 4, 512]: G = 8, 1 super
    ids, weights = _routing(T, K, 2, "random")
    backward(H, t13, ts13, t2, ts2)  # as built, the call runs
    with pytest.raises(RuntimeError, match=r"two-level w13_scales \[2, 2, 4, 512\] needs K a multiple of 256 and "
                                           r"more than K/64 rows, K=256"):  # the super-scale rows only
        backward(H, t13, ts13[:, :, 8:].contiguous(), t2, ts2)
    with pytest.raises(RuntimeError, match="w13_scales has 3 groups, which do not divide K=256"):  # 3 sub-scale rows
        backward(H, t13, torch.cat((ts13[:, :, :3], ts13[:, :, 8:]), 2), t2, ts2)
    H = 512  # 2 super-scales: 15 sub-scale rows are not a whole number per 256 input channels
    t13, ts13, t2, ts2 = _exact_layout("Q4_K_Q6_K_two_level", 2, H, I)  # ts13 [2, 2, 16 + 8, 512]
    with pytest.raises(RuntimeError, match="two-level w13_scales has 15 sub-scale rows, not a whole number per 256 "
                                           "input channels of K=512"):
        backward(H, t13, torch.cat((ts13[:, :, :15], ts13[:, :, 16:]), 2), t2, ts2)


def test_delta_forward_on_exact_gguf_layouts(kernel, seed):
    """The layouts the exact GGUF formats load into: kt.fused_moe's path (the packed kernels) runs Q4_K_M's (affine
    int4 gate/up beside grouped int8 down) with the deltas too, within its int4 tolerance of the float64 reference;
    its autograd's bf16 gradients are within bf16 rounding of the float64 op's."""
    E, H, I, T, K = 4, 128, 64, 19, 2
    tensors = _exact_layout("Q4_K_M", E, H, I)
    ids, weights = _routing(T, K, E, "skips")
    hidden = torch.randn(T, H).to(torch.bfloat16)
    delta = (torch.randn(T, K, 2 * I) * 0.5).to(torch.bfloat16)
    out, h, _ = torch.ops.kt.fused_moe_delta(hidden, ids, weights, *tensors, delta, "silu")
    gate_up = torch.ops.kt.unpack(tensors[0], tensors[1], gate_up=True)
    down = torch.ops.kt.unpack(tensors[2], tensors[3], gate_up=False)
    ref, ref_h = fused_moe_reference(hidden, ids, weights, gate_up, down, "silu", gate_up_delta=delta, return_h=True)
    assert relative_error(out, ref) <= DELTA_TOLERANCE["int4"], f"seed={seed} {kernel}"
    assert relative_error(h, ref_h) <= DELTA_TOLERANCE["int4"], f"seed={seed} {kernel}"
    assert relative_error(out, torch.ops.kt.fused_moe(hidden, ids, weights, *tensors, "silu")) > 0.05
    x, w, d = hidden.clone().requires_grad_(), weights.clone().requires_grad_(), delta.clone().requires_grad_()
    dy = torch.randn(T, H).bfloat16()
    torch.autograd.backward(torch.ops.kt.fused_moe_delta(x, ids, w, *tensors, d, "silu")[0], dy)
    want = torch.ops.kt.fused_moe_backward(dy.double(), hidden.double(), ids, weights.double(), *tensors, "silu",
                                           delta.double(), None)
    for got, ref_grad in zip((x.grad, w.grad, d.grad), want):
        assert relative_error(got, ref_grad) < 2e-2, f"seed={seed} {kernel}"


# ---------------------------------------------------------------- the saved pre-activations (kt.fused_moe_delta's
# third output, read by the backward instead of recomputing x W13^T)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("gated,activation,biases", [(True, "silu", False), (True, "swiglu_oai(alpha=1.703125, "
                                                     "limit=0.75)", True), (False, "relu2", True)])
def test_saved_pre_activations_give_the_recomputed_gradients(fmt, gated, activation, biases):
    """float64 (the decoded-expert forward, exact): the backward given the forward's gate_up equals the backward
    that recomputes it, d hidden, d weights and d delta, to rounding; the float64 reference's gradients too.
    Skipped and repeated slots; grad_h included."""
    E, H, I, T, K = 5, 64, 32, 11, 3
    packed = _family_packed(E, H, I, fmt, gated, biases)
    ids, weights = _routing(T, K, E, "skips")
    ids[1, 2] = ids[1, 1] = 2  # a repeated expert
    n13 = packed.w13.shape[1] * 16
    hidden = torch.randn(T, H, dtype=torch.float64)
    delta = torch.randn(T, K, n13, dtype=torch.float64) * 0.3
    grad_out, grad_h = torch.randn(T, H, dtype=torch.float64), torch.randn(T, K, I, dtype=torch.float64)
    w = weights.double()
    _, _, gu = torch.ops.kt.fused_moe_delta(hidden, ids, w, *packed.tensors(), delta, activation, *packed.biases())
    args = (grad_out, hidden, ids, w, *packed.tensors(), activation, delta, grad_h, *packed.biases())
    recomputed = torch.ops.kt.fused_moe_backward(*args)
    saved = torch.ops.kt.fused_moe_backward(*args, gu)
    for name, a, b in zip(("hidden", "weights", "delta"), saved, recomputed):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"{fmt} {activation} d {name}: {m}")
    gate_up, down = packed.dequantize()
    rx, rw, rd = (t.clone().requires_grad_() for t in (hidden, w, delta))
    ref, ref_h = fused_moe_reference(rx, ids, rw, gate_up, down, activation, gate_up_bias=packed.w13_bias,
                                     down_bias=packed.w2_bias, gate_up_delta=rd, return_h=True)
    torch.autograd.backward((ref, ref_h), (grad_out, grad_h))
    for name, a, b in zip(("hidden", "weights", "delta"), saved, (rx.grad, rw.grad, rd.grad)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=lambda m: f"{fmt} {activation} d {name}: {m}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_saved_pre_activations_on_the_packed_kernels(kernel, fmt, seed):
    """bf16: the packed-kernel forward's gate_up (its own pre-activations, rounded once to bf16) read by the
    backward: gradients within bf16 tolerance of the float64 reference and of the backward that recomputes them, at
    every kernel level here; the autograd of kt.fused_moe_delta passes them (its gradients are the saved path's bit
    for bit)."""
    E, K, H, I, T = 6, 3, 96, 64, 45
    packed, ids, weights, hidden, delta = _delta_case(E, H, I, T, K, fmt, delta_scale=0.3)
    grad_out, grad_h = torch.randn(T, H).to(torch.bfloat16), torch.randn(T, K, I).to(torch.bfloat16)
    _, _, gu = torch.ops.kt.fused_moe_delta(hidden, ids, weights, *packed.tensors(), delta, "silu")
    args = (grad_out, hidden, ids, weights, *packed.tensors(), "silu", delta, grad_h, None, None)
    saved = torch.ops.kt.fused_moe_backward(*args, gu)
    recomputed = torch.ops.kt.fused_moe_backward(*args)
    gate_up, down = packed.dequantize()
    rx, rw, rd = (t.detach().double().requires_grad_() for t in (hidden, weights, delta))
    ref, ref_h = fused_moe_reference(rx, ids, rw, gate_up, down, "silu", gate_up_delta=rd, return_h=True)
    torch.autograd.backward((ref, ref_h), (grad_out.double(), grad_h.double()))
    tol = {"bf16": 2e-2, "int8": 4e-2, "int4": 8e-2}[fmt]  # (test_autograd_through_the_packed_delta_forward's)
    what = f"seed={seed} {kernel} {fmt}"
    for name, a, b, want in zip(("hidden", "weights", "delta"), saved, recomputed, (rx.grad, rw.grad, rd.grad)):
        assert relative_error(a, want) < tol, f"{what} d {name}: {relative_error(a, want):.4g} from the reference"
        assert relative_error(a, b) < tol, f"{what} d {name}: {relative_error(a, b):.4g} from the recompute"
    x, w, d = (t.clone().requires_grad_() for t in (hidden, weights, delta))
    out, h, gu2 = torch.ops.kt.fused_moe_delta(x, ids, w, *packed.tensors(), d, "silu")
    assert not gu2.requires_grad
    torch.autograd.backward((out, h), (grad_out, grad_h))
    for name, got, want in (("hidden", x.grad, saved[0]), ("weights", w.grad, saved[1]), ("delta", d.grad, saved[2])):
        assert torch.equal(got, want.to(got.dtype)), f"{what}: autograd's d {name} is not the saved path's"


def test_saved_pre_activations_errors():
    packed = _packed(4, 32, 32, "int8")
    ids, weights = _routing(6, 2, 4, "skips")
    hidden, grad_out = torch.randn(6, 32).to(torch.bfloat16), torch.randn(6, 32).to(torch.bfloat16)
    delta = torch.zeros(6, 2, 64)
    for bad in (torch.zeros(6, 2, 32), torch.zeros(6, 3, 64), torch.zeros(6, 2, 64, dtype=torch.int32),
                torch.zeros(12, 64)):
        with pytest.raises(RuntimeError, match=r"gate_up must be a float CPU tensor \[T=6, K=2, 2I=64\]"):
            torch.ops.kt.fused_moe_backward(grad_out, hidden, ids, weights, *packed.tensors(), "silu", delta, None,
                                            None, None, bad)
