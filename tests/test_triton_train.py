"""The GPU training path's Triton kernels (ktorch/ops/triton_train.py): the one-pass dequantization of packed int8 /
bf16 experts, and the expert adapters' per-pair products with their gradients.

The kernels run on CUDA, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 with Triton installed);
without either these tests skip. References: ``kt.unpack`` (the C++ unpacking, float32) for the dequantization,
float64 loops over the pairs for the products, and the dense products ``ExpertLoRAFactors`` computes elsewhere for
the adapters' values and gradients (autograd through both).
"""

from __future__ import annotations

import pytest
import torch

import ktorch  # noqa: F401  (registers torch.ops.kt)
from ktorch.lora import ExpertLoRAFactors
from ktorch.ops import triton_train as tt
from ktorch.ops.packed_weights import dequantize_packed
from ktorch.ops.triton_experts import interpreting

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS_RUN = tt.triton is not None and (torch.cuda.is_available() or interpreting())
needs_kernels = pytest.mark.skipif(
    not KERNELS_RUN,
    reason="the Triton kernels need Triton and a CUDA GPU, or Triton's interpreter (TRITON_INTERPRET=1)")


def _packed(fmt: str, n: int, N: int, K: int, G: int, gen: torch.Generator) -> tuple:
    if fmt == "int8":
        codes = torch.randint(-128, 128, (n, N // 16, K // 4, 16, 4), dtype=torch.int8, generator=gen)
        return codes, torch.rand(n, G, N, generator=gen) * 0.02 + 1e-3
    return torch.randn(n, N // 16, K // 2, 16, 2, generator=gen).to(torch.bfloat16), None


def _bf16_close(got: torch.Tensor, ref32: torch.Tensor) -> bool:
    """got = ref32 rounded to bf16: exactly on a GPU (round to nearest even); Triton's interpreter rounds toward zero,
    so there the other neighbour of the two is accepted too."""
    if got.is_cuda:
        return torch.equal(got, ref32.bfloat16())
    trunc = (ref32.view(torch.int32) & ~0xFFFF).view(torch.float32).bfloat16()
    return bool(((got == ref32.bfloat16()) | (got == trunc)).all())


@needs_kernels
@pytest.mark.parametrize("fmt,G", [("int8", 1), ("int8", 4), ("bf16", 1)])
@pytest.mark.parametrize("gate_up", [True, False])
@pytest.mark.parametrize("N,K", [(128, 256), (64, 192)])
def test_dequantize_rows_equals_unpack(fmt, G, gate_up, N, K):
    gen = torch.Generator().manual_seed(N + K + G + gate_up)
    packed, scales = _packed(fmt, 3, N, K, G, gen)
    packed = packed.to(DEVICE)
    scales = None if scales is None else scales.to(DEVICE)
    ref = torch.ops.kt.unpack(packed.cpu(), None if scales is None else scales.cpu(), gate_up).float()  # [n, N, K]
    assert tt.dequantize_rows_applies(packed, scales, torch.float32)
    got32 = tt.dequantize_rows(packed, scales, gate_up, torch.float32)
    assert torch.equal(got32.cpu(), ref)
    got16 = tt.dequantize_rows(packed, scales, gate_up, torch.bfloat16)
    assert _bf16_close(got16.cpu(), ref)
    # dequantize_packed takes this path where the kernel runs: its transposed view, into a given buffer too
    via = dequantize_packed(packed, scales, gate_up, torch.float32)
    assert via.shape == (3, K, N) and torch.equal(via.cpu(), ref.transpose(1, 2))
    buf = torch.empty(3, N, K, dtype=torch.float32, device=DEVICE)
    out = dequantize_packed(packed, scales, gate_up, torch.float32, out=buf)
    assert out.data_ptr() == buf.data_ptr() and torch.equal(buf.cpu(), ref)


@needs_kernels
def test_dequantize_rows_declines_what_it_does_not_take():
    gen = torch.Generator().manual_seed(1)
    packed, scales = _packed("int8", 2, 64, 128, 1, gen)
    packed, scales = packed.to(DEVICE), scales.to(DEVICE)
    assert not tt.dequantize_rows_applies(packed, None, torch.bfloat16)  # int8 without scales
    assert not tt.dequantize_rows_applies(packed, scales, torch.float64)  # float64: the torch passes
    assert not tt.dequantize_rows_applies(packed[:, :, ::2], scales, torch.bfloat16)  # not contiguous
    assert not tt.dequantize_rows_applies(packed[:, :, :8].contiguous(), scales, torch.bfloat16)  # K/4 not 16k
    assert not tt.dequantize_rows_applies(packed, scales.double(), torch.bfloat16)
    with pytest.raises(ValueError, match="not int8"):
        tt.dequantize_rows(packed, None, True, torch.bfloat16)


# factors of E experts, rank r: A [r E, n_in] (row e r + j), B [n_out, r E] (column j E + e), as peft lays them out
def _factors(E, r, n_in, n_out, gen):
    A = torch.randn(r * E, n_in, generator=gen, dtype=torch.float64)
    B = torch.randn(n_out, r * E, generator=gen, dtype=torch.float64)
    return A, B


@needs_kernels
@pytest.mark.parametrize("E,r,T,K,n_in,n_out", [(6, 4, 10, 3, 40, 24), (16, 8, 33, 8, 96, 130), (3, 2, 5, 1, 16, 8)])
def test_pair_products_equal_float64_loops(E, r, T, K, n_in, n_out):
    gen = torch.Generator().manual_seed(E * 100 + r)
    A, B = _factors(E, r, n_in, n_out, gen)
    ids = torch.randint(0, E, (T * K,), generator=gen)
    ids[: min(E, T * K)] = torch.arange(min(E, T * K))  # every expert (that fits) has a pair
    x = torch.randn(T, n_in, generator=gen, dtype=torch.float64)
    u = torch.randn(T * K, r, generator=gen, dtype=torch.float64)
    g = torch.randn(T * K, n_out, generator=gen, dtype=torch.float64)
    dev = lambda t: t.float().to(DEVICE)  # noqa: E731
    Ae, Be = A.view(E, r, n_in), B.view(n_out, r, E)
    a_strides, b_strides = (r * n_in, n_in, 1), (1, E, r * E)

    y = tt.pair_contract(dev(x), dev(ids).long(), dev(A), a_strides, r, rows=K).cpu().double()
    y_ref = torch.stack([Ae[ids[p]] @ x[p // K] for p in range(T * K)])
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-4)

    z = tt.pair_expand(dev(u), dev(ids).long(), dev(B), b_strides, n_out).cpu().double()
    z_ref = torch.stack([Be[:, :, ids[p]] @ u[p] for p in range(T * K)])
    torch.testing.assert_close(z, z_ref, rtol=1e-5, atol=1e-4)

    order, offs = tt.sort_pairs(dev(ids).long(), E)
    dB = tt.segment_outer(dev(u), dev(g), order, offs, b_strides, dev(B)).cpu().double()
    dB_ref = torch.zeros(n_out, r, E, dtype=torch.float64)
    dA_ref = torch.zeros(E, r, n_in, dtype=torch.float64)
    for p in range(T * K):
        dB_ref[:, :, ids[p]] += torch.outer(g[p], u[p])
        dA_ref[ids[p]] += torch.outer(u[p], x[p // K])
    torch.testing.assert_close(dB, dB_ref.view(n_out, r * E), rtol=1e-5, atol=1e-4)
    dA = tt.segment_outer(dev(u), dev(x), order, offs, a_strides, dev(A), rows=K).cpu().double()
    torch.testing.assert_close(dA, dA_ref.view(r * E, n_in), rtol=1e-5, atol=1e-4)
    if E > T * K:  # experts without pairs: zero blocks, written (not left as empty_like's bytes)
        assert dA_ref.view(E, -1)[T * K:].abs().sum() == 0


@needs_kernels
@pytest.mark.parametrize("shared_x", [True, False], ids=["x_per_token", "x_per_pair"])
def test_adapter_products_and_gradients_match_the_dense_ones(shared_x, monkeypatch):
    """ExpertLoRAFactors' per-pair path against its dense path (the one the CPU and float64 take): values and the
    gradients of x, u and both factors, through autograd, with skipped slots' ids clamped to 0 as callers pass."""
    E, r, T, K, n_in, n_out = 8, 4, 12, 3, 48, 40
    gen = torch.Generator().manual_seed(7 + shared_x)
    f = ExpertLoRAFactors(E, n_in, n_out, r, device=DEVICE)
    with torch.no_grad():
        f.lora_B.weight.copy_(torch.randn(n_out, r * E, generator=gen))
    ids = torch.randint(0, E, (T, K), generator=gen).to(DEVICE)
    x0 = torch.randn(*((T,) if shared_x else (T, K)), n_in, generator=gen).to(DEVICE)
    gy = torch.randn(T, K, n_out, generator=gen).to(DEVICE)

    def run():
        f.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        u = f.project_in(x, ids)
        u.retain_grad()
        y = f.project_out(u, ids)
        (y * gy).sum().backward()
        return y.detach(), x.grad, u.grad, f.lora_A.weight.grad.clone(), f.lora_B.weight.grad.clone()

    assert f._per_pair(x0)
    got = run()
    monkeypatch.setattr(ExpertLoRAFactors, "_per_pair", lambda self, x: False)
    want = run()
    for name, a, b in zip(("y", "dx", "du", "dA", "dB"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


@needs_kernels
def test_no_pairs():
    """A call with no tokens: empty products, and zero gradients for the factors (every block written)."""
    f = ExpertLoRAFactors(4, 16, 24, 2, device=DEVICE)
    ids = torch.zeros(0, 3, dtype=torch.long, device=DEVICE)
    x = torch.zeros(0, 16, device=DEVICE, requires_grad=True)
    y = f.project_out(f.project_in(x, ids), ids)
    assert y.shape == (0, 3, 24)
    y.sum().backward()
    assert x.grad.shape == (0, 16)
    assert torch.equal(f.lora_A.weight.grad, torch.zeros_like(f.lora_A.weight))
    assert torch.equal(f.lora_B.weight.grad, torch.zeros_like(f.lora_B.weight))
