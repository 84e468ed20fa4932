"""Every misuse of the kt ops raises an error that names the argument and the offending values.

Each case calls the op with one thing wrong and matches the message: the argument's name and the values
a user needs to see what went wrong (dtype, shape, id, size). 'meta' tensors stand in for a non-CPU device.
"""

from __future__ import annotations

import re

import pytest
import torch

import ktorch
from conftest import kernel_skip_reason

kt = torch.ops.kt
OP_ERRORS = (RuntimeError, ValueError, TypeError, IndexError)

E, H, I, T, K = 6, 96, 64, 5, 2


def raises(match: str, exc=OP_ERRORS):
    """pytest.raises for an op error whose message matches the regex `match`."""
    return pytest.raises(exc, match=match)


def experts(fmt: str, e: int = E, h: int = H, i: int = I, group_size: int | None = None) -> ktorch.PackedExperts:
    return ktorch.pack_experts(torch.randn(e, 2 * i, h), torch.randn(e, h, i), fmt, group_size)


def call(hidden=None, ids=None, weights=None, packed=None, activation="silu", **override):
    """kt.fused_moe on valid inputs (bf16 experts, E=6, H=96, I=64, T=5, K=2) with some of them replaced."""
    p = packed if packed is not None else experts("bf16")
    args = dict(
        hidden=hidden if hidden is not None else torch.randn(T, H),
        topk_ids=ids if ids is not None else torch.tensor([[0, 1], [2, 3], [4, 5], [5, 0], [1, -1]]),
        topk_weights=weights if weights is not None else torch.rand(T, K),
        w13=p.w13,
        w13_scales=p.w13_scales,
        w2=p.w2,
        w2_scales=p.w2_scales,
    )
    args.update(override)
    return kt.fused_moe(
        args["hidden"], args["topk_ids"], args["topk_weights"], args["w13"], args["w13_scales"], args["w2"],
        args["w2_scales"], activation,
    )


def test_valid_call_runs():
    assert call().shape == (T, H)


# ---------------------------------------------------------------- fused_moe: dtypes


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(hidden=torch.randn(T, H).long()), r"hidden must be bfloat16, float16 or float32, got Long"),
        (dict(hidden=torch.randn(T, H).double()), r"hidden must be bfloat16, float16 or float32, got Double"),
        (dict(ids=torch.zeros(T, K)), r"topk_ids must be int32 or int64, got Float"),
        (dict(ids=torch.zeros(T, K, dtype=torch.int16)), r"topk_ids must be int32 or int64, got Short"),
        (dict(weights=torch.ones(T, K, dtype=torch.long)), r"topk_weights must be floating point, got Long"),
    ],
    ids=["hidden-int64", "hidden-fp64", "ids-float", "ids-int16", "weights-int64"],
)
def test_fused_moe_wrong_dtypes(kwargs, match):
    with raises(match):
        call(**kwargs)


# ---------------------------------------------------------------- fused_moe: shapes


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(hidden=torch.randn(H)), r"hidden must be \[T, H\] \(2-D\), got shape \[96\]"),
        (dict(hidden=torch.randn(1, T, H)), r"hidden must be \[T, H\] \(2-D\), got shape \[1, 5, 96\]"),
        (dict(ids=torch.zeros(4, K, dtype=torch.long)), r"topk_ids must be \[T=5, K\], got shape \[4, 2\]"),
        (dict(ids=torch.zeros(T, dtype=torch.long)), r"topk_ids must be \[T=5, K\], got shape \[5\]"),
        (dict(weights=torch.rand(T, 3)), r"topk_weights must have the shape of topk_ids \[5, 2\], got \[5, 3\]"),
        (dict(weights=torch.rand(K, T)), r"topk_weights must have the shape of topk_ids \[5, 2\], got \[2, 5\]"),
        (dict(hidden=torch.randn(T, 64)), r"hidden has H=64, w13 expects K=96"),
    ],
    ids=["hidden-1d", "hidden-3d", "ids-rows", "ids-1d", "weights-cols", "weights-transposed", "hidden-size"],
)
def test_fused_moe_mismatched_shapes(kwargs, match):
    with raises(match):
        call(**kwargs)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_fused_moe_id_out_of_range(dtype):
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [5, 0], [1, 6]], dtype=dtype)
    with raises(r"topk_ids\[4, 1\] = 6 is out of range for 6 experts"):
        call(ids=ids)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [2**31 - 1, 0], [1, 2]], dtype=dtype)
    with raises(rf"topk_ids\[3, 0\] = {2**31 - 1} is out of range for 6 experts"):
        call(ids=ids)


def test_fused_moe_unknown_activation():
    with raises(r"activation must be one of silu, gelu_tanh, gelu, relu, relu2, swiglu_oai\(alpha=, limit=\), "
                r"silu_clamped\(limit=\), softcap_swiglu\(gate=, up=\); got 'tanh'"):
        call(activation="tanh")


# ---------------------------------------------------------------- fused_moe: packed weights of another format or shape


def test_fused_moe_formats_mixed():
    a, b = experts("int8"), experts("bf16")
    with raises(r"w13 and w2 must both be bf16 or both quantized \(int8/int4\), got Char and BFloat16"):
        call(w13=a.w13, w13_scales=a.w13_scales, w2=b.w2, w2_scales=None)
    with raises(r"w13 and w2 must both be bf16 or both quantized \(int8/int4\), got BFloat16 and Char"):
        call(w13=b.w13, w13_scales=None, w2=a.w2, w2_scales=a.w2_scales)
    # (int8 with int4 is a valid pair: GGUF Q4_K_M layers, tests/test_ops_kquant.py)


def test_fused_moe_unpacked_weights():
    gate_up, down = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    with raises(r"w13 must be packed by kt.pack_bf16/pack_int8/pack_int4 .*got Float"):
        call(w13=gate_up, w2=down)
    with raises(r"w13 must be a contiguous packed tensor \[E, N/16, K/2, 16, 2\], got shape \[6, 128, 96\]"):
        call(w13=gate_up.bfloat16(), w2=down.bfloat16())
    p = experts("bf16")
    with raises(r"w2 must be a contiguous packed tensor \[E, N/16, K/2, 16, 2\], got shape \[6, 96, 64\]"):
        call(w2=down.bfloat16())
    with raises(r"w2 must be a contiguous packed tensor"):
        call(w2=torch.cat([p.w2, p.w2], dim=2)[:, :, ::2])  # right shape, not contiguous


def test_fused_moe_experts_of_another_shape():
    p = experts("bf16")
    fewer = experts("bf16", e=4)
    with raises(r"w13 has 6 experts but w2 has 4"):
        call(w2=fewer.w2)
    wider = experts("bf16", i=96)
    with raises(r"intermediate size mismatch: w13 gives I=64 \(N/2; gateless experts: N\), w2 expects K=96"):
        call(w2=wider.w2)
    other_h = experts("bf16", h=160)
    with raises(r"hidden has H=96, w13 expects K=96, w2 produces N=160"):
        call(w13=p.w13, w2=kt.pack_bf16(torch.randn(E, 160, I)))
    with raises(r"hidden has H=96, w13 expects K=160"):
        call(w13=other_h.w13)


def test_fused_moe_w13_not_packed_as_gate_up():
    # I = 16: 2I = 32 rows cannot hold 32 gate + 32 up channels per kernel task. (w13 with as many rows as w2 has
    # columns is the up projection of gateless experts: tests/test_ops_fused_moe_epilogue.py.)
    w13 = kt.pack_bf16(torch.randn(E, 32, H), gate_up=False)
    w2 = kt.pack_bf16(torch.randn(E, H, 32))[:, :, :8].contiguous()  # K = 16 (pack_bf16 wants 32: cut one)
    with raises(r"w13 must be packed with gate_up=True \(2I a multiple of 64\), got N=32"):
        call(w13=w13, w2=w2)


@pytest.mark.parametrize("fmt,group_size", [("int8", None), ("int4", 32)])
def test_fused_moe_scales_missing_or_wrong(fmt, group_size):
    p = experts(fmt, group_size=group_size)
    with raises(rf"{fmt} weights need w13_scales"):
        call(packed=p, w13_scales=None)
    with raises(rf"{fmt} weights need w2_scales"):
        call(packed=p, w2_scales=None)
    with raises(r"w13_scales has shape \[6, \d+, 96\] but w13 needs \[6, G, 128\]"):
        call(packed=p, w13_scales=p.w2_scales)
    with raises(r"w2_scales must be a contiguous float32 CPU tensor \[E, G, N\] .*, float16 like them, or two-level "
                r"uint8/int8 .*, got Double"):  # float16 scales are a form of their own (GGUF Q8_0's d)
        call(packed=p, w2_scales=p.w2_scales.double())
    with raises(r"w13_scales must be a contiguous float32 CPU tensor \[E, G, N\]"):
        call(packed=p, w13_scales=torch.cat([p.w13_scales, p.w13_scales], dim=2)[:, :, ::2])


def test_fused_moe_scales_of_another_format():
    p8, p4 = experts("int8"), experts("int4", group_size=32)
    with raises(r"int8 w13_scales has 12 groups of 8 input channels; grouped or affine int8 needs groups of a "
                r"multiple of 16"):
        call(packed=p8, w13_scales=torch.ones(E, 12, 2 * I))
    with raises(r"bf16 weights take no scales, but w2_scales was given"):
        call(w2_scales=p8.w2_scales)
    with raises(r"w13_scales has 2 groups, .*K=96"):  # group size 48
        call(packed=p4, w13_scales=torch.ones(E, 2, 2 * I))


# ---------------------------------------------------------------- fused_moe: tensors on another device


@pytest.mark.parametrize("arg", ["topk_ids", "topk_weights", "w13", "w13_scales", "w2", "w2_scales"])
def test_fused_moe_one_tensor_on_another_device(arg):
    """One input on 'meta' (standing in for a GPU), the rest on the CPU: an error naming that input."""
    p = experts("int8")
    args = dict(topk_ids=torch.zeros(T, K, dtype=torch.long), topk_weights=torch.rand(T, K), w13=p.w13,
                w13_scales=p.w13_scales, w2=p.w2, w2_scales=p.w2_scales)
    args[arg] = args[arg].to("meta")
    with raises(rf"{arg}\b.*meta"):
        out = call(packed=p, ids=args.pop("topk_ids"), weights=args.pop("topk_weights"), **args)
        pytest.fail(f"fused_moe with {arg} on meta returned a {out.device} tensor instead of raising")


def test_fused_moe_hidden_on_another_device():
    with raises(r"hidden\b.*meta"):
        out = call(hidden=torch.randn(T, H, device="meta"))
        pytest.fail(f"fused_moe with hidden on meta and weights on cpu returned a {out.device} tensor")


def test_unpack_scales_on_another_device():
    packed, scales = kt.pack_int8(torch.randn(2, 32, 64))
    with raises(r"scales\b.*meta"):
        out = kt.unpack(packed, scales.to("meta"))
        pytest.fail(f"unpack with scales on meta and packed on cpu returned a {out.device} tensor")


# ---------------------------------------------------------------- kernel selection


def test_unknown_kernel_level(monkeypatch):
    monkeypatch.setenv("KT_CPU_KERNEL", "sse2")
    with raises(r"KT_CPU_KERNEL must be one of auto, portable, avx2, avx512, amx; got 'sse2'"):
        call()


@pytest.mark.parametrize("level", ["avx2", "avx512", "amx"])
def test_forcing_an_unavailable_kernel_level(level, monkeypatch):
    if kernel_skip_reason(level) is None:
        pytest.skip(f"{level} runs on this machine")
    available = ",".join(ktorch.cpu_features()["available"])
    monkeypatch.setenv("KT_CPU_KERNEL", level)
    with raises(re.escape(f"KT_CPU_KERNEL={level} but this CPU/OS cannot run it (available: {available})")):
        call()


def test_kernel_level_set_from_python_is_checked_where_read():
    """A value set through the op (what ktorch.config.set_cpu_kernel calls after its own check) overrides the
    variable and is checked at the call, with the same message; clearing it goes back to the variable."""
    try:
        torch.ops.kt.set_option("KT_CPU_KERNEL", "sse2")
        with raises(r"KT_CPU_KERNEL must be one of auto, portable, avx2, avx512, amx; got 'sse2'"):
            call()
    finally:
        torch.ops.kt.set_option("KT_CPU_KERNEL", None)
    call()


@pytest.mark.parametrize("name", ["KT_DOWN_RANGES", "KT_AMX_WALK", "KT_SPIN_YIELD", "KT_NUMA_SPLIT", "kt_profile"])
def test_only_the_cpp_settings_can_be_set_through_the_op(name):
    """The op holds the settings the C++ side reads (runtime/config.h); the retired tuning switches, Python-side
    settings and misspelt names are errors, not silently ignored values."""
    with raises(re.escape(f"'{name}' is not one of ktorch's settings")):
        torch.ops.kt.set_option(name, "1")
    with raises(re.escape(f"'{name}' is not one of ktorch's settings")):
        torch.ops.kt.get_option(name)


# ---------------------------------------------------------------- pack ops


@pytest.mark.parametrize("op", ["pack_bf16", "pack_int8", "pack_int4"])
def test_pack_bad_weights(op):
    def pack(w, gate_up=False):
        if op == "pack_int4":
            return kt.pack_int4(w, group_size=32, gate_up=gate_up)
        return getattr(kt, op)(w, gate_up=gate_up)

    with raises(rf"{op}: weight must be \[E, N, K\] \(3-D\), got shape \[64, 32\]"):
        pack(torch.randn(64, 32))
    with raises(rf"{op}: weight must be a floating-point tensor, got Int"):
        pack(torch.ones(2, 64, 32, dtype=torch.int32))
    with raises(rf"{op}: the output dimension N=24 must be a positive multiple of 16"):
        pack(torch.randn(2, 24, 32))
    with raises(rf"{op}: the reduction dimension K=48 must be a positive multiple of 32"):
        pack(torch.randn(2, 64, 48))
    with raises(rf"{op}: the output dimension N=96 must be a positive multiple of 64 for gate_up"):
        pack(torch.randn(2, 96, 64), gate_up=True)


@pytest.mark.parametrize("group_size", [0, 16, 48, 64, 256])
def test_pack_int4_bad_group_size(group_size):
    with raises(rf"group_size must be a positive multiple of 32 that divides K=96, got {group_size}"):
        kt.pack_int4(torch.randn(2, 64, 96), group_size=group_size)


def test_unpack_bad_arguments():
    w = torch.randn(3, 128, 64)
    pb = kt.pack_bf16(w)
    p8, s8 = kt.pack_int8(w)
    p4, s4 = kt.pack_int4(w, group_size=32)
    with raises(r"unpack: bf16 packed weights take no scales"):
        kt.unpack(pb, s8)
    with raises(r"unpack: quantized packed weights need their scales"):
        kt.unpack(p8, None)
    with raises(r"unpack: grouped or affine int8 scales need groups of a multiple of 16 input channels, got "
                r"\[3, 8, 128\] for K=64"):
        kt.unpack(p8, torch.ones(3, 8, 128))
    with raises(r"unpack: scales must be float32 \[E=3, G, N=128\] or \[E, 2, G, N\] \(scales, minimums\) with G "
                r"dividing K=64 \(or float16 like them, or two-level uint8/int8: ktorch.ops.moe.pack_kscales\), got Float "
                r"\[2, 1, 128\]"):
        kt.unpack(p8, s8[:2])
    with raises(r"unpack: scales must be float32 \[E=3, G, N=128\] or \[E, 2, G, N\] .*, got Double"):
        kt.unpack(p4, s4.double())
    with raises(r"unpack: packed must be \[E, N/16, K/per, 16, per\], got shape \[3, 128, 64\]"):
        kt.unpack(w, None)
    with raises(r"unpack: packed weights must be bfloat16, int8, uint8 \(int4\) or float4_e2m1fn_x2 \(MXFP4 nibbles\), "
                r"got Float"):
        kt.unpack(pb.float(), None)


# ---------------------------------------------------------------- ktorch.pack_experts


def test_pack_experts_bad_arguments():
    gate_up, down = torch.randn(4, 2 * I, H), torch.randn(4, H, I)
    with raises(r"dtype must be one of \('bf16', 'int8', 'int4'\), got 'fp8'", ValueError):
        ktorch.pack_experts(gate_up, down, "fp8")
    with raises(r"group_size applies to int4 only, got group_size=32 with int8", ValueError):
        ktorch.pack_experts(gate_up, down, "int8", 32)
    with raises(r"pass gate_up_proj, or both gate_proj and up_proj", ValueError):
        ktorch.pack_experts(None, down, gate_proj=gate_up[:, :I])
    with raises(r"gate_proj \(4, 64, 96\) and up_proj \(4, 32, 96\) differ", ValueError):
        ktorch.pack_experts(None, down, gate_proj=gate_up[:, :I], up_proj=gate_up[:, :32])
    with raises(r"pass either gate_up_proj or gate_proj/up_proj, not both", ValueError):
        ktorch.pack_experts(gate_up, down, gate_proj=gate_up[:, :I], up_proj=gate_up[:, I:])
    with raises(r"down_proj is required", ValueError):
        ktorch.pack_experts(gate_up)
    match = r"down_proj must be \[E=4, H=96, I=64\] to match gate_up_proj \(4, 128, 96\), got \(4, 64, 96\)"
    with raises(match, ValueError):
        ktorch.pack_experts(gate_up, down.transpose(1, 2))


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_pack_experts_sizes_the_kernels_cannot_tile(fmt):
    """H and I must be multiples of 32; the message speaks of H and I, the names pack_experts' caller knows."""
    with raises(r"\bH=48\b.*multiple of 32"):
        ktorch.pack_experts(torch.randn(2, 2 * I, 48), torch.randn(2, 48, I), fmt)
    with raises(r"\bI=48\b.*multiple of 32"):
        ktorch.pack_experts(torch.randn(2, 96, H), torch.randn(2, H, 48), fmt)


def test_pack_experts_int4_group_size_not_dividing_i():
    with raises(r"group_size.*64"):
        ktorch.pack_experts(torch.randn(2, 192, 128), torch.randn(2, 128, 96), "int4", 64)
