"""LoRA beside the frozen packed experts, in peft's format.

peft adapts attention (``q_proj``, ``k_proj``, ... are ordinary ``nn.Linear`` on the accelerator) as it does for any
model. It cannot adapt ktorch's experts: their weights are packed CPU buffers, not the ``gate_up_proj`` /
``down_proj`` parameters its ``target_parameters`` wraps. This module gives every packed experts module per-expert
low-rank adapters with peft's own layout for those parameters (``peft.tuners.lora.ParamWrapper``):

    lora_A.weight [r * E, in],  lora_B.weight [out, r * E]
    A_e = lora_A.weight.view(E, r, in)[e],  B_e = lora_B.weight.view(out, r, E)[:, :, e],  delta W_e = s * B_e A_e

with s = lora_alpha / r (or / sqrt(r) with rslora), gate_up's in/out = H/2I, down's = I/H. The math of one experts
module with adapters (x_t the token, h the GLU output, w the routing weight):

    [g | u] = x_t W13_e^T + s * (x_t A13_e^T) B13_e^T         the gate/up adapter adds to the pre-activations
    h       = act(g) * u
    out[t] += w * (h W2_e^T + s * (h A2_e^T) B2_e^T)          the down adapter adds to the expert's output

The frozen part runs on the CPU through ``kt.fused_moe_delta`` (ktorch/ops/moe_autograd.py: the gate/up deltas go
in, h comes back); the adapters' products run with torch ops where the hidden states are (the GPU when the model is
prepared for one), as two dense products per factor: x @ A^T for all experts at once ([T, r E]) then each pair's
expert slice, and the rank-r vectors scattered into their expert's block of a zero matrix times B^T: [T K, r E] for
gate/up (a delta per pair), [T, r E] for down (its output is summed over a token's slots, so the slots share a row:
K times fewer products). That reads every adapter once per call and needs no grouping; on a GPU it costs little
beside the CPU experts. The tensors crossing to the CPU op and back (hidden, routing, deltas, out, h and their
gradients) go through ktorch/ops/host_transfer.py (pinned memory, one wait a direction), the deltas in hidden's
dtype when that is bf16/fp16.

Saving and loading (``save_adapter`` / ``load_adapter``) write peft's files (adapter_config.json with
``target_parameters``, adapter_model.safetensors with peft's key names), so an adapter trained with ktorch loads
into the unpacked transformers model with ``peft.PeftModel.from_pretrained`` and one trained there loads here.
"""

from __future__ import annotations

import json
import math
import os
from typing import Iterable, Optional

import torch
from torch import nn

from ktorch.integrations.transformers_experts import packed_experts_of
from ktorch.ops.host_transfer import to_device, to_host
from ktorch.ops.triton_train import contract_pairs, expand_pairs, kernel_runs_on
from ktorch.placement import experts_modules

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")  # the order transformers' experts classes define them in


class ExpertLoRAFactors(nn.Module):
    """One adapted expert parameter: ``lora_A`` (nn.Linear in -> r E) and ``lora_B`` (nn.Linear r E -> out), as
    peft's ParamWrapper holds them."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, r: int, device=None,
                 dtype=torch.float32):
        super().__init__()
        self.num_experts, self.r = num_experts, r
        self.lora_A = nn.Linear(in_features, r * num_experts, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(r * num_experts, out_features, bias=False, device=device, dtype=dtype)
        # peft's default init: A kaiming-uniform, B zero (the adapted model starts equal to the base model)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def _per_pair(self, x: torch.Tensor) -> bool:
        """Whether the products run per pair (ktorch/ops/triton_train.py: each pair reads only its expert's block)
        instead of dense over all experts' blocks: where the Triton kernels run (a CUDA GPU), float32/bf16/fp16
        factors, not under torch.compile. Both compute A_e x and B_e u with float32 sums."""
        return (self.lora_A.weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and not torch.compiler.is_compiling() and kernel_runs_on(x))

    def project_in(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, in] (the same for every slot) or [T, K, in] -> each pair's A_e x: [T, K, r]; ids [T, K] in [0, E)."""
        E, r = self.num_experts, self.r
        T, K = ids.shape
        A = self.lora_A.weight  # row e * r + j: element (e, j, c) at e r in + j in + c
        if self._per_pair(x):
            n_in = A.shape[1]
            y = contract_pairs(x.to(A.dtype).reshape(-1, n_in), ids.reshape(-1), A, (r * n_in, n_in, 1), E, r,
                               rows=K if x.dim() == 2 else 1)
            return y.view(T, K, r)
        y = x.to(A.dtype) @ A.t()  # [..., E r], row e * r + j of lora_A
        y = y.view(T, 1, E, r).expand(T, K, E, r) if x.dim() == 2 else y.view(T, K, E, r)
        return y.gather(2, ids.view(T, K, 1, 1).expand(T, K, 1, r)).squeeze(2)

    def project_out(self, u: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """u [T, K, r] -> each pair's B_e u: [T, K, out]; ids [T, K] in [0, E)."""
        E, r = self.num_experts, self.r
        T, K = ids.shape
        B = self.lora_B.weight  # column j * E + e: element (e, j, c) at e + j E + c r E
        if self._per_pair(u):
            return expand_pairs(u.to(B.dtype).reshape(-1, r), ids.reshape(-1), B, (1, E, r * E), E,
                                B.shape[0]).view(T, K, B.shape[0])
        z = u.new_zeros(T, K, r, E)  # column j * E + e of lora_B
        z.scatter_(3, ids.view(T, K, 1, 1).expand(T, K, r, 1), u.unsqueeze(3))
        return z.view(T, K, r * E) @ B.t()

    def project_out_sum(self, u: torch.Tensor, ids: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        """sum_k coef[t, k] * B_{ids[t, k]} u[t, k]: [T, out]; u [T, K, r], coef [T, K], ids [T, K] in [0, E).

        One [T, r E] x [r E, out] product, K times smaller than ``project_out``'s [T K, r E] one: B is linear, so a
        token's slots can share its row, each slot's coef * u added into its expert's block (scatter_add: repeated
        experts add up; skipped slots, clamped to expert 0 with coef 0, add zeros)."""
        E, r = self.num_experts, self.r
        T, K = ids.shape
        v = (u * coef.unsqueeze(-1).to(u.dtype)).transpose(1, 2)  # [T, r, K]
        z = v.new_zeros(T, r, E).scatter_add_(2, ids.view(T, 1, K).expand(T, r, K), v)  # column j * E + e of lora_B
        return z.view(T, r * E) @ self.lora_B.weight.t()


class ExpertsLoRA(nn.Module):
    """The adapters of one packed experts module: ``gate_up_proj`` and/or ``down_proj`` factors and the scaling."""

    def experts_forward(self, module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
        """``expert_lora_forward(module, ...)``: what the experts integration calls for a module with adapters."""
        return expert_lora_forward(module, hidden, top_k_index, top_k_weights)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, r: int, lora_alpha: float,
                 targets: Iterable[str], use_rslora: bool = False, device=None, dtype=torch.float32):
        super().__init__()
        targets = tuple(targets)
        bad = [t for t in targets if t not in EXPERT_PARAMETERS]
        if bad or not targets:
            raise ValueError(f"ExpertsLoRA: targets must be among {EXPERT_PARAMETERS}, got {targets}")
        if r <= 0:
            raise ValueError(f"ExpertsLoRA: r must be a positive integer, got {r}")
        self.r, self.lora_alpha, self.use_rslora = r, lora_alpha, use_rslora
        self.scaling = lora_alpha / (math.sqrt(r) if use_rslora else r)
        E, H, I = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = (ExpertLoRAFactors(E, H, 2 * I, r, device, dtype) if "gate_up_proj" in targets else None)
        self.down_proj = ExpertLoRAFactors(E, I, H, r, device, dtype) if "down_proj" in targets else None

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(t for t in EXPERT_PARAMETERS if getattr(self, t) is not None)


def expert_lora_forward(module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """The routed experts of a packed ``module`` with its adapters (``module.kt_lora``): hidden [T, H],
    top_k_index/top_k_weights [T, K] on one device -> [T, H] there. The frozen experts run on the CPU
    (``kt.fused_moe_delta``), the adapters on hidden's device; differentiable in hidden, the routing weights and
    the adapters.

    What crosses between hidden's device and the CPU (ktorch/ops/host_transfer.py: pinned memory, one wait a
    direction): hidden, the routing, the gate/up deltas [T, K, 2I] and, with a down adapter, h [T, K, I] (and their
    gradients back). The deltas cross in hidden's dtype when that is bf16/fp16 (half the bytes of fp32; the kernels
    add them to fp32 pre-activations that the GLU reads and ``gate_up`` returns in that dtype, so the rounding is
    one more of the same size: relative 2^-9 of the delta, not of the pre-activation), and so does their gradient;
    fp32/fp64 hidden states keep fp32 deltas (the exact paths of the tests)."""
    lora: ExpertsLoRA = module.kt_lora
    device = hidden.device
    T, K = top_k_index.shape
    n13 = module.kt_w13.shape[1] * 16  # 2I (gated experts); gateless experts have no gate_up adapter
    valid = top_k_index >= 0
    ids = top_k_index.clamp(min=0).long()
    low = hidden.dtype in (torch.bfloat16, torch.float16)
    delta_dtype = hidden.dtype if low else torch.float32
    crossing = [hidden, top_k_index, top_k_weights]
    delta = None
    if lora.gate_up_proj is not None:
        f = lora.gate_up_proj
        delta = f.project_out(f.project_in(hidden, ids), ids) * (lora.scaling * valid.unsqueeze(-1))
        if not getattr(module, "is_concatenated", True):  # B's rows follow the parameter's interleaved g0, u0, g1, ...
            delta = torch.cat([delta[..., 0::2], delta[..., 1::2]], dim=-1)
        delta = delta.to(delta_dtype)
        crossing.append(delta)
    handle = getattr(module, "kt_train_handle", None)
    if handle is not None:  # the frozen experts on hidden's device (ktorch/ops/train_experts.py)
        out, h = torch.ops.ktorch.train_experts(hidden, top_k_index, top_k_weights, delta, handle,
                                                module.kt_activation, lora.down_proj is not None)
        if lora.down_proj is None:
            return out
        return out + _down_adapter(lora, h, ids, top_k_weights, valid).to(out.dtype)
    hidden_c, ids_c, weights_c, *delta_c = to_host(*crossing)
    # no gate/up adapter: zero deltas made where the op runs, nothing to cross
    delta_c = delta_c[0] if delta_c else torch.zeros(T, K, n13, dtype=delta_dtype)
    out, h, _ = torch.ops.kt.fused_moe_delta(hidden_c, ids_c, weights_c, module.kt_w13, module.kt_w13_scales,
                                             module.kt_w2, module.kt_w2_scales, delta_c, module.kt_activation,
                                             getattr(module, "kt_w13_bias", None), getattr(module, "kt_w2_bias", None))
    if lora.down_proj is None:
        (out,) = to_device(device, out)
        return out
    out, h = to_device(device, out, h)
    return out + _down_adapter(lora, h, ids, top_k_weights, valid).to(out.dtype)


def _down_adapter(lora: ExpertsLoRA, h: torch.Tensor, ids: torch.Tensor, top_k_weights: torch.Tensor,
                  valid: torch.Tensor) -> torch.Tensor:
    """The down adapter's part of the output, sum_k w * s B_e A_e h: [T, H]."""
    f = lora.down_proj
    coef = (top_k_weights * valid) * lora.scaling
    return f.project_out_sum(f.project_in(h, ids), ids, coef)


# ---------------------------------------------------------------- adding, saving and loading adapters


def add_expert_lora(model: nn.Module, r: int = 8, lora_alpha: float = 16, targets: Iterable[str] = EXPERT_PARAMETERS,
                    use_rslora: bool = False, device=None, dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    """Gives every packed experts module of ``model`` LoRA adapters (peft's per-expert layout) and returns their
    parameters (trainable; everything else about the experts stays frozen).

    ``targets``: "gate_up_proj" and/or "down_proj" (peft's ``target_parameters`` names without the module path).
    ``device``: where the adapters live and run (default: where the model's other parameters are, the GPU for a
    model prepared for one). Call after ``ktorch.prepare`` (the experts must be packed). Replaces earlier adapters."""
    modules = experts_modules(model)
    if not modules or any(packed_experts_of(m) is None for _, m in modules):
        raise ValueError("add_expert_lora: prepare the model first (its experts must be packed)")
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    params = []
    targets = tuple(targets)
    for name, m in modules:
        packed = packed_experts_of(m)
        E, H, I = packed.num_experts, packed.hidden_size, packed.intermediate_size
        if not packed.has_gate and "gate_up_proj" in targets:
            raise ValueError(f"add_expert_lora: {name} has gateless experts (up_proj, no gate_up_proj); adapt only "
                             "their down_proj (targets=('down_proj',))")
        m.kt_lora = ExpertsLoRA(E, H, I, r, lora_alpha, targets, use_rslora, device, dtype)
        params += list(m.kt_lora.parameters())
    return params


def remove_expert_lora(model: nn.Module) -> None:
    """Drops the experts' adapters: the experts run through the fast inference op again."""
    for _, m in experts_modules(model):
        if getattr(m, "kt_lora", None) is not None:
            del m.kt_lora


def _strip_peft_prefix(name: str) -> str:
    """The module path inside the transformers model, whether ``model`` is a PeftModel or not."""
    for prefix in ("base_model.model.",):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name


def _expert_lora_factors(model: nn.Module):
    """(peft key prefix, factor module with lora_A/lora_B) of every expert adapter, under the keys peft gives
    ``target_parameters`` adapters (``base_model.model.<module>.[base_layer.]lora_A.weight``): with both parameters
    targeted peft wraps gate_up_proj first (the inner wrapper, ``base_layer.``) and down_proj around it."""
    for name, m in experts_modules(model):
        lora = getattr(m, "kt_lora", None)
        if lora is None:
            continue
        path = "base_model.model." + _strip_peft_prefix(name)
        targets = lora.targets
        for depth, t in enumerate(targets):  # innermost first: base_layer. repeated (outer wrappers - depth) times
            yield path + ".base_layer" * (len(targets) - 1 - depth), getattr(lora, t)


def expert_lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The experts' adapters under peft's keys (see ``_expert_lora_factors``)."""
    out = {}
    for prefix, f in _expert_lora_factors(model):
        out[f"{prefix}.lora_A.weight"] = f.lora_A.weight.detach().cpu().contiguous()
        out[f"{prefix}.lora_B.weight"] = f.lora_B.weight.detach().cpu().contiguous()
    return out


def load_expert_lora_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copies peft-keyed expert adapters (``expert_lora_state_dict``'s keys) into the model's ``kt_lora`` modules;
    raises naming the key on a missing or misshapen tensor."""
    factors = list(_expert_lora_factors(model))
    if not factors:
        raise ValueError("load_expert_lora_state_dict: the model has no expert adapters (add_expert_lora first)")
    for prefix, f in factors:
        for part in ("lora_A", "lora_B"):
            key = f"{prefix}.{part}.weight"
            if key not in state:
                raise KeyError(f"load_expert_lora_state_dict: the adapter has no {key}")
            w = getattr(f, part).weight
            if tuple(state[key].shape) != tuple(w.shape):
                raise ValueError(f"load_expert_lora_state_dict: {key} is {tuple(state[key].shape)}, the model "
                                 f"needs {tuple(w.shape)}")
            with torch.no_grad():
                w.copy_(state[key])


def _expert_target_parameters(model: nn.Module) -> list[str]:
    targets = set()
    for name, m in experts_modules(model):
        lora = getattr(m, "kt_lora", None)
        if lora is not None:
            suffix = _strip_peft_prefix(name).split(".")[-2:]  # e.g. "mlp.experts"
            targets.update(".".join(suffix + [t]) for t in lora.targets)
    return sorted(targets)


def save_adapter(model: nn.Module, path: str, peft_config=None) -> None:
    """Writes the model's adapters as a peft adapter folder (adapter_config.json + adapter_model.safetensors).

    ``model``: a prepared model with expert adapters (``add_expert_lora``), optionally wrapped by
    ``peft.get_peft_model`` for attention adapters (pass nothing for ``peft_config``: the PeftModel's is used).
    Without peft adapters, ``peft_config`` may be None (a LoraConfig is written with the experts' r and alpha)."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    state = {}
    config = peft_config
    if hasattr(model, "peft_config"):
        config = config or model.peft_config["default"]
        state.update({k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model).items()
                      if ".kt_lora." not in k})
    experts = expert_lora_state_dict(model)
    lora = next((m.kt_lora for _, m in experts_modules(model) if getattr(m, "kt_lora", None) is not None), None)
    if config is None:
        if lora is None:
            raise ValueError("save_adapter: the model has no adapters")
        config = LoraConfig(r=lora.r, lora_alpha=lora.lora_alpha, use_rslora=lora.use_rslora, target_modules=[])
    if lora is not None:
        if (config.r, config.lora_alpha, config.use_rslora) != (lora.r, lora.lora_alpha, lora.use_rslora):
            raise ValueError(f"save_adapter: the experts' adapters have r={lora.r}, lora_alpha={lora.lora_alpha}, "
                             f"use_rslora={lora.use_rslora}; the config says r={config.r}, "
                             f"lora_alpha={config.lora_alpha}, use_rslora={config.use_rslora}: peft's format has one")
    state.update(experts)
    os.makedirs(path, exist_ok=True)
    d = config.to_dict()
    d["target_parameters"] = _expert_target_parameters(model) or None
    for k, v in list(d.items()):
        if isinstance(v, set):
            d[k] = sorted(v)
    if hasattr(model, "peft_config"):
        base = getattr(model.get_base_model(), "name_or_path", None)
        d["base_model_name_or_path"] = d.get("base_model_name_or_path") or base
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(d, f, indent=2, default=str)
    save_file(state, os.path.join(path, "adapter_model.safetensors"))


def load_adapter(model: nn.Module, path: str, is_trainable: bool = False, device=None):
    """Loads a peft adapter folder (from ``save_adapter`` or from peft on the unpacked model) into a prepared model.

    Adapters on parameters of the experts (``target_parameters`` ending in gate_up_proj / down_proj) become the
    experts' ``kt_lora`` adapters; adapters on modules (``target_modules``) go through peft
    (``peft.get_peft_model``). Returns the PeftModel when there were module adapters, else ``model``.
    ``is_trainable``: leave the adapters' parameters requiring grad."""
    from peft import LoraConfig, get_peft_model
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    with open(os.path.join(path, "adapter_config.json")) as f:
        d = json.load(f)
    state = load_file(os.path.join(path, "adapter_model.safetensors"))
    targets = d.pop("target_parameters", None) or []
    expert_targets = sorted({t.rsplit(".", 1)[-1] for t in targets})
    unknown = [t for t in expert_targets if t not in EXPERT_PARAMETERS]
    if unknown:
        raise ValueError(f"load_adapter: target_parameters {unknown} are not experts' gate_up_proj / down_proj")
    result = model
    if d.get("target_modules"):  # peft first: it marks every parameter it does not own as frozen
        known = set(LoraConfig.__dataclass_fields__)
        config = LoraConfig(**{k: v for k, v in d.items() if k in known and k not in ("peft_type", "task_type")})
        config.inference_mode = not is_trainable
        result = get_peft_model(model, config)
    expert_keys = set()
    if expert_targets:
        ordered = [t for t in EXPERT_PARAMETERS if t in expert_targets]
        params = add_expert_lora(result, r=d["r"], lora_alpha=d["lora_alpha"], targets=ordered,
                                 use_rslora=d.get("use_rslora", False), device=device)
        expert_keys = set(expert_lora_state_dict(result))
        load_expert_lora_state_dict(result, state)
        for p in params:
            p.requires_grad_(is_trainable)
    rest = {k: v for k, v in state.items() if k not in expert_keys}
    if result is model:
        if rest:
            raise ValueError(f"load_adapter: tensors {sorted(rest)[:3]} match no adapter of the model")
        return model
    loaded = set_peft_model_state_dict(result, rest)
    if loaded.unexpected_keys:
        raise ValueError(f"load_adapter: tensors {loaded.unexpected_keys[:3]} match no adapter of the model")
    return result
