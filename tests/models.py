"""Tiny random-weight transformers MoE models for the integration, pass and compile tests.

One config per family the issue names, small enough that a forward takes milliseconds on two cores, with
hidden and expert-intermediate sizes that are multiples of 32 (the op's packing needs it) and at least two
MoE layers. ``initializer_range`` is raised above the families' 0.02 so the routed experts move the
residual stream by a visible amount: with tiny weights every test would pass even with the experts wrong.
"""

from __future__ import annotations

import torch

FAMILIES = ("qwen3_moe", "deepseek_v3", "mixtral", "olmoe")

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.08,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=None,
    pad_token_id=None,
)

_CONFIGS = {
    "qwen3_moe": dict(
        num_hidden_layers=2,
        intermediate_size=96,
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        head_dim=16,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    # Layer 0 dense (first_k_dense_replace), then MoE layers with a shared expert and grouped routing
    # (n_group groups, topk_group of them chosen) on sigmoid scores.
    "deepseek_v3": dict(
        num_hidden_layers=3,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        num_key_value_heads=4,
    ),
    "mixtral": dict(
        num_hidden_layers=2,
        intermediate_size=96,
        num_local_experts=8,
        num_experts_per_tok=2,
        head_dim=16,
    ),
    "olmoe": dict(
        num_hidden_layers=2,
        intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
    ),
}


def tiny_config(family: str, **overrides):
    """The transformers config of the tiny ``family`` model (one of FAMILIES)."""
    from transformers import AutoConfig

    kwargs = {**_COMMON, **_CONFIGS[family], **overrides}
    return AutoConfig.for_model(family, **kwargs)


def tiny_model(family: str, dtype: torch.dtype = torch.float32, experts_implementation: str = "eager", **overrides):
    """A randomly initialised tiny causal LM of ``family`` in eval mode on the CPU (seeded by torch's global RNG)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    config._experts_implementation = experts_implementation
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def moe_experts_modules(model) -> list:
    """The routed-experts modules of ``model``, in layer order."""
    from ktorch.placement import experts_modules

    return [m for _, m in experts_modules(model)]


# ---------------------------------------------------------------- comparing against HF eager, routing flips aside
#
# Top-k routing is discontinuous: two runs whose hidden states differ by rounding alone can pick a different
# expert for a token whose router scores nearly tie, and that token (and, through attention, every later one)
# then differs by far more than rounding. The comparisons below therefore record each MoE layer's routing and
# the router's input in both models. Up to the first routing difference, outputs must agree within tolerance;
# at that difference the two routers' inputs must agree within tolerance (so the flip is a near-tie that
# rounding explains, not a wrong result); past it, nothing more is compared.


class RoutingRecorder:
    """Records, per call of each MoE block, the router's input [T, H] and the chosen expert set [T, K] (sorted)."""

    def __init__(self, model):
        self.calls: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (layer name, router input, sorted ids)
        self._pending: dict[str, torch.Tensor] = {}
        self._handles = []
        from ktorch.placement import experts_modules

        names = {name for name, _ in experts_modules(model)}
        modules = dict(model.named_modules())
        for name in names:
            block = modules[name.rsplit(".", 1)[0]]
            self._handles.append(block.register_forward_pre_hook(self._block_hook(name)))
            self._handles.append(modules[name].register_forward_pre_hook(self._experts_hook(name)))

    def _block_hook(self, name):
        def hook(module, args):
            x = args[0]
            self._pending[name] = x.detach().reshape(-1, x.shape[-1]).float().cpu()

        return hook

    def _experts_hook(self, name):
        def hook(module, args):
            ids = args[1].detach().cpu().sort(-1).values
            self.calls.append((name, self._pending.pop(name), ids))

        return hook

    def remove(self):
        for h in self._handles:
            h.remove()


def first_routing_flip(ref: RoutingRecorder, test: RoutingRecorder):
    """The earliest routing difference between two batch-1 runs that made the same calls, or None.

    Returns (position, call index, token index in that call): position is the token's place in the sequence
    (a forward's tokens follow the previous forward's, as in generate), and among the layers that route that
    position differently, the call is the first one. Every position before it, and every earlier layer at it,
    routed identically in both runs, so the router input of that call is computed from identical routing."""
    offset, best = 0, None
    seen_layers: set = set()
    for i, ((name_a, x_a, ids_a), (name_b, _, ids_b)) in enumerate(zip(ref.calls, test.calls)):
        assert name_a == name_b and ids_a.shape == ids_b.shape, f"MoE call {i}: {name_a} {ids_a.shape} vs {name_b} {ids_b.shape}"
        if name_a in seen_layers:  # a new forward starts with the first layer again
            offset += prev_tokens
            seen_layers.clear()
        seen_layers.add(name_a)
        prev_tokens = ids_a.shape[0]
        rows = (ids_a != ids_b).any(-1).nonzero().flatten()
        if rows.numel() and (best is None or offset + int(rows[0]) < best[0]):
            best = (offset + int(rows[0]), i, int(rows[0]))
    return best


def assert_flip_is_near_tie(ref: RoutingRecorder, test: RoutingRecorder, flip, rtol: float) -> None:
    """At a routing flip, the two routers must have been given inputs within ``rtol`` of each other."""
    _, i, t = flip
    name, x_ref, ids_ref = ref.calls[i]
    _, x_test, ids_test = test.calls[i]
    err = ((x_test[t] - x_ref[t]).norm() / x_ref[t].norm()).item()
    assert err <= rtol, (
        f"{name} (MoE call {i}) routes token {t} to {ids_test[t].tolist()} instead of {ids_ref[t].tolist()} and its "
        f"router input differs from HF eager's by {err:.2e} (> {rtol:.0e}): not a rounding near-tie"
    )
