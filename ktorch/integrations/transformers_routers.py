"""transformers' softmax top-k routers on ktorch's one-kernel top-k (``torch.ops.ktorch.router_topk``) in the
captured decode step.

A router of Qwen2/3-MoE, OLMoE, Mixtral, FlexOlmo, MiniMax, Qwen3-Next, Qwen3-VL/Omni-MoE, Jamba, ... computes

    logits = hidden @ W^T;  p = softmax(float32(logits));  w, ids = topk(p, K);  [w /= sum(w)];  [w = w.to(dtype)]

(dtype: the logits'; Granite-MoE and Aria take the top-k of the logits and a softmax over those K: the same
values). In the decode step, compiled by Inductor, that was a fused softmax kernel, ATen's topk (gatherTopK and a
bitonic sort) and the renormalization: 0.44 ms of a 5.15 ms step on the 48-layer Qwen3-30B-A3B shape (device,
H200 host). ``swapped`` gives each router that computes exactly this a forward that calls the one kernel of
ktorch/ops/triton_router.py after its own linear layer, for the duration of ``Decoder.capture``.

Which routers (``router_form``): the class name ends in ``Router``; the module holds one parameter, ``weight``
[E, H], no buffers and no submodules (a score-correction bias, a per-expert scale or a norm is not this
computation, even where a probe with their initial values could not tell); an int ``top_k``; ``forward(hidden)``.
Then a probe decides how the weights come out (renormalized or not, rounded to the logits' dtype or left float32,
the input flattened to [T, H] first or not): the original forward and each candidate run on the same random rows
(the router's copy with random weights, in its dtype, and again in float32); a candidate fits when the logits are
equal, at every rank the two picks have the same probability (ties may be ordered differently: the kernel takes the
lowest expert first, ATen's topk on CUDA leaves it unspecified), the weights have the same dtype and agree to
that dtype's rounding, and in float32 to 1e-5. No fitting candidate: the router is left alone (sigmoid and
group-limited DeepSeek routers, bias-corrected ones, Gemma-4's and DeepSeek-V2's scaled ones, Llama-4's sigmoid;
tests/test_triton_router.py lists the classes tried). The probe runs on the router's device, so it judges the
ATen ops the step would otherwise run; its answer is kept per class and plain attributes (``top_k``,
``norm_topk_prob``, ``topk_method``, ...), dtype and shape.

The swap is made only where the kernel runs on the router weight's device (Triton, CUDA), and not for a trainable
model (``prepare(trainable=True)``: every router weight requires grad); the swapped forward falls back to the class's
own for more than ``DECODE_MAX_TOKENS`` rows (prefill) and where the router's weight needs grad.

The swapped forward computes the logits as a float32 multiply-and-sum, rounded once to the input's dtype, which
Inductor compiles into one reduction kernel over the experts; cuBLAS's product of one row ran on two thread blocks
(5.1 us a layer). Measured (session 36, H200 host, 48-layer Q8_0 file, every expert resident, two calls of
``bench_generate --ab-compile 1 --ab-variants default "reduction router"``): decode 267.2 -> 278.4 and 262.6 ->
273.9 tok/s, the step's kernels 3.42 -> 3.27 ms. The logits then differ from the linear layer's by the order of the
sums: at most a rounding of their dtype, so the routing differs only where two experts tie to that rounding (the
probe, which decides the form, compares the class's forward with the linear layer's logits, exactly).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import types
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ktorch.ops import triton_router

DECODE_MAX_TOKENS = 64  # rows a call takes the kernel for (a decode step has 1); larger calls (prefill) keep ATen's
PROBE_ROWS = 16
PROBE_SEED = 20261126


@dataclass(frozen=True)
class RouterForm:
    renormalize: bool  # weights divided by their sum
    cast: bool  # weights rounded to the logits' dtype (Qwen-MoE), else float32 (Mixtral)
    flatten: bool  # the input reshaped to [T, H] first, so [T, E] / [T, K] outputs whatever its leading dims


CANDIDATES = tuple(RouterForm(r, c, f) for f in (True, False) for r in (True, False) for c in (True, False))
_FORMS: dict = {}  # (class, plain attributes, dtype, shape, device type) -> RouterForm or None


def _routers(model: nn.Module) -> list:
    return [m for m in model.modules() if type(m).__name__.endswith("Router")]


def _shape_fits(m: nn.Module) -> Optional[str]:
    """None where ``m`` has the shape of a softmax top-k router the kernel takes, else why not."""
    params = dict(m.named_parameters())
    if list(params) != ["weight"] or list(m.buffers()) or list(m.children()):
        return "holds more than one weight [E, H] (a bias, a scale, a submodule)"
    w = params["weight"]
    top_k = getattr(m, "top_k", None)
    if w.dim() != 2 or not w.is_floating_point() or not 1 <= w.shape[0] <= triton_router.MAX_EXPERTS:
        return f"weight {tuple(w.shape)} {w.dtype} is not [E <= {triton_router.MAX_EXPERTS}, H] floating"
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= min(w.shape[0],
                                                                                      triton_router.MAX_TOP_K):
        return f"top_k {top_k!r} is not an int in [1, min(E, {triton_router.MAX_TOP_K})]"
    try:
        params = list(inspect.signature(type(m).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return "forward has no signature"
    if len(params) != 1 or params[0].kind not in (inspect.Parameter.POSITIONAL_ONLY,
                                                 inspect.Parameter.POSITIONAL_OR_KEYWORD):
        return "forward takes more than the hidden states"
    return None


def _form_key(m: nn.Module) -> tuple:
    plain = tuple(sorted((k, v) for k, v in vars(m).items()
                         if not k.startswith("_") and not k.startswith("kt_")
                         and isinstance(v, (bool, int, float, str, type(None)))))
    return type(m), plain, m.weight.dtype, tuple(m.weight.shape), m.weight.device.type


def _kernel_forward(m: nn.Module, hidden: torch.Tensor, renormalize: bool, cast: bool, flatten: bool,
                    reduction: bool = False) -> tuple:
    """(logits, weights, ids) as a router of that form returns them, the top-k by the kernel (plain bools, not a
    RouterForm: this runs under Dynamo's trace). ``reduction``: the logits as a float32 multiply-and-sum over the
    hidden size, rounded once to the input's dtype (``_decode_forward``)."""
    x = hidden.reshape(-1, hidden.shape[-1]) if flatten else hidden
    if reduction:
        logits = (x.unsqueeze(-2).float() * m.weight.float()).sum(-1).to(x.dtype)
    else:
        logits = F.linear(x, m.weight)
    flat = logits.reshape(-1, logits.shape[-1])
    w, ids = triton_router.router_topk(flat, m.top_k, renormalize, logits.dtype if cast else torch.float32)
    lead = logits.shape[:-1]
    return logits, w.reshape(*lead, m.top_k), ids.reshape(*lead, m.top_k)


def _candidate_forward(m: nn.Module, hidden: torch.Tensor, form: RouterForm) -> tuple:
    return _kernel_forward(m, hidden, form.renormalize, form.cast, form.flatten)


_ROUNDING = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # 2 ulps (float32: the exp's and sums')


def _same_routing(got: tuple, want: tuple, rtol: Optional[float] = None) -> bool:
    """Whether (logits, weights, ids) ``got`` is the router's ``want`` up to the order of ties and rounding."""
    if not (isinstance(want, tuple) and len(want) == 3 and all(isinstance(t, torch.Tensor) for t in want)):
        return False
    (lg, wg, ig), (lw, ww, iw) = got, want
    if lg.shape != lw.shape or wg.shape != ww.shape or ig.shape != iw.shape or wg.dtype != ww.dtype:
        return False
    if ig.dtype != iw.dtype or not torch.equal(lg, lw):
        return False
    p = torch.softmax(lw.reshape(-1, lw.shape[-1]).float(), dim=-1)
    k = iw.shape[-1]
    ig2, iw2 = ig.reshape(-1, k).long(), iw.reshape(-1, k).long()
    if not torch.equal(p.gather(1, ig2), p.gather(1, iw2)):
        return False
    if any(len(set(row)) != k for row in ig2.tolist()):
        return False
    tol = _ROUNDING[ww.dtype] if rtol is None else rtol
    return bool(torch.allclose(wg.float(), ww.float(), rtol=tol, atol=tol * 1e-3))


def router_form(m: nn.Module) -> Optional[RouterForm]:
    """How ``m``'s forward computes (a ``RouterForm``), or None where the kernel cannot stand in for it (module
    docstring). Probes on the module's device; kept per class, plain attributes, dtype and shape."""
    if _shape_fits(m) is not None or not triton_router.kernel_runs_on(m.weight):
        return None
    key = _form_key(m)
    if key not in _FORMS:
        _FORMS[key] = _probe(m)
    return _FORMS[key]


@torch.no_grad()
def _probe(m: nn.Module) -> Optional[RouterForm]:
    try:
        return _probe_forms(m)
    except Exception:  # a module that cannot be copied, or rows the kernel refuses: not a router it stands in for
        return None


def _probe_forms(m: nn.Module) -> Optional[RouterForm]:
    gen = torch.Generator().manual_seed(PROBE_SEED)
    probe = copy.deepcopy(m)
    probe.__dict__.pop("forward", None)
    E, H = probe.weight.shape
    # random weights, not the loaded ones (a zero-initialized router would tie every expert), at a scale whose
    # logits spread over a few units like a trained router's
    probe.weight.copy_(torch.randn(E, H, generator=gen) * (2.0 / H**0.5))
    rows = torch.randn(PROBE_ROWS, H, generator=gen)
    cases = []  # (module, input, the original's output, weights' tolerance): in the router's dtype, then float32
    for module, rtol in ((probe, None), (copy.deepcopy(probe).float(), 1e-5)):
        dtype, device = module.weight.dtype, module.weight.device
        for x in (rows.to(dtype=dtype, device=device), rows[None].to(dtype=dtype, device=device)):
            cases.append((module, x, type(module).forward(module, x), rtol))
    for form in CANDIDATES:  # the first that fits every case
        if all(_same_routing(_candidate_forward(module, x, form), want, rtol) for module, x, want, rtol in cases):
            return form
    return None


def _decode_forward(self, hidden_states):
    """The swapped forward: one kernel after the linear layer for up to DECODE_MAX_TOKENS rows, else the class's."""
    # (the swap was made only where the kernel runs on the weight's device: no check of Triton here, whose
    # interpreter flag Dynamo cannot trace)
    rows = hidden_states.numel() // hidden_states.shape[-1]
    if rows > DECODE_MAX_TOKENS or (self.weight.requires_grad and torch.is_grad_enabled()):
        return type(self).forward(self, hidden_states)
    return _kernel_forward(self, hidden_states, self.kt_router_renormalize, self.kt_router_cast,
                           self.kt_router_flatten, reduction=True)


@contextlib.contextmanager
def swapped(model: nn.Module):
    """While open, the model's softmax top-k routers (``router_form``) run ``_decode_forward``. Nothing is swapped
    for a trainable model (a router weight that requires grad) or without the kernel (no Triton, not CUDA)."""
    swaps = []
    try:
        for m in _routers(model):
            weight = getattr(m, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.requires_grad:
                continue
            form = router_form(m)
            if form is None:
                continue
            m.kt_router_renormalize, m.kt_router_cast, m.kt_router_flatten = (form.renormalize, form.cast,
                                                                              form.flatten)
            m.forward = types.MethodType(_decode_forward, m)
            swaps.append(m)
        yield swaps
    finally:
        for m in swaps:
            m.__dict__.pop("forward", None)
            for name in ("kt_router_renormalize", "kt_router_cast", "kt_router_flatten"):
                m.__dict__.pop(name, None)
