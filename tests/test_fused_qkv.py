"""The decode step's one q/k/v projection (ktorch/integrations/fused_qkv.py) and the post-grad pass that merges the
three products of one weight (ktorch/passes/cse.py)."""

import contextlib

import pytest
import torch
from torch import nn

import ktorch
from ktorch.generation import Decoder, Sampling, compiled_layers
from ktorch.integrations import fused_qkv
from ktorch.passes import cse
from models import tiny_model


class ToyAttention(nn.Module):
    def __init__(self, bias: bool):
        super().__init__()
        self.q_proj = nn.Linear(32, 48, bias=bias)
        self.k_proj = nn.Linear(32, 16, bias=bias)
        self.v_proj = nn.Linear(32, 16, bias=bias)

    def forward(self, x, y=None):
        y = x if y is None else y  # y: another tensor for keys and values (cross attention)
        return torch.cat([self.q_proj(x), self.k_proj(y), self.v_proj(y)], -1)


@pytest.mark.parametrize("bias", [False, True])
def test_fused_weights_are_views_of_one_tensor_with_the_same_values(bias):
    torch.manual_seed(0)
    m = nn.Sequential(ToyAttention(bias)).requires_grad_(False)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    x = torch.randn(3, 32, dtype=torch.float64).float()
    ref = m[0](x)
    assert fused_qkv.fuse_weights(m) == [m[0]]
    weight, b, ranges = fused_qkv.fused(m[0])
    assert ranges == ((0, 48), (48, 64), (64, 80)) and weight.shape == (80, 32)
    for name, (lo, hi) in zip(fused_qkv.NAMES, ranges):
        p = getattr(m[0], name)
        assert p.weight.data_ptr() == weight[lo:hi].data_ptr()
        assert (p.bias.data_ptr() == b[lo:hi].data_ptr()) if bias else (b is None and p.bias is None)
    assert m.state_dict().keys() == before.keys()
    assert all(torch.equal(m.state_dict()[k], v) for k, v in before.items())
    assert torch.equal(m[0](x), ref)
    assert fused_qkv.fuse_weights(m) == [m[0]] and m[0].q_proj.weight.data_ptr() == weight.data_ptr()  # idempotent
    m[0].k_proj.weight = nn.Parameter(m[0].k_proj.weight.clone(), requires_grad=False)  # copied apart: fused again
    assert fused_qkv.fused(m[0]) is None
    fused_qkv.fuse_weights(m)
    again = fused_qkv.fused(m[0])[0]
    assert again.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
    assert m[0].k_proj.weight.data_ptr() == again[48:].data_ptr()
    assert torch.equal(m[0](x), ref)
    m.double()  # converts each weight on its own: no longer fused, nothing of the fused tensor kept
    assert fused_qkv.fused(m[0]) is None and not [k for k in vars(m[0]) if k.startswith("_kt")]
    torch.testing.assert_close(m[0](x.double()), ref.double(), rtol=1e-6, atol=1e-6)


def test_weights_fused_under_inference_mode_stay_usable_with_autograd():
    torch.manual_seed(2)
    m = nn.Sequential(ToyAttention(True)).requires_grad_(False)
    with torch.inference_mode():
        fused_qkv.fuse_weights(m)
    assert not any(p.is_inference() for p in m.parameters())
    x = torch.randn(2, 32, requires_grad=True)
    m[0](x).sum().backward()  # an inference tensor saved for backward would raise here
    assert x.grad is not None and x.grad.shape == x.shape


def test_swapped_forwards_give_each_projection_its_own_product_and_are_restored():
    """The swap slices the fused product of whatever tensor a projection is given: cross attention (keys and values
    of another tensor) keeps its values; the buffers and forwards are gone after."""
    torch.manual_seed(1)
    m = nn.Sequential(ToyAttention(True)).requires_grad_(False)
    x, y = torch.randn(2, 32), torch.randn(5, 32)
    ref, ref_cross = m[0](x), m[0](x[:1].expand(5, 32), y)
    with fused_qkv.swapped(m) as modules:
        assert modules == [m[0]]
        assert "forward" in m[0].q_proj.__dict__
        torch.testing.assert_close(m[0](x), ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(m[0](x[:1].expand(5, 32), y), ref_cross, rtol=1e-6, atol=1e-6)
    for name in fused_qkv.NAMES:
        p = getattr(m[0], name)
        assert "forward" not in p.__dict__ and not dict(p.named_buffers())


def test_modules_that_cannot_share_a_weight_are_left_alone():
    m = nn.Sequential(ToyAttention(False), ToyAttention(False), ToyAttention(False), ToyAttention(False))
    m.requires_grad_(False)
    m[0].q_proj.weight.requires_grad_(True)  # trainable
    m[1].k_proj = nn.Linear(16, 16, bias=False)  # another input size
    m[2].v_proj = nn.Sequential(nn.Linear(32, 16))  # not exactly nn.Linear (e.g. a peft wrapper)
    m[3].half()
    m[3].v_proj.float()  # mixed dtypes
    ptrs = [p.data_ptr() for p in m.parameters()]
    assert fused_qkv.fuse_weights(m) == []
    assert [p.data_ptr() for p in m.parameters()] == ptrs


def _graph_with_duplicates():
    g = torch.fx.Graph()
    x, w, w2 = g.placeholder("x"), g.placeholder("w"), g.placeholder("w2")
    aten = torch.ops.aten
    outs = []
    for weight in (w, w, w, w2):
        t = g.call_function(aten.permute.default, (weight, [1, 0]))
        mm = g.call_function(aten.mm.default, (x, t))
        outs.append(g.call_function(aten.slice.Tensor, (mm, 1, 0, 2)))
    r1 = g.call_function(aten.rand_like.default, (x,))  # not pure: never merged
    r2 = g.call_function(aten.rand_like.default, (x,))
    g.output((*outs, r1, r2))
    return g


def test_cse_merges_identical_products_only():
    g = _graph_with_duplicates()
    assert cse.dedupe(g) == 6  # two permutes, two products, two slices of w's three copies
    targets = [n.target for n in g.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten.mm.default) == 2  # w's and w2's
    assert targets.count(torch.ops.aten.rand_like.default) == 2
    gm = torch.fx.GraphModule(nn.Module(), g)
    x, w, w2 = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5, 4)
    out = gm(x, w, w2)
    assert torch.equal(out[0], (x @ w.T)[:, :2]) and out[0] is out[2] and torch.equal(out[3], (x @ w2.T)[:, :2])
    assert isinstance(cse.PASS.uuid(), (str, bytes))


def test_compiled_decode_step_runs_one_projection_for_q_k_and_v(monkeypatch):
    """The regionally compiled decoder layer (what the GPU step captures) of a Qwen3-MoE model: the pass removes
    the three products' duplicates (one product left), and the greedy tokens equal the eager layers'."""
    removed = []
    dedupe = cse.dedupe
    monkeypatch.setattr(cse, "dedupe", lambda graph: removed.append(dedupe(graph)) or removed[-1])
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", dtype=torch.float32, num_hidden_layers=3)
    model.generation_config.eos_token_id = None
    ktorch.prepare(model, device="cpu", experts_dtype="bf16", gpu_memory="off")
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(2))

    def steps(compiled: bool) -> list:
        decoder = Decoder(model, 32, torch.device("cpu"), Sampling(), cuda_graphs=False)
        out = []
        with torch.inference_mode():
            decoder.prefill(ids)
            with compiled_layers(model, decoder.cache) if compiled else contextlib.nullcontext():
                for _ in range(4):
                    decoder._step()
                    out.append(int(decoder.token))
        return out

    eager = steps(False)
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        assert steps(True) == eager
    assert max(removed) >= 3, removed  # the layer's graph: the input's view, the weight's transpose, the product
    attention = model.model.layers[0].self_attn
    assert fused_qkv.fused(attention) is not None
    assert steps(False) == eager


@pytest.mark.parametrize("bias", [False, True])
def test_eager_swap_makes_one_product_for_q_k_v_of_one_input(bias, monkeypatch):
    """The eager prefill's one product (``eager_swapped``): q, k, v of one input come from one product, equal to the
    three of their own (float64 reference: the same values up to the product's summation order); keys and values of
    another input (cross attention) or called out of order make their own product; nothing is held after the v
    layer; the forwards are restored."""
    torch.manual_seed(0)
    m = ToyAttention(bias).double().requires_grad_(False)
    x, y = torch.randn(2, 5, 32, dtype=torch.float64), torch.randn(2, 5, 32, dtype=torch.float64)
    want_self, want_cross = m(x), m(x, y)
    products = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: products.append(a[1].shape[0]) or linear(*a))
    with fused_qkv.eager_swapped(m) as modules:
        assert modules == [m]
        torch.testing.assert_close(m(x), want_self, rtol=1e-12, atol=1e-12)
        assert products == [80]  # one product over the fused weight's 48 + 16 + 16 rows
        products.clear()
        torch.testing.assert_close(m(x, y), want_cross, rtol=1e-12, atol=1e-12)
        assert products == [80, 16, 16]  # keys and values of y: their own products
        products.clear()
        k_first = m.k_proj(x)  # out of order: nothing kept for it
        torch.testing.assert_close(k_first, want_self[..., 48:64], rtol=1e-12, atol=1e-12)
        assert products == [16]
    assert all("forward" not in vars(p) for p in (m.q_proj, m.k_proj, m.v_proj))


def test_eager_swap_prefill_gives_the_models_logits():
    """A tiny Qwen3-MoE prefill with the swap gives the logits of the one without it (float32)."""
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", dtype=torch.float32)
    ktorch.prepare(model, device="cpu", experts_dtype="bf16", gpu_memory="off")
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    with torch.no_grad():
        want = model(ids).logits
        with fused_qkv.eager_swapped(model) as modules:
            assert len(modules) == model.config.num_hidden_layers
            got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
