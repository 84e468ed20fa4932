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
    """Records each routed-experts call of a model: (layer name, experts input [T, H] fp32, chosen experts [T, K]
    sorted). For the four families tested, the experts' input is also the router's input.

    Eager calls are recorded by hooks on the experts modules (which do nothing while Dynamo traces); calls that
    go through ktorch's experts runtime (graphs of the ktorch backend, eager calls from CUDA) are recorded by an
    observer of the runtime, on the worker thread, CUDA-graph replays included. Modules with experts on the GPU
    (prepare(gpu_experts=...), or prepare's default placement on a GPU: ``kt_gpu_slot_of``) are recorded by their
    hooks only, so in eager runs only: the runtime sees their ids masked (or nothing, all of them resident).
    ``blind`` names those modules: a run whose forwards are compiled has none of their compiled calls, and
    ``first_routing_flip`` then compares the calls of the other modules only."""

    def __init__(self, model):
        from ktorch.compile.experts_runtime import RUNTIME
        from ktorch.placement import experts_modules

        self.calls: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self._handles = []
        self._names = {}
        self.blind: set = set()
        for name, module in experts_modules(model):
            self._handles.append(module.register_forward_pre_hook(self._hook(name)))
            self._names[name] = module
            if getattr(module, "kt_gpu_slot_of", None) is not None:
                self.blind.add(name)
        self._runtime = RUNTIME
        RUNTIME.observers.append(self._observe)

    def _record(self, name, hidden, ids):
        # a copy whatever the dtype and device: an fp32 CPU tensor's .float().cpu() is the tensor itself, and the
        # runtime's observer is handed its pinned staging buffer, which the next call at that site overwrites
        hidden = hidden.detach().to("cpu", torch.float32, copy=True)
        self.calls.append((name, hidden, ids.detach().cpu().sort(-1).values))

    def _hook(self, name):
        def hook(module, args):
            if torch.compiler.is_compiling():
                return
            if (args[0].device.type == "cuda" and getattr(module, "kt_w13", None) is not None
                    and getattr(module, "kt_gpu_slot_of", None) is None):
                return  # a prepared module called from CUDA goes through the runtime, whose observer records it
            self._record(name, args[0], args[1])

        return hook

    def _observe(self, layer, hidden, ids, weights):
        for name, module in self._names.items():
            # a module with experts on the GPU sends the CPU its ids with those masked: its hook records it instead
            if getattr(module, "kt_w13", None) is layer.w13 and getattr(module, "kt_gpu_slot_of", None) is None:
                self._record(name, hidden, ids)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()

    def remove(self):
        for h in self._handles:
            h.remove()
        if self._observe in self._runtime.observers:
            self._runtime.observers.remove(self._observe)


def compared_calls(ref: RoutingRecorder, test: RoutingRecorder) -> tuple[list, list]:
    """The two runs' calls that ``first_routing_flip`` compares (see there), asserted to be as many."""
    calls_a, calls_b = ref.calls, test.calls
    blind = ref.blind | test.blind
    if len(calls_a) != len(calls_b) and blind:
        calls_a = [c for c in calls_a if c[0] not in blind]
        calls_b = [c for c in calls_b if c[0] not in blind]
    assert len(calls_a) == len(calls_b), (
        f"{len(calls_a)} MoE calls recorded in one run, {len(calls_b)} in the other"
        + (f" (the calls of {sorted(blind)} left out)" if blind else ""))
    return calls_a, calls_b


def first_routing_flip(ref: RoutingRecorder, test: RoutingRecorder):
    """The earliest routing difference between two batch-1 runs that made the same calls, or None.

    Returns (position, call index, token index in that call): position is the token's place in the sequence
    (a forward's tokens follow the previous forward's, as in generate), and among the layers that route that
    position differently, the call is the first one. Every position before it, and every earlier layer at it,
    routed identically in both runs, so the router input of that call is computed from identical routing.

    Where the runs recorded different numbers of calls and either has modules whose compiled calls no recorder sees
    (``RoutingRecorder.blind``: experts on the GPU, recorded by hooks in eager forwards only), only the other modules'
    calls are compared (none when every module is blind: no flip is then known, and the caller's checks of tokens and
    logits apply in full). The call index is then among the compared calls."""
    calls_a, calls_b = compared_calls(ref, test)
    offset, best = 0, None
    seen_layers: set = set()
    for i, ((name_a, x_a, ids_a), (name_b, _, ids_b)) in enumerate(zip(calls_a, calls_b)):
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
    calls_ref, calls_test = compared_calls(ref, test)  # flip's call index is among these
    name, x_ref, ids_ref = calls_ref[i]
    _, x_test, ids_test = calls_test[i]
    err = ((x_test[t] - x_ref[t]).norm() / x_ref[t].norm()).item()
    assert err <= rtol, (
        f"{name} (MoE call {i}) routes token {t} to {ids_test[t].tolist()} instead of {ids_ref[t].tolist()} and its "
        f"router input differs from HF eager's by {err:.2e} (> {rtol:.0e}): not a rounding near-tie"
    )


# ---------------------------------------------------------------- model-level comparisons

# Largest logit difference to HF eager allowed where routing agrees (measured: <= 0.014 fp32, <= 0.031 bf16 with
# logits of magnitude ~3), and the router-input difference below which a routing flip is a rounding near-tie
# (measured: <= 0.002 fp32, <= 0.0062 bf16).
LOGIT_ATOL = {torch.float32: 0.05, torch.bfloat16: 0.1}
ROUTER_RTOL = {torch.float32: 1e-2, torch.bfloat16: 3e-2}
PROMPT, NEW_TOKENS = 12, 32


def assert_logits_match(ref_model, test_model, dtype, ids: torch.Tensor, test_forward=None) -> None:
    """Logits of one forward agree within LOGIT_ATOL up to the first routing flip, which must be a near-tie.

    ``test_forward`` (default: ``test_model``) is what runs the test side, e.g. a compiled model."""
    test_forward = test_model if test_forward is None else test_forward
    with torch.no_grad():
        with RoutingRecorder(ref_model) as ref_routing, RoutingRecorder(test_model) as kt_routing:
            want, got = ref_model(ids).logits.float(), test_forward(ids).logits.float()
        flip = first_routing_flip(ref_routing, kt_routing)
        n = ids.shape[1] if flip is None else flip[0]
        if flip is not None:
            assert_flip_is_near_tie(ref_routing, kt_routing, flip, ROUTER_RTOL[dtype])
        diff = (got[0, :n] - want[0, :n]).abs().max().item() if n else 0.0
        assert diff <= LOGIT_ATOL[dtype], f"max logit difference {diff:.3g} over the first {n} positions"


def assert_greedy_matches(ref_model, test_model, dtype, prompt: torch.Tensor, new_tokens: int = NEW_TOKENS, **gen_kwargs):
    """Greedy generate (static cache) gives the same tokens, or diverges only at a rounding near-tie.

    A divergence at step s is accepted when (a) routing flipped at a near-tie at or before that token, or
    (b) no routing flipped, the two models' logits at s agree within LOGIT_ATOL, and HF eager's own margin between
    the two tokens is below 2 * LOGIT_ATOL. Before the divergence (or the first flip) logits must agree."""
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                  output_logits=True, return_dict_in_generate=True)
    # On a GPU, generate compiles static-cache decoding on its own unless told not to: eager means eager.
    gen_kwargs.setdefault("disable_compile", "compile_config" not in gen_kwargs)
    with RoutingRecorder(ref_model) as ref_routing:
        ref = ref_model.generate(prompt, **kwargs, disable_compile=True)
    with RoutingRecorder(test_model) as test_routing:
        test = test_model.generate(prompt, **kwargs, **gen_kwargs)
    p = prompt.shape[1]
    a, b = ref.sequences[0, p:].cpu(), test.sequences[0, p:].cpu()
    assert a.shape == b.shape == (new_tokens,)
    differ = (a != b).nonzero().flatten()
    s = int(differ[0]) if differ.numel() else new_tokens
    flip = first_routing_flip(ref_routing, test_routing)
    # Step j's logits come from the forward that saw the token at position p - 1 + j.
    checked = min(s + 1, new_tokens) if flip is None else min(s + 1, new_tokens, flip[0] - p + 1)
    for j in range(max(checked, 0)):
        diff = (test.logits[j][0].float().cpu() - ref.logits[j][0].float().cpu()).abs().max().item()
        assert diff <= LOGIT_ATOL[dtype], f"step {j}: max logit difference {diff:.3g}, tokens {a.tolist()} vs {b.tolist()}"
    if s == new_tokens:
        return
    if flip is not None and flip[0] <= p - 1 + s:
        assert_flip_is_near_tie(ref_routing, test_routing, flip, ROUTER_RTOL[dtype])
        return
    logits = ref.logits[s][0].float().cpu()
    margin = (logits[a[s]] - logits[b[s]]).item()
    assert margin <= 2 * LOGIT_ATOL[dtype], (
        f"greedy tokens diverge at step {s} ({a.tolist()} vs {b.tolist()}) where HF eager's margin is {margin:.3g}"
    )


def decode_step_inputs(model, prompt_len: int = PROMPT, max_len: int = 64) -> dict:
    """Forward kwargs of one decode step (a static cache filled by an eager prefill of a random prompt)."""
    from transformers import StaticCache

    device = next(model.parameters()).device
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    ids = torch.randint(0, 256, (1, prompt_len), device=device)
    with torch.no_grad():
        out = model(ids, past_key_values=cache, cache_position=torch.arange(prompt_len, device=device), use_cache=True)
    nxt = out.logits[:, -1:].argmax(-1)
    pos = torch.tensor([prompt_len], device=device)
    return dict(input_ids=nxt, past_key_values=cache, cache_position=pos, position_ids=pos[None], use_cache=True)


def teacher_forced_decode(step, kwargs, tokens, cuda_graphs: bool) -> torch.Tensor:
    """Logits [n, V] of decode steps fed ``tokens`` [n] (teacher-forced: every model compared sees the same
    inputs); ``kwargs`` as from decode_step_inputs, advanced in place."""
    logits = []
    for token in tokens:
        if cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        kwargs["input_ids"] = token.view(1, 1)
        logits.append(step(**kwargs).logits[:, -1].float().clone())
        kwargs["cache_position"] = kwargs["cache_position"] + 1
        kwargs["position_ids"] = kwargs["cache_position"][None]
    return torch.cat(logits)
