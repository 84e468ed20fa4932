"""kt.fused_moe with expert biases, clamped/softcapped activations and gateless experts, at every kernel level this
machine runs, against the float64 reference of tests/reference.py (run on the dequantized packed weights, so the
tolerances are the kernels' own error, as in test_ops_fused_moe.py).

The driver's epilogue (ktorch/csrc/moe/fused_moe.cpp, Epilogue) does this math for all kernel levels: the gate/up
bias, clamps and activation on each gate/up kernel call's fp32 output, the down bias before the routing weight.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.library import opcheck

import ktorch
from conftest import DRIVER_ONLY_SKIPS
from reference import fused_moe_reference, relative_error
from test_ops_fused_moe import FORMAT_IDS, FORMATS, TOLERANCE, make_routing

SKIP_KERNEL_LEVELS = DRIVER_ONLY_SKIPS  # tests/conftest.py: avx2 runs this file's code as portable does

# gated activations with parameters, at the values the models use (gpt-oss: alpha 1.702, limit 7; DeepSeek-V4:
# limit 10; Inkling2: caps 4 and 25) and at small limits so that many values are clamped
GATED = [
    "silu",
    "gelu_tanh",
    "relu2",
    "swiglu_oai(alpha=1.702,limit=7.0)",
    "swiglu_oai(alpha=1.702, limit=0.5)",
    "silu_clamped(limit=10.0)",
    "silu_clamped(limit=0.4)",
    "softcap_swiglu(gate=4.0,up=25.0)",
    "softcap_swiglu(gate=0.5,up=0.7)",
]
GATELESS = ["relu2", "silu", "gelu", "gelu_tanh", "relu"]


def make_experts(E, H, I, fmt, group_size, gated=True, biases=True, scale=1.0):
    """Random experts (outputs O(scale)) with random biases of the same size, packed in `fmt`; returns
    (packed, gate_up_bias, down_bias)."""
    n13 = 2 * I if gated else I
    w13 = torch.randn(E, n13, H) * scale / math.sqrt(H)
    down = torch.randn(E, H, I) / math.sqrt(I)
    b13 = torch.randn(E, n13) * scale if biases else None
    b2 = torch.randn(E, H) * 0.5 if biases else None
    if gated:
        packed = ktorch.pack_experts(w13, down, fmt, group_size, gate_up_bias=b13, down_bias=b2)
    else:
        packed = ktorch.pack_experts(up_proj=w13, down_proj=down, dtype=fmt, group_size=group_size, gate_up_bias=b13,
                                     down_bias=b2)
    return packed, b13, b2


def check(out, hidden, ids, weights, packed, activation, seed, what):
    assert out.shape == hidden.shape and out.dtype == hidden.dtype, f"{what}: got {out.dtype} {tuple(out.shape)}"
    w13, down = packed.dequantize()
    ref = fused_moe_reference(hidden, ids, weights, w13, down, activation, gate_up_bias=packed.w13_bias,
                              down_bias=packed.w2_bias)
    err = relative_error(out, ref)
    tol = TOLERANCE[packed.format] * (4 / 3 if packed.format != "bf16" and out.shape[0] < 4 else 1)
    assert err <= tol, f"seed={seed} {what}: relative error {err:.4g} > {tol} ({packed.format})"
    return err


@pytest.mark.parametrize("activation", GATED)
@pytest.mark.parametrize("fmt,group_size", FORMATS, ids=FORMAT_IDS)
def test_gated_activations_with_biases(kernel, fmt, group_size, activation, seed):
    E, K, H, I, T = 6, 2, 160, 96, 21
    packed, _, _ = make_experts(E, H, I, fmt, group_size, scale=3.0)  # gate/up values O(3): past the small clamps
    hidden = torch.randn(T, H).to(torch.bfloat16)
    ids, weights = make_routing(T, E, K)
    out = ktorch.fused_moe(hidden, ids, weights, packed, activation=activation)
    check(out, hidden, ids, weights, packed, activation, seed, f"{kernel} {fmt} {activation}")


@pytest.mark.parametrize("activation", GATELESS)
@pytest.mark.parametrize("biases", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("fmt,group_size", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("I", [64, 96])  # 96: the last gate/up call covers 32 channels
def test_gateless(kernel, fmt, group_size, biases, activation, I, seed):
    E, K, H, T = 5, 2, 96, 19
    packed, _, _ = make_experts(E, H, I, fmt, group_size, gated=False, biases=biases)
    assert not packed.has_gate and packed.intermediate_size == I
    hidden = torch.randn(T, H).to(torch.bfloat16)
    ids, weights = make_routing(T, E, K)
    out = ktorch.fused_moe(hidden, ids, weights, packed, activation=activation)
    check(out, hidden, ids, weights, packed, activation, seed, f"{kernel} {fmt} gateless {activation} I={I}")


@pytest.mark.parametrize("only", ["gate_up", "down"])
def test_each_bias_alone(kernel, only, seed):
    E, K, H, I, T = 4, 2, 96, 64, 9
    w13, down = torch.randn(E, 2 * I, H) / math.sqrt(H), torch.randn(E, H, I) / math.sqrt(I)
    b13, b2 = (torch.randn(E, 2 * I), None) if only == "gate_up" else (None, torch.randn(E, H))
    packed = ktorch.pack_experts(w13, down, "bf16", gate_up_bias=b13, down_bias=b2)
    hidden = torch.randn(T, H)
    ids, weights = make_routing(T, E, K)
    ids[2, 1] = -1  # a skipped slot adds no down bias
    out = ktorch.fused_moe(hidden, ids, weights, packed, activation="swiglu_oai(alpha=1.702,limit=7)")
    check(out, hidden, ids, weights, packed, "swiglu_oai(alpha=1.702,limit=7)", seed, f"{kernel} {only} bias")
    unbiased = ktorch.fused_moe(hidden, ids, weights, ktorch.PackedExperts(*packed.tensors(), "bf16"),
                                activation="swiglu_oai(alpha=1.702,limit=7)")
    assert relative_error(out, unbiased) > 0.05  # the bias is used


@pytest.mark.parametrize("T", [1, 3, 130, 300])
@pytest.mark.parametrize("fmt,group_size", FORMATS, ids=FORMAT_IDS)
def test_token_counts_and_task_splits(kernel, fmt, group_size, T, seed):
    """Decode-sized calls (channels split over tasks, h quantized by a separate pass) and prefill-sized ones (full
    rows, the GLU beside the next kernel call) run the same epilogue."""
    E, K, H, I = 8, 3, 96, 192
    for gated, act in ((True, "swiglu_oai(alpha=1.702,limit=7)"), (False, "relu2")):
        packed, _, _ = make_experts(E, H, I, fmt, group_size, gated=gated, scale=2.0)
        hidden = torch.randn(T, H).to(torch.bfloat16)
        ids, weights = make_routing(T, E, K)
        out = ktorch.fused_moe(hidden, ids, weights, packed, activation=act)
        check(out, hidden, ids, weights, packed, act, seed, f"{kernel} {fmt} T={T} {act}")


def test_same_output_for_any_thread_count(seed):
    packed, _, _ = make_experts(6, 128, 96, "int8", None)
    hidden = torch.randn(45, 128)
    ids, weights = make_routing(45, 6, 2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ktorch.fused_moe(hidden, ids, weights, packed, activation="silu_clamped(limit=1.5)")
    finally:
        torch.set_num_threads(threads)
    many = ktorch.fused_moe(hidden, ids, weights, packed, activation="silu_clamped(limit=1.5)")
    assert torch.equal(one, many), f"seed={seed}"


def test_nan_passes_the_clamps():
    """torch.clamp keeps NaN; so do the op's clamps (a NaN must not become the limit)."""
    E, H, I = 2, 64, 32
    w13, down = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    packed = ktorch.pack_experts(w13, down, "bf16")
    hidden = torch.randn(2, H)
    hidden[0, 3] = float("nan")
    ids, weights = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)
    for act in ("swiglu_oai(alpha=1.702,limit=7)", "silu_clamped(limit=7)"):
        out = ktorch.fused_moe(hidden, ids, weights, packed, activation=act)
        assert out[0].isnan().all() and not out[1].isnan().any(), act


# ---------------------------------------------------------------- errors


def test_bad_activation_specs_raise():
    packed, _, _ = make_experts(2, 64, 32, "bf16", None, biases=False)
    hidden, ids, weights = torch.randn(3, 64), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    bad = {
        "swiglu_oai": "needs alpha=",
        "swiglu_oai(alpha=1.7)": "needs limit=",
        "swiglu_oai(alpha=1.7,limit=7,beta=2)": "takes no parameter 'beta'",
        "silu(limit=3)": "takes no parameter 'limit'",
        "silu_clamped(limit=-1)": "must be positive",
        "silu_clamped(limit=x)": "not a finite number",
        "silu_clamped(limit=7": "name(key=value",
        "softcap_swiglu(gate=0,up=1)": "must be positive",
        "tanh": "activation must be one of",
    }
    for spec, message in bad.items():
        with pytest.raises(RuntimeError, match=message.replace("(", r"\(")):
            torch.ops.kt.fused_moe(hidden, ids, weights, *packed.tensors(), spec)


def test_bad_biases_raise():
    packed, b13, b2 = make_experts(3, 64, 32, "bf16", None)
    hidden, ids, weights = torch.randn(3, 64), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    args = (hidden, ids, weights, *packed.tensors(), "silu")
    for w13_bias, w2_bias, message in [
        (b13[:, :32].float().contiguous(), None, r"w13_bias \(gate biases, then up biases\) must be .*\[E=3, 64\]"),
        (b13.double(), None, "w13_bias .* float32"),
        (None, b2.t().contiguous().t(), "w2_bias must be a contiguous float32"),
        (None, b2[:2].float().contiguous(), r"w2_bias must be .*\[E=3, 64\]"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            torch.ops.kt.fused_moe(*args, w13_bias, w2_bias)


def test_gated_activations_refuse_gateless_experts():
    packed, _, _ = make_experts(2, 64, 32, "bf16", None, gated=False, biases=False)
    with pytest.raises(RuntimeError, match="needs a gate"):
        ktorch.fused_moe(torch.randn(2, 64), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1), packed,
                         activation="swiglu_oai(alpha=1.702,limit=7)")


def test_pack_experts_checks_biases_and_numa_split_refuses_them():
    w13, down = torch.randn(2, 64, 64), torch.randn(2, 64, 32)
    with pytest.raises(ValueError, match=r"gate_up_bias must be a float tensor \[2, 64\]"):
        ktorch.pack_experts(w13, down, gate_up_bias=torch.randn(2, 32))
    with pytest.raises(ValueError, match=r"down_bias must be a float tensor \[2, 64\]"):
        ktorch.pack_experts(w13, down, down_bias=torch.randn(64))
    packed = ktorch.pack_experts(w13, down, down_bias=torch.randn(2, 64))
    assert packed.w2_bias.dtype == torch.float32 and packed.w13_bias is None
    with pytest.raises(RuntimeError, match="cannot split biased or gateless"):
        packed.split_numa(2)


# ---------------------------------------------------------------- opcheck and the fake impl


@pytest.mark.parametrize("fmt,group_size", FORMATS, ids=FORMAT_IDS)
def test_opcheck_with_biases_and_gateless(fmt, group_size):
    E, K, H, I = 5, 2, 128, 64
    ids, weights = make_routing(7, E, K)
    ids[3, 0] = -1
    gated, _, _ = make_experts(E, H, I, fmt, group_size)
    gateless, _, _ = make_experts(E, H, I, fmt, group_size, gated=False)
    cases = [
        (gated, torch.randn(7, H, dtype=torch.bfloat16), "swiglu_oai(alpha=1.702,limit=7.0)", True),
        (gated, torch.randn(7, H), "silu_clamped(limit=10)", True),
        (gated, torch.randn(7, H, dtype=torch.float16), "softcap_swiglu(gate=4,up=25)", False),
        (gateless, torch.randn(7, H, dtype=torch.bfloat16), "relu2", True),
        (gateless, torch.empty(0, H, dtype=torch.bfloat16), "relu2", True),
    ]
    for packed, hidden, act, biases in cases:
        b = packed.biases() if biases else (None, None)
        opcheck(torch.ops.kt.fused_moe.default, (hidden, ids[: hidden.shape[0]], weights[: hidden.shape[0]],
                                                 *packed.tensors(), act, *b))


def test_meta_inputs_with_biases_give_a_meta_output():
    packed, _, _ = make_experts(4, 96, 64, "int8", None)
    args = [torch.randn(5, 96, dtype=torch.bfloat16), torch.zeros(5, 2, dtype=torch.long), torch.rand(5, 2)]
    args += list(packed.tensors())
    metas = [a.to("meta") for a in args]
    out = torch.ops.kt.fused_moe(*metas, "swiglu_oai(alpha=1.702,limit=7)", *[b.to("meta") for b in packed.biases()])
    assert out.device.type == "meta" and out.shape == (5, 96) and out.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="w2_bias is on cpu but hidden is on meta"):
        torch.ops.kt.fused_moe(*metas, "silu", packed.w13_bias.to("meta"), packed.w2_bias)


# ---------------------------------------------------------------- the runtime's native host tasks carry the biases


@pytest.mark.parametrize("gated,act", [(True, "swiglu_oai(alpha=1.702,limit=7.0)"), (False, "relu2")])
def test_host_tasks_run_the_biased_op(gated, act):
    """What CUDA-graph replays run (runtime/host_tasks.cpp), called here directly on the CPU: a task gives the op's
    output bit for bit, and a split task's two parts (expert deferral) sum to it."""
    import types

    from ktorch.compile.experts_runtime import ExpertsLayer, _NativeHostFunctions

    E, H, I, T, K = 6, 128, 64, 9, 4
    packed, _, _ = make_experts(E, H, I, "int8", None, gated=gated)
    layer = ExpertsLayer(*packed.tensors(), act, *packed.biases())
    hidden, (ids, weights) = torch.randn(T, H), make_routing(T, E, K)
    ids = ids.contiguous()  # (a split task reads the ids in place)
    whole = torch.ops.kt.fused_moe(hidden, ids, weights, *packed.tensors(), act, *packed.biases())
    staging = types.SimpleNamespace(hidden=hidden, topk_ids=ids, topk_weights=weights, out=torch.zeros(T, H))
    task = _NativeHostFunctions(staging, layer)
    task.run()
    assert task.error() == "" and torch.equal(staging.out, whole)
    split = types.SimpleNamespace(hidden=hidden, topk_ids=ids, topk_weights=weights, out=torch.zeros(T, H),
                                  out_later=torch.zeros(T, H), deferred=torch.tensor(1))
    task = _NativeHostFunctions(split, layer)
    task.run()
    assert task.error() == ""
    torch.testing.assert_close(split.out + split.out_later, whole, rtol=1e-5, atol=1e-5)
    assert relative_error(split.out_later, torch.zeros(T, H)) > 0  # the deferred part has work (and its biases)
