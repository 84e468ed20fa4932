"""The ``"ktorch"`` experts implementation for transformers (>= 5).

transformers dispatches the forward of every experts class decorated with ``@use_experts_implementation``
(Qwen2/3-MoE, DeepSeek-V2/V3, Mixtral, OLMoE, GLM4-MoE, ...) through
``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``, keyed by ``config._experts_implementation``.
``register()`` adds ``"ktorch"`` there, so ``from_pretrained(..., experts_implementation="ktorch")`` and
``model.set_experts_implementation("ktorch")`` route each MoE layer's routed experts to one
``torch.ops.kt.fused_moe`` call: Dynamo sees one op node per layer instead of a data-dependent loop.

The op reads packed weights (``ktorch.pack_experts``). ``attach_packed_experts`` (called by
``ktorch.prepare``) replaces the module's ``gate_up_proj``/``down_proj`` parameters with buffers
``kt_w13``, ``kt_w13_scales``, ``kt_w2``, ``kt_w2_scales`` (and ``kt_w13_bias``, ``kt_w2_bias``) that stay on
the CPU whatever ``model.to()`` is asked later. An experts module that was never prepared is packed (bf16) on its
first eager call.

What the decorator records on the module and what this implementation does with it:
  is_transposed=True       weights are [E, H, 2I] / [E, I, H]; transposed views are packed
  is_concatenated=False    gate/up rows interleaved (g0, u0, g1, u1, ...); de-interleaved when packing (biases too)
  has_bias=True            gate_up_proj_bias (up_proj_bias) and down_proj_bias go to the op as float32 (gpt-oss)
  has_gate=False           up_proj only: the op computes act(up) (Nemotron-H, relu2)
  has_post_expert_norm     not supported (error)
  a custom _apply_gate     recognized from the module's parameters and then checked against the module's own
                           _apply_gate on random inputs: swiglu_oai (gpt-oss, MiniMax-M3), silu_clamped
                           (DeepSeek-V4), softcap_swiglu (Inkling2); any other is an error
  act_fn                   silu, gelu (erf), gelu_tanh, relu, relu2; anything else is an error
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
from typing import Callable, Optional

import torch
from torch import nn

from ktorch.integrations import deferral
from ktorch.ops.host_transfer import to_device, to_host
from ktorch.ops.moe import PackedExperts, pack_experts

IMPLEMENTATION_NAME = "ktorch"
_BUFFERS = ("kt_w13", "kt_w13_scales", "kt_w2", "kt_w2_scales")
_BIAS_BUFFERS = ("kt_w13_bias", "kt_w2_bias")


class UnsupportedExpertsError(ValueError):
    """An experts module uses a feature kt.fused_moe cannot run yet (bias, no gate, custom gating, ...)."""


# ---------------------------------------------------------------- what the module asks for


def is_experts_module(module: nn.Module) -> bool:
    """True for instances of classes decorated with transformers' ``@use_experts_implementation``."""
    return hasattr(module, "has_gate") and hasattr(module, "is_transposed") and hasattr(module, "is_concatenated")


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every transformers experts module in ``model``, in module order."""
    return [(name, m) for name, m in model.named_modules() if is_experts_module(m)]


def _activation_name(module: nn.Module) -> str:
    """The op's name for ``module.act_fn`` ("silu", "gelu", "gelu_tanh", "relu"), or an error."""
    act = getattr(module, "act_fn", None)
    import functools

    from transformers import activations as A

    if isinstance(act, (A.SiLUActivation, nn.SiLU)):
        return "silu"
    if isinstance(act, nn.ReLU):
        return "relu"
    if isinstance(act, A.ReLUSquaredActivation):
        return "relu2"
    if isinstance(act, (A.NewGELUActivation, A.FastGELUActivation)):
        return "gelu_tanh"
    if isinstance(act, A.GELUTanh):
        return "gelu_tanh"
    if isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    if type(act) is A.GELUActivation:
        return "gelu"
    if act is torch.nn.functional.silu:
        return "silu"
    if isinstance(act, functools.partial) and act.func is torch.nn.functional.gelu:
        return "gelu_tanh" if act.keywords.get("approximate") == "tanh" else "gelu"
    raise UnsupportedExpertsError(
        f"ktorch experts: activation {type(act).__name__} of {type(module).__name__} is not supported by "
        "kt.fused_moe (silu, gelu, gelu_tanh, relu, relu2)"
    )


def glu_of_spec(spec: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """What kt.fused_moe computes from gate and up for a gated activation ``spec`` (ktorch.fused_moe lists them), in
    torch: used to check a module's own ``_apply_gate`` against the spec chosen for it."""
    name, _, body = spec.partition("(")
    p = {k.strip(): float(v) for k, v in (item.split("=") for item in body.rstrip(")").split(",") if item)}
    if name == "swiglu_oai":
        g, u = gate.clamp(max=p["limit"]), up.clamp(-p["limit"], p["limit"])
        return (u + 1) * g * torch.sigmoid(p["alpha"] * g)
    if name == "silu_clamped":
        return torch.nn.functional.silu(gate.clamp(max=p["limit"])) * up.clamp(-p["limit"], p["limit"])
    if name == "softcap_swiglu":
        return p["gate"] * torch.tanh(gate / p["gate"]) * torch.sigmoid(gate) * (p["up"] * torch.tanh(up / p["up"]))
    raise ValueError(f"glu_of_spec: {spec!r} is not a gated activation with parameters")


def _custom_gate_candidates(module: nn.Module) -> list[str]:
    """Specs a custom ``_apply_gate`` may stand for, from the parameters the module holds."""
    out = []
    for alpha, limit in (("alpha", "limit"), ("swiglu_alpha", "swiglu_limit")):  # gpt-oss, MiniMax-M3
        a, l = getattr(module, alpha, None), getattr(module, limit, None)
        if isinstance(a, (int, float)) and isinstance(l, (int, float)):
            out.append(f"swiglu_oai(alpha={float(a)!r},limit={float(l)!r})")
    limit = getattr(module, "limit", None)  # DeepSeek-V4: act_fn(gate.clamp) * up.clamp
    if isinstance(limit, (int, float)):
        try:
            if _activation_name(module) == "silu":
                out.append(f"silu_clamped(limit={float(limit)!r})")
        except UnsupportedExpertsError:
            pass
    act = getattr(module, "act_fn", None)  # Inkling2: act_fn(gate, up) with softcaps
    caps = [getattr(getattr(act, n, None), "softcap", None) for n in ("gate_softcap", "up_softcap")]
    if all(isinstance(c, (int, float)) and c > 0 for c in caps):
        out.append(f"softcap_swiglu(gate={float(caps[0])!r},up={float(caps[1])!r})")
    return out


def _custom_gate_spec(module: nn.Module) -> Optional[str]:
    """The spec whose math ``module._apply_gate`` computes, checked on random fp32 inputs (spread past the clamps,
    in the module's gate/up layout), or None."""
    I = getattr(module, "intermediate_dim", None) or getattr(module, "intermediate_size", None) or 64
    gen = torch.Generator().manual_seed(0)
    gate, up = torch.randn(16, I, generator=gen) * 6, torch.randn(16, I, generator=gen) * 6
    if getattr(module, "is_concatenated", True):
        gate_up = torch.cat([gate, up], dim=-1)
    else:
        gate_up = torch.stack([gate, up], dim=-1).reshape(16, 2 * I)
    with torch.no_grad():
        try:
            theirs = type(module)._apply_gate(module, gate_up).float()
        except Exception:
            return None
        for spec in _custom_gate_candidates(module):
            ours = glu_of_spec(spec, gate, up)
            if theirs.shape == ours.shape and torch.allclose(theirs, ours, rtol=1e-4, atol=1e-5):
                return spec
    return None


def check_supported(module: nn.Module) -> str:
    """Raises ``UnsupportedExpertsError`` for flag combinations the op cannot run; returns the activation name."""
    name = type(module).__name__
    from transformers.integrations.moe import _default_apply_gate

    if getattr(module, "has_post_expert_norm", False):
        raise UnsupportedExpertsError(f"ktorch experts: {name} applies a post-expert norm, which kt.fused_moe does not")
    if getattr(module, "_is_expert_parallel", False):
        raise UnsupportedExpertsError(f"ktorch experts: {name} is expert-parallel; ktorch runs all experts in one process")
    if not getattr(module, "has_gate", True):  # h = act_fn(up); _apply_gate is not used
        return _activation_name(module)
    gate = getattr(type(module), "_apply_gate", _default_apply_gate)
    if gate is not _default_apply_gate:
        spec = _custom_gate_spec(module)
        if spec is None:
            raise UnsupportedExpertsError(
                f"ktorch experts: {name} overrides _apply_gate with gating kt.fused_moe does not know (it runs "
                "act(gate) * up, swiglu_oai, silu_clamped and softcap_swiglu)"
            )
        return spec
    return _activation_name(module)


def _unpacked_weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H] gate rows then up rows, down [E, H, I]) as views of the module's parameters; for gateless
    experts (has_gate=False) (up [E, I, H], down)."""
    gated = getattr(module, "has_gate", True)
    gate_up, down = (module.gate_up_proj if gated else module.up_proj), module.down_proj
    if module.is_transposed:  # [E, H, 2I] and [E, I, H]
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    if gated and not module.is_concatenated:  # rows g0, u0, g1, u1, ...
        gate_up = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)
    return gate_up, down


def _unpacked_biases(module: nn.Module) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(gate_up bias [E, 2I] gate then up (gateless: up bias [E, I]), down bias [E, H]), or (None, None)."""
    if not getattr(module, "has_bias", False):
        return None, None
    gated = getattr(module, "has_gate", True)
    b13, b2 = (module.gate_up_proj_bias if gated else module.up_proj_bias), module.down_proj_bias
    if gated and not module.is_concatenated:
        b13 = torch.cat([b13[:, 0::2], b13[:, 1::2]], dim=1)
    return b13, b2


# ---------------------------------------------------------------- packing onto the module


class _PackedExpertsMixin:
    """Mixed into a prepared experts module's class: its packed CPU buffers ignore ``model.to(...)``/``.half()``."""

    def _apply(self, fn, recurse=True):
        lora = self._modules.get("kt_lora")
        if lora is not None:  # LoRA adapters (ktorch.lora) follow the model's device and dtype changes
            lora._apply(fn, recurse)
        return self


_packed_classes: dict[type, type] = {}


def _packed_class(cls: type) -> type:
    if issubclass(cls, _PackedExpertsMixin):
        return cls
    if cls not in _packed_classes:
        _packed_classes[cls] = type(cls.__name__, (_PackedExpertsMixin, cls), {"__module__": cls.__module__})
    return _packed_classes[cls]


def attach_packed_experts(module: nn.Module, packed: PackedExperts, activation: Optional[str] = None) -> None:
    """Gives an experts module its packed weights and drops its unpacked parameters.

    Args:
        module: an instance of a ``@use_experts_implementation`` class.
        packed: this layer's experts, from ``ktorch.pack_experts`` (CPU tensors).
        activation: the op's activation name; by default derived from ``module.act_fn``.

    The packed tensors become buffers ``kt_w13``, ``kt_w13_scales``, ``kt_w2``, ``kt_w2_scales`` (the scales
    are None for bf16); ``gate_up_proj``/``down_proj`` are deleted, so their memory is freed unless something
    else holds them. The module's class is swapped for a subclass whose ``_apply`` is a no-op, so a later
    ``model.to("cuda")`` or ``model.half()`` leaves the experts where they are.
    """
    act = check_supported(module) if activation is None else activation
    if packed.num_experts != getattr(module, "num_experts", packed.num_experts):
        raise ValueError(
            f"attach_packed_experts: {type(module).__name__} has {module.num_experts} experts, packed has {packed.num_experts}"
        )
    for name in ("gate_up_proj", "down_proj"):
        if name in module._parameters:
            delattr(module, name)
    if packed.has_gate != getattr(module, "has_gate", True):
        raise ValueError(f"attach_packed_experts: {type(module).__name__} has has_gate={module.has_gate}, the packed "
                         f"experts {'have' if packed.has_gate else 'lack'} a gate projection")
    for name in ("up_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias"):
        if name in module._parameters:
            delattr(module, name)
    for name, t in zip(_BUFFERS + _BIAS_BUFFERS, packed.tensors() + packed.biases()):
        if t is not None and t.device.type != "cpu":
            raise ValueError(f"attach_packed_experts: packed tensor {name} must be on the CPU, got {t.device}")
        module.register_buffer(name, t, persistent=False)
    module.kt_activation = act
    module.kt_format = packed.format
    module.__class__ = _packed_class(type(module))


def pack_module_experts(module: nn.Module, dtype: str = "bf16", group_size: Optional[int] = None) -> PackedExperts:
    """Packs ``module``'s ``gate_up_proj``/``down_proj`` into the op's layout (on the CPU) and attaches them."""
    act = check_supported(module)
    gate_up, down = _unpacked_weights(module)
    b13, b2 = _unpacked_biases(module)
    if gate_up.device.type == "meta":
        raise ValueError(
            f"pack_module_experts: {type(module).__name__} holds meta tensors; load real weights first, or build "
            "PackedExperts yourself and call attach_packed_experts"
        )
    with torch.no_grad():
        if getattr(module, "has_gate", True):
            packed = pack_experts(gate_up.detach().cpu(), down.detach().cpu(), dtype=dtype, group_size=group_size,
                                  gate_up_bias=b13, down_bias=b2)
        else:
            packed = pack_experts(up_proj=gate_up.detach().cpu(), down_proj=down.detach().cpu(), dtype=dtype,
                                  group_size=group_size, gate_up_bias=b13, down_bias=b2)
    del gate_up, down, b13, b2
    attach_packed_experts(module, packed, act)
    return packed


def attach_gpu_experts(module: nn.Module, expert_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       kernel: str = "auto") -> None:
    """Keeps the experts ``expert_ids`` [n] of a packed experts module on the accelerator as well.

    w13 [n, H, 2I] (gate columns then up columns), w2 [n, I, H], in the model's dtype on its device. From then on
    the module's forward masks those experts' slots to -1 in what it sends to the CPU op and computes them on the
    device (ktorch/ops/gpu_experts.py, ``kernel``), summing both parts. The CPU copy of their packed weights stays
    (the op never reads it)."""
    if getattr(module, "kt_w13", None) is None:
        raise ValueError(f"attach_gpu_experts: {type(module).__name__} is not packed; pack it first")
    _check_device_experts(module, "attach_gpu_experts")
    E = module.kt_w13.shape[0]
    n = expert_ids.numel()
    if w13.shape[0] != n or w2.shape[0] != n or w13.shape[2] != 2 * w2.shape[1] or w13.shape[1] != w2.shape[2]:
        raise ValueError(f"attach_gpu_experts: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit {n} experts")
    if n and (expert_ids.min() < 0 or expert_ids.max() >= E or expert_ids.unique().numel() != n):
        raise ValueError(f"attach_gpu_experts: expert ids must be distinct and in [0, {E}), got {expert_ids.tolist()}")
    slot_of = torch.full((E,), -1, dtype=torch.int64)
    slot_of[expert_ids.cpu()] = torch.arange(n)
    module.register_buffer("kt_gpu_slot_of", slot_of.to(w13.device), persistent=False)
    module.register_buffer("kt_gpu_w13", w13, persistent=False)
    module.register_buffer("kt_gpu_w2", w2, persistent=False)
    module.__dict__.pop("kt_gpu_packed", None)  # these replace residents a GPU budget placed (ktorch.gpu_memory)
    module.kt_gpu_expert_ids = expert_ids.cpu().tolist()
    module.kt_gpu_kernel = kernel


def device_experts_problem(module: nn.Module) -> Optional[str]:
    """Why the device-side expert paths (gpu_experts, streamed_experts: unbiased act(gate) * up with
    silu/gelu/gelu_tanh/relu) cannot run this experts module (packed or not), or None if they can."""
    from ktorch.ops.gpu_experts import ACTIVATIONS

    packed = packed_experts_of(module)
    if packed is not None:
        biased, gated, act = packed.w13_bias is not None or packed.w2_bias is not None, packed.has_gate, module.kt_activation
    else:
        biased, gated, act = getattr(module, "has_bias", False), getattr(module, "has_gate", True), check_supported(module)
    if biased or not gated or act not in ACTIVATIONS:
        return (f"{type(module).__name__} has {'biases' if biased else 'no biases'}, {'a gate' if gated else 'no gate'} "
                f"and activation {act!r}; the device-side experts run unbiased act(gate) * up with "
                f"{'/'.join(ACTIVATIONS)} only")
    return None


def _check_device_experts(module: nn.Module, what: str) -> None:
    problem = device_experts_problem(module)
    if problem is not None:
        raise UnsupportedExpertsError(f"{what}: {problem}")


def gpu_expert_weights(module: nn.Module, expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [n, H, 2I], w2 [n, I, H]) of the unpacked module's experts ``expert_ids``, contiguous, on its device."""
    gate_up, down = _unpacked_weights(module)
    index = expert_ids.to(gate_up.device)
    return (gate_up[index].transpose(1, 2).contiguous().detach(), down[index].transpose(1, 2).contiguous().detach())


def packed_experts_of(module: nn.Module) -> Optional[PackedExperts]:
    """The ``PackedExperts`` attached to ``module``, or None if it was never packed."""
    if getattr(module, "kt_w13", None) is None:
        return None
    return PackedExperts(module.kt_w13, module.kt_w13_scales, module.kt_w2, module.kt_w2_scales, module.kt_format,
                         w13_bias=getattr(module, "kt_w13_bias", None), w2_bias=getattr(module, "kt_w2_bias", None))


# ---------------------------------------------------------------- the experts forward


def ktorch_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts interface: hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K] -> [T, H].

    Runs the routed experts with ``torch.ops.kt.fused_moe`` on the CPU. While Dynamo traces, inputs on another
    device hop to the CPU (``.to("cpu")``) and the result hops back, so each layer is one op node between
    copies; the ktorch backend turns them into the submit/wait pair of the async-boundary pass
    (ktorch/passes/async_boundary.py). Run eagerly from CUDA tensors, the call goes through the same runtime
    (pinned copies, one host sync per layer). A module given ``kt_deferral`` (``ktorch.prepare(...,
    deferred_experts=d)``) defers its lowest-weighted slots to the next layer when run eagerly
    (ktorch/integrations/deferral.py). A layer whose every expert is on the device (resident or ``gpu_experts``) and
    that defers nothing computes there alone and makes no CPU op call.
    """
    if getattr(self, "kt_w13", None) is None:
        if torch.compiler.is_compiling():
            raise RuntimeError(
                f"ktorch experts: {type(self).__name__} was not packed; call ktorch.prepare(model) (or run one eager "
                "forward) before torch.compile"
            )
        pack_module_experts(self)
    if getattr(self, "kt_lora", None) is not None or _needs_grad(self, hidden_states, top_k_weights):
        return _run_differentiable(self, hidden_states, top_k_index, top_k_weights)
    routed = getattr(self, "kt_routed", None)
    counts = captured_counts = None
    if routed is not None and hidden_states.shape[0] >= routed.min_tokens and not torch.compiler.is_compiling():
        from ktorch.ops.routed_experts import expert_counts

        counts = expert_counts(top_k_index, self.kt_w13.shape[0])
        resident_ids = getattr(self, "kt_gpu_expert_ids", None)
        if hidden_states.is_cuda and torch.cuda.is_current_stream_capturing():
            # a captured prefill (ktorch.generation): the split on the device, counted after each replay
            captured_counts, counts = counts, None
        elif routed.copies_possible(resident_ids):
            counts = counts.cpu()  # the split decides what to copy from them: one host sync per layer
        else:  # nothing to copy (every expert resident, or no staging): counted on the device, read later
            routed.record(counts, resident_ids)
            counts = None
    gpu_work = None
    if getattr(self, "kt_gpu_slot_of", None) is not None:
        top_k_index, gpu_work = _split_gpu_experts(self, hidden_states, top_k_index, top_k_weights)
    plan = getattr(self, "kt_stream_plan", None)
    if plan is not None and plan.experts_for(hidden_states.shape[0]):
        top_k_index, gpu_work = _split_streamed_experts(self, hidden_states, top_k_index, top_k_weights,
                                                        plan.experts_for(hidden_states.shape[0]), gpu_work)
    if counts is not None:
        top_k_index, gpu_work = _split_routed_experts(self, hidden_states, top_k_index, top_k_weights, counts,
                                                      gpu_work)
    if captured_counts is not None:
        chosen = None
        if routed.copies_possible(getattr(self, "kt_gpu_expert_ids", None)):
            top_k_index, gpu_work, chosen = _captured_split(self, hidden_states, top_k_index, top_k_weights,
                                                            captured_counts, gpu_work)
        if _COUNTS_RECORDER is not None:
            _COUNTS_RECORDER.append((self, captured_counts, chosen))
    chain = getattr(self, "kt_deferral", None) is not None
    compiling = torch.compiler.is_compiling()
    defers = chain and not compiling and deferral.defers(hidden_states.shape[0])  # prefill-sized calls do not
    # the CPU op would get no slot: no call (no copies, no host functions in a captured step); under torch.compile a
    # model given deferral keeps its call (the deferral pass's)
    if gpu_work is not None and not defers and not (chain and compiling) and _every_expert_on_device(self):
        return gpu_work()
    if defers:
        return deferral.deferred_experts_forward(self, hidden_states, top_k_index, top_k_weights, _run_experts, gpu_work)
    return _run_experts(self, hidden_states, top_k_index, top_k_weights, gpu_work)


_COUNTS_RECORDER: Optional[list] = None  # recording_counts' list while a prefill is captured


@contextlib.contextmanager
def recording_counts(into: list):
    """While open, each experts call captured in a CUDA graph that a routing-aware split would count (``kt_routed``,
    a prefill-sized call) appends (its module, its rows per expert [E] on the device, the ids it copied [E] padded
    with -1 or None) to ``into``: a captured prefill reads them after each replay into the split's counters
    (``RoutedExperts.record``)."""
    global _COUNTS_RECORDER
    outer, _COUNTS_RECORDER = _COUNTS_RECORDER, into
    try:
        yield into
    finally:
        _COUNTS_RECORDER = outer


def padding_mask_hooks(model: nn.Module, real_rows: Callable[[], Optional[torch.Tensor]]) -> list:
    """Forward pre-hooks on ``model``'s packed experts modules (their handles returned) that give the rows at or past
    ``real_rows()`` (a device tensor, or None: no padding this call) expert id -1, which the experts skip (the CPU
    op reads no expert for them, the device kernels sort them out; their output rows are 0 and unused). For steps
    padded to a captured graph's size (serve's token buckets, generate's captured prefill): tensor ops on the step's
    own buffers, so a graph replays the mask with the step. A one-row call is never masked."""

    def experts_pre(module, args, kwargs):
        real = real_rows()
        if real is None:
            return None
        if "top_k_index" in kwargs:
            ids = kwargs["top_k_index"]
        elif len(args) > 1:
            ids = args[1]
        else:
            return None
        if ids.shape[0] == 1:  # a one-row step has no padding rows (a graphed step has a real token)
            return None
        rows = torch.arange(ids.shape[0], device=ids.device)
        masked = torch.where((rows < real)[:, None], ids, -1)
        if "top_k_index" in kwargs:
            return args, {**kwargs, "top_k_index": masked}
        return (args[0], masked, *args[2:]), kwargs

    return [m.register_forward_pre_hook(experts_pre, with_kwargs=True) for m in model.modules()
            if getattr(m, "kt_w13", None) is not None]


def _every_expert_on_device(self: nn.Module) -> bool:
    """Whether the device holds every expert of this layer (residents or ``gpu_experts``): known when placed, not per
    call, so a captured decode step that skips the CPU op stays valid while swaps change which experts are where."""
    return len(getattr(self, "kt_gpu_expert_ids", None) or ()) == self.kt_w13.shape[0]


def _needs_grad(self: nn.Module, hidden_states: torch.Tensor, top_k_weights: torch.Tensor) -> bool:
    """Whether this call must be differentiable: grad mode on and the inputs need it."""
    return torch.is_grad_enabled() and (hidden_states.requires_grad or top_k_weights.requires_grad)


def _run_differentiable(self: nn.Module, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
    """A differentiable call (ktorch/ops/moe_autograd.py): differentiable copies to the CPU and back
    (ktorch/ops/host_transfer.py: pinned, one wait a direction) instead of the runtime's submit/wait; a module with
    adapters (``kt_lora``) always comes here, with or without grad, and runs ``ktorch.lora.expert_lora_forward``.
    Expert deferral and prefill streaming have no backward and are refused."""
    if getattr(self, "kt_deferral", None) is not None:
        raise RuntimeError(f"ktorch experts: {type(self).__name__} defers experts, which has no backward; "
                           "set_deferred_experts(model, 0) before training")
    if getattr(self, "kt_stream_plan", None) is not None or getattr(self, "kt_routed", None) is not None:
        raise RuntimeError(f"ktorch experts: {type(self).__name__} streams experts to the GPU, which has no backward; "
                           "set_stream_experts(model, None) before training")
    if getattr(self, "kt_lora", None) is not None:
        if getattr(self, "kt_gpu_slot_of", None) is not None:
            raise RuntimeError(f"ktorch experts: {type(self).__name__} keeps experts on the GPU (gpu_experts); expert "
                               "adapters need every expert on the CPU op")
        # the adapters carry their forward (ktorch/lora.py imports this module, so no import back)
        return self.kt_lora.experts_forward(self, hidden_states, top_k_index, top_k_weights)
    handle = getattr(self, "kt_train_handle", None)
    if handle is not None:  # trained on hidden's device, the GPU (ktorch/ops/train_experts.py)
        return torch.ops.ktorch.train_experts(hidden_states, top_k_index, top_k_weights, None, handle,
                                              self.kt_activation, False)[0]
    gpu_work = None
    if getattr(self, "kt_gpu_slot_of", None) is not None:
        top_k_index, gpu_work = _split_gpu_experts(self, hidden_states, top_k_index, top_k_weights)
    hidden_c, ids_c, weights_c = to_host(hidden_states, top_k_index, top_k_weights)
    out = torch.ops.kt.fused_moe(hidden_c, ids_c, weights_c, self.kt_w13, self.kt_w13_scales, self.kt_w2,
                                 self.kt_w2_scales, self.kt_activation, getattr(self, "kt_w13_bias", None),
                                 getattr(self, "kt_w2_bias", None))
    (out,) = to_device(hidden_states.device, out)
    return out if gpu_work is None else out + gpu_work()


def _split_gpu_experts(self: nn.Module, hidden_states, top_k_index, top_k_weights):
    """(ids for the CPU [T, K] with the device-resident experts' slots set to -1, a callable computing those
    experts' part [T, H] on the device). See ktorch/ops/gpu_experts.py and ``attach_gpu_experts``."""
    from ktorch.ops import triton_experts
    from ktorch.ops.gpu_experts import gpu_experts_forward, packed_experts_forward
    from ktorch.ops.resident_rows import RowExperts, rows_experts_forward

    slot_of = self.kt_gpu_slot_of  # [E] int64 on the device: index among the device experts, or -1
    packed = getattr(self, "kt_gpu_packed", None)  # the budget's residents (ktorch.gpu_memory) on the device
    held = packed[0] if packed is not None else self.kt_gpu_w13
    if slot_of.device != hidden_states.device or held.device != hidden_states.device:
        raise ValueError(f"ktorch experts: {type(self).__name__}'s device experts are on {held.device} (slot map on "
                         f"{slot_of.device}) and its input on {hidden_states.device}; run the model on the device "
                         "they were placed on, or place them again there (ktorch.prepare / set_stream_experts with "
                         "gpu_memory, attach_gpu_experts)")
    hits = getattr(self, "kt_gpu_hits", None)  # slots << 32 | slots on residents (ktorch.gpu_memory), capturable;
    # padding rows' -1 slots (serve's padded steps) count as neither
    if triton_experts.route_applies(top_k_index):  # one kernel (a decode step replays it per layer)
        slots, cpu_ids = triton_experts.triton_route(top_k_index, slot_of, hits)
    else:  # the same in ATen ops (CPU; traced and fused under Dynamo)
        slots = torch.where(top_k_index >= 0, slot_of[top_k_index.clamp(min=0)], -1)
        on_device = slots >= 0
        cpu_ids = torch.where(on_device, -1, top_k_index)
        if hits is not None and not torch.compiler.is_compiling():  # no host sync
            routed = torch.where(top_k_index >= 0, 1 << 32, 0)
            hits.add_(torch.where(on_device, routed + 1, routed).sum())


    def gpu_work() -> torch.Tensor:
        if isinstance(packed, RowExperts):  # int8/int4 on CUDA with Triton: fused decode kernels (resident_rows.py)
            return rows_experts_forward(hidden_states, slots, top_k_weights, packed, self.kt_activation,
                                        self.kt_gpu_kernel)
        if packed is not None:
            return packed_experts_forward(hidden_states, slots, top_k_weights, packed, self.kt_activation,
                                          self.kt_gpu_kernel)
        return gpu_experts_forward(hidden_states, slots, top_k_weights, self.kt_gpu_w13, self.kt_gpu_w2,
                                   self.kt_activation, self.kt_gpu_kernel)

    return cpu_ids, gpu_work


def _split_streamed_experts(self: nn.Module, hidden_states, top_k_index, top_k_weights, n: int, gpu_work=None):
    """(ids for the CPU [T, K] with experts [0, n) set to -1, a callable computing those experts' part [T, H] on
    hidden's device by streaming their packed weights there, plus ``gpu_work()`` if given). See
    ktorch/ops/streamed_experts.py and ``attach_streamed_experts``. ``top_k_index`` already has the
    device-resident experts masked, so they are not streamed again."""
    from ktorch.ops.streamed_experts import cpu_ids_without

    handle = self.kt_stream_handle

    def stream_work() -> torch.Tensor:
        out = torch.ops.ktorch.streamed_experts(hidden_states, top_k_index, top_k_weights, handle, n)
        return out if gpu_work is None else out + gpu_work()

    return cpu_ids_without(top_k_index, n), stream_work


def _split_routed_experts(self: nn.Module, hidden_states, top_k_index, top_k_weights, counts: torch.Tensor,
                          gpu_work=None):
    """The routing-aware prefill split (ktorch/ops/routed_experts.py): from the call's rows per expert ``counts``
    (CPU), the experts to copy to hidden's device; (ids for the CPU op with theirs masked too, a callable computing
    their part there plus ``gpu_work()``). ``top_k_index`` already has the resident experts masked."""
    from ktorch.ops.routed_experts import route_for

    routed = self.kt_routed
    chosen = routed.choose(counts, routed.resident_mask(getattr(self, "kt_gpu_expert_ids", None)))
    if chosen.numel() == 0:
        cpu_ids, routed_work = top_k_index, gpu_work
    else:
        slots, cpu_ids = route_for(top_k_index, chosen, routed.num_experts)

        def routed_work() -> torch.Tensor:
            out = routed.device_part(hidden_states, top_k_index, top_k_weights, chosen, slots)
            return out if gpu_work is None else out + gpu_work()

    if routed.calls is not None and routed_work is not None:  # a benchmark times the device part (SplitCall)
        routed_work = routed.calls[-1].timed(routed_work, hidden_states.device)
    return cpu_ids, routed_work


def _captured_split(self: nn.Module, hidden_states, top_k_index, top_k_weights, counts: torch.Tensor, gpu_work=None):
    """The routing-aware split inside a captured prefill (``RoutedExperts.captured_split``: the choice, the gather
    and the grouped kernels on the device, no host sync): (ids for the CPU op, a callable computing the copied
    experts' part plus ``gpu_work()``, the chosen ids [E] padded with -1). ``top_k_index`` has the resident experts
    masked already; ``counts`` [E] are the call's rows per expert over all its experts."""
    slot_of = getattr(self, "kt_gpu_slot_of", None)
    resident = None if slot_of is None else slot_of >= 0  # on the device: swaps change it in place
    cpu_ids, copied_work, chosen = self.kt_routed.captured_split(hidden_states, top_k_index, top_k_weights, counts,
                                                                 resident)

    def work() -> torch.Tensor:
        out = copied_work()
        return out if gpu_work is None else out + gpu_work()

    return cpu_ids, work, chosen


def attach_streamed_experts(module: nn.Module, plan, kernel: str = "auto", pin: Optional[bool] = None) -> None:
    """Lets a packed experts module stream a prefix of its experts to the accelerator on long inputs.

    ``plan``: a ``ktorch.ops.streamed_experts.StreamPlan`` (or a {min_tokens: experts or fraction} table): from
    ``plan.experts_for(T)`` = n > 0 on, a call with T tokens computes experts [0, n) on the hidden states' device,
    their packed weights copied there per call, while the CPU op computes the rest (their slots masked to -1);
    the two parts are summed. ``pin`` (default: when CUDA is available) page-locks those experts' packed bytes so
    that the copies are asynchronous and can be captured in CUDA graphs."""
    from ktorch.ops.streamed_experts import StreamedExperts, StreamPlan, register_streamed_experts

    if getattr(module, "kt_w13", None) is None:
        raise ValueError(f"attach_streamed_experts: {type(module).__name__} is not packed; pack it first")
    _check_device_experts(module, "attach_streamed_experts")
    E = module.kt_w13.shape[0]
    if isinstance(plan, dict):
        plan = StreamPlan.from_table(plan, E)
    if plan.max_experts > E:
        raise ValueError(f"attach_streamed_experts: the plan streams {plan.max_experts} experts; the layer has {E}")
    old = getattr(module, "kt_stream_handle", None)
    if old is not None:
        from ktorch.ops.streamed_experts import streamed_experts_of

        streamed_experts_of(old).unpin()
    streamed = StreamedExperts(module.kt_w13, module.kt_w13_scales, module.kt_w2, module.kt_w2_scales,
                               module.kt_activation, kernel)
    if pin if pin is not None else torch.cuda.is_available():
        streamed.pin_prefix(plan.max_experts)
    streamed.plan = plan
    module.kt_stream_handle = register_streamed_experts(streamed)
    module.kt_stream_plan = plan


def _run_experts(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor, gpu_work=None) -> torch.Tensor:
    """The packed module's routed experts for hidden_states [T, H], top_k_index/top_k_weights [T, K] -> [T, H],
    plus ``gpu_work()`` (the device-resident experts' part) when given, computed while the CPU works."""
    device = hidden_states.device
    if device.type == "cuda" and not torch.compiler.is_compiling():
        return _run_on_cpu_from_cuda(self, hidden_states, top_k_index, top_k_weights, gpu_work)
    if device.type != "cpu":
        hidden_states = hidden_states.to("cpu")
        top_k_index = top_k_index.to("cpu")
        top_k_weights = top_k_weights.to("cpu")
    from ktorch.compile.experts_runtime import timed

    # the split's costs learn from the call's seconds (None under Dynamo: nothing timed in a traced call)
    out = timed(lambda: torch.ops.kt.fused_moe(hidden_states, top_k_index, top_k_weights, self.kt_w13,
                                               self.kt_w13_scales, self.kt_w2, self.kt_w2_scales, self.kt_activation,
                                               getattr(self, "kt_w13_bias", None), getattr(self, "kt_w2_bias", None)),
                _cpu_observer(self))
    if device.type != "cpu":
        out = out.to(device)
    if gpu_work is not None:  # traced after the CPU call: the async-boundary pass moves it before the wait
        out = out + gpu_work()
    return out


def _cpu_observer(module: nn.Module):
    """What the CPU op call about to run reports its seconds to: the prefill split's costs (``RoutedExperts
    .cpu_observer``) after a split choice, else None. Not under Dynamo (a compiled call is no split's)."""
    routed = getattr(module, "kt_routed", None)
    if routed is None or torch.compiler.is_compiling():
        return None
    return routed.cpu_observer()


def _run_on_cpu_from_cuda(module: nn.Module, hidden_states, top_k_index, top_k_weights, gpu_work=None) -> torch.Tensor:
    """Eager call from CUDA tensors: the experts runtime's submit and wait back to back (pinned non-blocking
    copies, one host sync) instead of three blocking copies to pageable memory."""
    from ktorch.compile.experts_runtime import RUNTIME

    ids = getattr(module, "_kt_runtime_ids", None)
    if ids is None or ids[0] is not module.kt_w13:
        layer = RUNTIME.register_layer(module.kt_w13, module.kt_w13_scales, module.kt_w2, module.kt_w2_scales,
                                       module.kt_activation, getattr(module, "kt_w13_bias", None),
                                       getattr(module, "kt_w2_bias", None))
        ids = module._kt_runtime_ids = (module.kt_w13, layer, RUNTIME.new_site())
    _, layer, site = ids
    ticket = RUNTIME.submit(hidden_states, top_k_index, top_k_weights, layer, site, join_now=gpu_work is None,
                            observe=_cpu_observer(module))
    gpu_out = gpu_work() if gpu_work is not None else None  # on the GPU while the CPU runs its experts
    out = RUNTIME.wait(ticket, hidden_states, layer, site)
    return out if gpu_out is None else out + gpu_out


def register() -> bool:
    """Adds ``"ktorch"`` to transformers' ``ALL_EXPERTS_FUNCTIONS``; False when transformers (>= 5) is absent.

    ``get_correct_experts_implementation`` validates names against that mapping (5.17 and 5.23 alike), so the
    registration is all ``from_pretrained(..., experts_implementation="ktorch")`` needs.
    """
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return False
    ExpertsInterface.register(IMPLEMENTATION_NAME, ktorch_experts_forward)
    return True


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers "ktorch" right after ``transformers.integrations.moe`` is executed, whoever imports it first.

    Importing that module costs seconds, so ``import ktorch`` does not do it; transformers imports it itself
    (modeling_utils does) before it validates any ``experts_implementation``.
    """

    def find_spec(self, fullname, path, target=None):
        if fullname != _MOE_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _remove_hook()
            register()

        spec.loader.exec_module = exec_then_register
        return spec


_MOE_MODULE = "transformers.integrations.moe"
_hook = _RegisterOnImport()


def _remove_hook() -> None:
    if _hook in sys.meta_path:
        sys.meta_path.remove(_hook)


def register_when_imported() -> None:
    """Registers "ktorch" now if transformers' experts interface is loaded, else as soon as it is."""
    if _MOE_MODULE in sys.modules:
        register()
    elif _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)
