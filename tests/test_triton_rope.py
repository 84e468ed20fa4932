"""The prefill's rotary-embedding kernel (ktorch/ops/triton_rope.py) and its swap into transformers' attention
(ktorch/integrations/fused_rope.py, an experiment the device measures).

The kernel runs on CUDA, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 with Triton installed);
those tests skip otherwise. Which modules are swapped, and the fallbacks, run everywhere."""

import pytest
import torch

from ktorch.integrations import fused_rope
from ktorch.ops import triton_experts, triton_rope
from models import FAMILIES, tiny_model

KERNEL_RUNS = triton_experts.triton_available() and (torch.cuda.is_available() or triton_experts.interpreting())
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(not KERNEL_RUNS, reason="the Triton kernel needs Triton and a CUDA GPU, or "
                                  "Triton's interpreter (TRITON_INTERPRET=1)")


def _eager(x, cos, sin):
    """transformers' form: x * cos + rotate_half(x) * sin, cos/sin unsqueezed over the heads."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def _inputs(B, H, T, D, dtype, transposed, cos_batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    if transposed:  # the attention's layout: [B, T, H, D] memory seen as [B, H, T, D]
        x = torch.randn(B, T, H, D, generator=g, dtype=torch.float64).to(dtype).transpose(1, 2)
    else:
        x = torch.randn(B, H, T, D, generator=g, dtype=torch.float64).to(dtype)
    angle = torch.rand(cos_batch, T, D // 2, generator=g, dtype=torch.float64) * 6.3
    angle = torch.cat([angle, angle], -1)
    return x.to(DEVICE), angle.cos().to(dtype).to(DEVICE), angle.sin().to(dtype).to(DEVICE)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,H,T,D,transposed,cos_batch", [(1, 4, 7, 16, True, 1), (2, 3, 5, 64, False, 2),
                                                          (1, 2, 33, 128, True, 1), (2, 1, 1, 10, False, 1)])
def test_rope_matches_a_float64_reference_and_the_eager_form(dtype, B, H, T, D, transposed, cos_batch):
    """Within one rounding of the float64 rotation of the same inputs (no worse than transformers' form, which
    rounds three times; bf16 under the interpreter, which truncates, within twice its error), x's layout kept;
    float32 within 1e-6 of the eager form."""
    x, cos, sin = _inputs(B, H, T, D, dtype, transposed, cos_batch)
    got = triton_rope.rope(x, cos, sin)
    ref = _eager(x.double(), cos.double(), sin.double())
    eager = _eager(x, cos, sin)
    assert got.shape == x.shape and got.dtype == dtype and got.stride() == torch.empty_like(x).stride()
    err = (got.double() - ref).abs().max()
    # Triton's interpreter truncates its casts to bf16 (up to one unit in the last place, where rounding makes half)
    slack = 2.0 if dtype == torch.bfloat16 and not x.is_cuda else 1.01
    assert err <= (eager.double() - ref).abs().max() * slack + 1e-12
    if dtype == torch.float32:
        torch.testing.assert_close(got, eager, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(got, eager, rtol=2 ** -7, atol=2e-2)


def test_rope_refuses_what_it_does_not_take():
    x = torch.randn(1, 2, 3, 8)
    cos = torch.randn(1, 3, 8)
    assert not triton_rope.rope_applies(x, cos[:, :, :6], cos[:, :, :6])  # another head size
    assert not triton_rope.rope_applies(torch.randn(1, 2, 3, 7), torch.randn(1, 3, 7), torch.randn(1, 3, 7))  # odd
    assert not triton_rope.rope_applies(x, cos.double(), cos.double())  # another dtype
    assert not triton_rope.rope_applies(x.transpose(2, 3), cos, cos)  # no unit stride along D
    if not KERNEL_RUNS or DEVICE == "cpu" and not triton_experts.interpreting():
        assert not triton_rope.rope_applies(x, cos, cos)  # not a device the kernel runs on
        with pytest.raises(ValueError, match="rope"):
            triton_rope.rope(x, cos, cos)


@pytest.mark.parametrize("family", FAMILIES)
def test_swap_takes_the_standard_modules_and_restores_them(family):
    torch.manual_seed(0)
    model = tiny_model(family)
    attention = next(m for m in model.modules() if type(m).__name__.endswith("Attention"))
    import sys

    module = sys.modules[type(attention).__module__]
    before = module.apply_rotary_pos_emb
    with fused_rope.swapped(model) as modules:
        assert (module in modules) == fused_rope.standard_code(before)
        if module in modules:
            assert module.apply_rotary_pos_emb is not before
            assert module.apply_rotary_pos_emb.kt_original is before
        with fused_rope.swapped(model) as again:  # nested: nothing swapped twice
            assert again == []
    assert module.apply_rotary_pos_emb is before
    if family in ("qwen3_moe", "mixtral", "olmoe"):
        assert fused_rope.standard_code(before)


@pytest.mark.parametrize("family", FAMILIES)
def test_swapped_model_matches_its_own_forward(family):
    """A whole forward with the swap is the model's own within rounding (the kernel where it runs: here under the
    interpreter or on a GPU; the original form elsewhere, bit for bit)."""
    torch.manual_seed(0)
    model = tiny_model(family).to(DEVICE)
    ids = torch.randint(0, 256, (1, 12), device=DEVICE)
    with torch.no_grad():
        want = model(input_ids=ids).logits
        with fused_rope.swapped(model):
            got = model(input_ids=ids).logits
    if KERNEL_RUNS:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    else:
        assert torch.equal(got, want)
