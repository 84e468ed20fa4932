"""The eager prefill's one-kernel RMSNorm (ktorch/integrations/fused_norms.py): which modules it takes, its values
against the standard form, and that the model is as before once the context closes."""

import contextlib

import pytest
import torch
from torch import nn

from ktorch.generation import Decoder, Sampling
from ktorch.integrations import fused_norms
from models import FAMILIES, tiny_model


class OffsetNorm(nn.Module):
    """Gemma's form, (1 + weight) * normalized: another function, which the swap must leave alone."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return ((1.0 + self.weight.float()) * x32).to(x.dtype)


@contextlib.contextmanager
def counting_rms_norm():
    """Within: calls of torch.nn.functional.rms_norm (what the swapped forward calls) are counted in the yielded
    list's one element."""
    calls = [0]
    original = torch.nn.functional.rms_norm

    def counted(*a, **k):
        calls[0] += 1
        return original(*a, **k)

    torch.nn.functional.rms_norm = counted
    try:
        yield calls
    finally:
        torch.nn.functional.rms_norm = original


def _reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The norm in float64: x / sqrt(mean(x^2) + eps) * weight."""
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("family", FAMILIES)
def test_every_norm_of_the_families_is_standard(family):
    """The test families' norms (layers, q/k norms where the family has them, the final norm) are all taken."""
    torch.manual_seed(0)
    model = tiny_model(family)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and fused_norms.norms_of(model) == norms


def test_other_forms_and_instance_forwards_are_left_alone():
    m = nn.Sequential(OffsetNorm(8))
    assert fused_norms.norms_of(m) == []
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe")
    norm = model.model.norm
    norm.forward = lambda x: x  # someone else's forward on the instance
    assert not fused_norms.standard_norm(norm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swapped_norm_matches_the_standard_form_and_is_undone(dtype):
    """Inside the context each standard norm runs F.rms_norm: within the last bit of the standard form (bf16: one
    rounding where the standard form has two), and as close to the float64 norm; outside, the module's own forward
    again, bit for bit."""
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", dtype=dtype)
    norm = model.model.layers[0].input_layernorm
    with torch.no_grad():
        norm.weight.copy_(torch.rand_like(norm.weight) + 0.5)
    x = (torch.randn(5, 7, norm.weight.shape[0], dtype=torch.float64) * 3).to(dtype)
    want = norm(x)
    ref = _reference(x, norm.weight, norm.variance_epsilon)
    with counting_rms_norm() as calls, fused_norms.swapped(model) as modules:
        assert norm in modules
        got = norm(x)
    assert calls[0] == 1 and got.dtype == want.dtype
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-3)
    torch.testing.assert_close(got, want, **tol)
    err_fused = (got.double() - ref).abs().max()
    err_standard = (want.double() - ref).abs().max()
    assert err_fused <= err_standard * 1.01 + 1e-12  # one rounding is no worse than two
    assert "forward" not in norm.__dict__ and torch.equal(norm(x), want)


def test_mismatched_input_dtype_takes_the_module_forward():
    """A float32 input to a bf16 norm keeps the standard form's type promotion (a float32 result)."""
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", dtype=torch.bfloat16)
    norm = model.model.norm
    x = torch.randn(3, norm.weight.shape[0])
    want = norm(x)
    with fused_norms.swapped(model):
        got = norm(x)
    assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)


def test_cpu_prefill_keeps_the_standard_form():
    """Decoder.prefill swaps only on CUDA (the launch-bound path): on the CPU no F.rms_norm call."""
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe")
    with counting_rms_norm() as calls, torch.inference_mode():
        Decoder(model, 16, torch.device("cpu"), Sampling(), cuda_graphs=False).prefill(torch.tensor([[1, 2, 3]]))
    assert calls[0] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the swap applies to prefills on CUDA")
def test_cuda_prefill_runs_fused_norms_close_to_the_standard_form():
    """On CUDA, Decoder.prefill runs every norm through F.rms_norm once (layers x (2 + q/k norms) + the final
    norm), the model's forward with the norms swapped stays within bf16 rounding of its own, and the prefill's
    first token is that forward's (up to a near tie)."""
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", dtype=torch.bfloat16).cuda()
    ids = torch.randint(0, 256, (1, 40), device="cuda")
    with torch.inference_mode():
        want = model(input_ids=ids).logits[0, -1].float()
        with fused_norms.swapped(model):
            got = model(input_ids=ids).logits[0, -1].float()
        with counting_rms_norm() as calls:
            first = int(Decoder(model, 64, torch.device("cuda"), Sampling(), cuda_graphs=False).prefill(ids).item())
    assert calls[0] == len(fused_norms.norms_of(model)) > 0
    assert "forward" not in model.model.norm.__dict__
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
    top2 = torch.topk(got, 2).values
    assert first == int(got.argmax()) or float(top2[0] - top2[1]) < 0.05
