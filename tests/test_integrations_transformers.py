"""The "ktorch" transformers experts implementation and ktorch.prepare, on tiny random models (CPU only).

For each family (Qwen3-MoE, DeepSeek-V3, Mixtral, OLMoE): each MoE layer's experts output matches HF eager's
on the same input; the prepared model's logits match HF eager (experts_implementation="eager"); 32 greedy
tokens from generate (static cache) are identical; the decode step traces with no graph break. Routing flips
at router near-ties are handled as tests/models.py explains.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ktorch
from ktorch.integrations import UnsupportedExpertsError, ktorch_experts_forward, packed_experts_of
from models import (
    FAMILIES,
    PROMPT,
    assert_greedy_matches,
    assert_logits_match,
    decode_step_inputs,
    moe_experts_modules,
    tiny_model,
)
from reference import fused_moe_reference, relative_error

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def prepared_copy(model: nn.Module, experts_dtype: str = "bf16", group_size=None) -> nn.Module:
    return ktorch.prepare(copy.deepcopy(model), device="cpu", experts_dtype=experts_dtype, group_size=group_size)


# ---------------------------------------------------------------- registration


def test_registered_in_transformers():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert ALL_EXPERTS_FUNCTIONS["ktorch"] is ktorch_experts_forward


def test_from_config_and_set_experts_implementation_accept_ktorch():
    model = tiny_model("qwen3_moe", experts_implementation="ktorch")
    assert model.config._experts_implementation == "ktorch"
    ref = tiny_model("qwen3_moe")
    ref.set_experts_implementation("ktorch")
    assert ref.config._experts_implementation == "ktorch"


def test_unprepared_model_packs_on_first_call():
    """An experts module never prepared is packed (bf16) on its first call; the logits match HF eager's up to the
    first routing flip, which must be a near-tie (bf16 experts against fp32 ones: some seeds flip one)."""
    model = tiny_model("olmoe")
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 256, (1, 10))
    model.set_experts_implementation("ktorch")
    assert_logits_match(ref, model, torch.float32, ids)
    assert all(packed_experts_of(m) is not None for m in moe_experts_modules(model))


# ---------------------------------------------------------------- prepare


def test_prepare_packs_and_frees_experts():
    model = tiny_model("deepseek_v3", dtype=torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    experts = moe_experts_modules(model)
    expert_params = sum(m.gate_up_proj.numel() + m.down_proj.numel() for m in experts)
    ktorch.prepare(model, device="cpu", experts_dtype="int8")
    assert sum(p.numel() for p in model.parameters()) == n_params - expert_params
    for m in experts:
        assert not hasattr(m, "gate_up_proj") and not hasattr(m, "down_proj")
        assert m.kt_w13.dtype == torch.int8 and m.kt_w13_scales.dtype == torch.float32
    assert model.config._experts_implementation == "ktorch"
    # A later dtype or device move leaves the packed experts alone.
    model.to(torch.float32)
    assert all(m.kt_w13.dtype == torch.int8 for m in experts)
    assert model.lm_head.weight.dtype == torch.float32


def test_prepare_rejects_gpu_experts_device():
    with pytest.raises(ValueError, match="experts_device must be 'cpu'"):
        ktorch.prepare(tiny_model("olmoe"), device="cpu", experts_device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prepare_places_everything_else_on_the_gpu():
    model = ktorch.prepare(tiny_model("deepseek_v3", dtype=torch.bfloat16), device="cuda", gpu_memory="off")
    assert all(p.device.type == "cuda" for p in model.parameters())
    for m in moe_experts_modules(model):
        assert m.kt_w13.device.type == "cpu"
    ids = torch.randint(0, 256, (1, 10), device="cuda")
    assert model(ids).logits.device.type == "cuda"


# ---------------------------------------------------------------- flags the op cannot run


def _experts_class(**flags):
    from transformers.activations import ACT2FN
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation(**flags)
    class Experts(nn.Module):
        def __init__(self, config, act="silu"):
            super().__init__()
            E, H, I = 4, 64, 32
            self.num_experts = E
            shape_gu, shape_d = ((E, H, 2 * I), (E, I, H)) if flags.get("is_transposed") else ((E, 2 * I, H), (E, H, I))
            self.gate_up_proj = nn.Parameter(torch.randn(shape_gu) * 0.1)
            self.down_proj = nn.Parameter(torch.randn(shape_d) * 0.1)
            if flags.get("has_bias"):
                self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * I))
                self.down_proj_bias = nn.Parameter(torch.zeros(E, H))
            self.act_fn = ACT2FN[act]

    return Experts


def _experts_config():
    from transformers import PretrainedConfig

    config = PretrainedConfig()
    config._experts_implementation = "ktorch"
    return config


@pytest.mark.parametrize(
    "flags,act,match",
    [
        (dict(has_post_expert_norm=True), "silu", "post-expert norm"),
        (dict(), "tanh", "activation"),
    ],
    ids=["post_expert_norm", "tanh"],
)
def test_unsupported_experts_raise(flags, act, match):
    """(Biases, gateless experts and the known custom gatings run: tests/test_integrations_families.py.)"""
    import inspect

    from transformers.integrations.moe import use_experts_implementation

    accepted = inspect.signature(use_experts_implementation).parameters
    if any(f not in accepted for f in flags):  # (the device's transformers 5.17 predates has_post_expert_norm)
        pytest.skip(f"this transformers' use_experts_implementation takes no {sorted(set(flags) - set(accepted))}")
    module = _experts_class(**flags)(_experts_config(), act=act)
    with pytest.raises(UnsupportedExpertsError, match=match):
        ktorch.integrations.check_supported(module)
    with pytest.raises(UnsupportedExpertsError, match=match):
        module(torch.randn(3, 64), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2))


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh", "relu"])
def test_transposed_interleaved_layout(act):
    """Weights stored transposed ([E, H, 2I], [E, I, H]) with gate/up rows interleaved (is_concatenated=False, as
    the decorator documents it) are repacked right. Reference: transformers' batched_mm on the same weights
    stored the default way. (batched_mm itself ignores is_concatenated; it leaves interleaving to _apply_gate.)"""
    from transformers.integrations.moe import batched_mm_experts_forward

    module = _experts_class(is_transposed=True, is_concatenated=False)(_experts_config(), act=act).to(torch.bfloat16)
    plain = _experts_class()(_experts_config(), act=act)
    with torch.no_grad():
        gate_up = module.gate_up_proj.float().transpose(1, 2)  # [E, 2I, H], rows g0, u0, g1, u1, ...
        plain.gate_up_proj.copy_(torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1))
        plain.down_proj.copy_(module.down_proj.float().transpose(1, 2))
    hidden = torch.randn(5, 64, dtype=torch.bfloat16)
    ids = torch.randint(0, 4, (5, 2))
    weights = torch.rand(5, 2)
    want = batched_mm_experts_forward(plain, hidden.float(), ids, weights)
    got = module(hidden, ids, weights)
    assert relative_error(got, want) <= 1e-2


# ---------------------------------------------------------------- numerics against HF eager


def _capture_experts_calls(model: nn.Module, ids: torch.Tensor) -> dict[str, tuple]:
    """{experts module name: (hidden, top_k_index, top_k_weights, output)} of one forward of ``model``."""
    from ktorch.placement import experts_modules

    calls, handles = {}, []
    for name, m in experts_modules(model):
        def hook(module, args, output, name=name):
            calls[name] = tuple(a.detach().clone() for a in args) + (output.detach().clone(),)

        handles.append(m.register_forward_hook(hook))
    model(ids)
    for h in handles:
        h.remove()
    return calls


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_experts_output_matches_eager(family, dtype, fmt):
    """Each MoE layer, given HF eager's inputs, returns HF eager's experts output (bf16: within bf16 rounding;
    int8/int4: within quantization error, measured against the dequantized weights)."""
    model = tiny_model(family, dtype=dtype)
    prepared = prepared_copy(model, fmt, 32 if fmt == "int4" else None)
    calls = _capture_experts_calls(model, torch.randint(0, 256, (2, 9)))
    packed_modules = dict(prepared.named_modules())
    assert len(calls) == len(moe_experts_modules(model)) >= 2
    for name, (hidden, ids, weights, want) in calls.items():
        module = packed_modules[name]
        got = module(hidden, ids, weights)
        assert got.dtype == want.dtype and got.shape == want.shape
        if fmt == "bf16":
            err = relative_error(got, want)
            assert err <= 1e-2, f"{name}: relative error {err:.3g} to HF eager"
        else:
            gate_up, down = packed_experts_of(module).dequantize()
            ref = fused_moe_reference(hidden, ids, weights, gate_up, down, module.kt_activation)
            err = relative_error(got, ref)
            assert err <= {"int8": 3e-2, "int4": 8e-2}[fmt], f"{name}: relative error {err:.3g} ({fmt})"


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_eager(family, dtype):
    model = tiny_model(family, dtype=dtype)
    prepared = prepared_copy(model)
    ids = torch.randint(0, 256, (1, 48))
    assert_logits_match(model, prepared, dtype, ids)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_matches_eager(family, dtype):
    model = tiny_model(family, dtype=dtype)
    prepared = prepared_copy(model)
    assert_greedy_matches(model, prepared, dtype, torch.randint(0, 256, (1, PROMPT)))


# ---------------------------------------------------------------- tracing


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_step_has_no_graph_break(family):
    torch._dynamo.reset()
    model = ktorch.prepare(tiny_model(family, dtype=torch.bfloat16), device="cpu")
    kwargs = decode_step_inputs(model)
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(**kwargs)
    assert explanation.graph_break_count == 0, [str(b.reason) for b in explanation.break_reasons]
    assert explanation.graph_count == 1
    n_moe = len(moe_experts_modules(model))
    graph = explanation.graphs[0]
    n_ops = sum(1 for node in graph.graph.nodes if node.target in (torch.ops.kt.fused_moe, torch.ops.kt.fused_moe.default))
    assert n_ops == n_moe, f"{n_ops} kt.fused_moe nodes for {n_moe} MoE layers"
