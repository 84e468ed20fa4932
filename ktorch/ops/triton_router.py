"""A softmax router's top-k in one Triton kernel: ``torch.ops.ktorch.router_topk``.

    p[t, e]   = softmax(float32(logits[t]))[e]                         over the E experts of row t
    ids[t, j] = the expert of the j-th largest p[t]                    j = 0..K-1, descending (torch.topk's order)
    w[t, j]   = p[t, ids[t, j]] / sum_j' p[t, ids[t, j']]  (renormalize), else p[t, ids[t, j]]; then out_dtype

What transformers' softmax routers (Qwen2/3-MoE, OLMoE, Mixtral, ...) compute after their linear layer with
``softmax(dtype=float32)``, ``torch.topk`` and the optional renormalization, which the captured decode step ran as
Inductor's softmax kernel plus ATen's ``topk`` (Inductor falls back to it: gatherTopK and a bitonic sort, two or
three launches a layer; device, H200 host, the 48-layer Qwen3-30B-A3B-shaped file, every expert resident: 0.44 ms
of a 5.15 ms step). Here one program a row holds the row's E logits in registers: max, exp and sum (float32), then K
rounds of (largest p, lowest index holding it), each taking that expert out, then the K weights summed in rank order
and divided. One launch a router.

Ties: equal probabilities are taken lowest expert index first (what a stable descending sort gives). torch.topk
leaves the order of equal values unspecified (CUDA's may differ from the CPU's); for distinct values the ids and
their order are torch.topk's. A probability is selected, not a logit: two logits that round to one probability tie
here as they tie in torch.topk over the probabilities. NaN logits give ids in [0, E) of no meaning.

Numerics: float32 throughout, one rounding to ``out_dtype`` at the end. Triton's exp and the order of the sums are
not ATen's, so the weights agree with ``softmax -> topk -> /sum`` in ATen to float32 rounding (a few ulps), not bit
for bit (Inductor's own fused softmax, which the captured step ran before, differs from ATen's the same way).

Limits: logits [T, E] floating (float32, bfloat16, float16; any row stride), 1 <= K <= min(E, ``MAX_TOP_K``),
E <= ``MAX_EXPERTS``; CUDA tensors, or CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, tests). Any T
runs (one program a row); the router swap in the decode step uses it for T <= 64 rows only
(ktorch/integrations/transformers_routers.py). Triton is imported if present, so this module imports anywhere and the
op fails on use with a clear error.
"""

from typing import Optional

import torch  # no "from __future__ import annotations": Triton reads the tl.constexpr annotations

from ktorch.ops.triton_experts import (interpreting, kernel_runs_on, next_power_of_2, pdl_options,  # noqa: F401
                                      triton, triton_available)

MAX_EXPERTS = 1024  # a row's logits sit in one program's registers (BLOCK_E = E rounded up to a power of two)
MAX_TOP_K = 32  # K rounds of two reductions each; routers take 1 to 16


if triton is not None:
    import triton.language as tl

    from ktorch.ops.triton_experts import pdl_prologue

    @triton.jit
    def _router_topk(logits_ptr, w_ptr, ids_ptr, E, stride_t, K: tl.constexpr, RENORM: tl.constexpr,
                     BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = 0):
        pdl_prologue(PDL)
        t = tl.program_id(0)
        offs = tl.arange(0, BLOCK_E)
        valid = offs < E
        x = tl.load(logits_ptr + t.to(tl.int64) * stride_t + offs, mask=valid, other=float("-inf")).to(tl.float32)
        e = tl.exp(x - tl.max(x, axis=0))  # exp(-inf) = 0 past E
        p = e / tl.sum(e, axis=0)
        p = tl.where(valid, p, -1.0)  # below every probability: never taken (K <= E)
        ranks = tl.arange(0, BLOCK_K)
        w = tl.zeros([BLOCK_K], dtype=tl.float32)
        ids = tl.zeros([BLOCK_K], dtype=tl.int64)
        for j in tl.static_range(K):
            best = tl.max(p, axis=0)
            # the lowest index holding the largest value (E - 1 if none equals it: a NaN row)
            i = tl.minimum(tl.min(tl.where(p == best, offs, BLOCK_E), axis=0), E - 1)
            w = tl.where(ranks == j, best, w)
            ids = tl.where(ranks == j, i.to(tl.int64), ids)
            p = tl.where(offs == i, -1.0, p)
        if RENORM:
            total = tl.sum(tl.where(ranks == 0, w, 0.0), axis=0)
            for j in tl.static_range(1, K):  # in rank order
                total += tl.sum(tl.where(ranks == j, w, 0.0), axis=0)
            w = w / total
        keep = ranks < K
        tl.store(w_ptr + t * K + ranks, w.to(w_ptr.dtype.element_ty), mask=keep)
        tl.store(ids_ptr + t * K + ranks, ids, mask=keep)


def _check(logits: torch.Tensor, k: int, out_dtype: torch.dtype) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        got = (logits.dtype, tuple(logits.shape)) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"router_topk: logits must be a floating tensor [T, E], got {got}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"router_topk: logits must be float32, bfloat16 or float16, got {logits.dtype}")
    E = logits.shape[1]
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"router_topk: logits [T, E] with 1 <= E <= {MAX_EXPERTS} experts, got E={E}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= min(E, MAX_TOP_K):
        raise ValueError(f"router_topk: k must be an int with 1 <= k <= min(E={E}, {MAX_TOP_K}), got {k!r}")
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"router_topk: out_dtype must be float32, bfloat16 or float16, got {out_dtype}")


@torch.library.custom_op("ktorch::router_topk", mutates_args=())
def _router_topk_op(logits: torch.Tensor, k: int, renormalize: bool, out_dtype: torch.dtype) -> tuple[
        torch.Tensor, torch.Tensor]:
    _check(logits, k, out_dtype)
    if triton is None:
        raise RuntimeError("router_topk: Triton is not installed (the router swap keeps transformers' router "
                           "without it: ktorch/integrations/transformers_routers.py)")
    if not kernel_runs_on(logits):
        raise ValueError(f"router_topk: the Triton kernel runs on CUDA tensors (CPU ones only under Triton's "
                         f"interpreter, TRITON_INTERPRET=1), logits are on {logits.device}")
    T, E = logits.shape
    w = torch.empty(T, k, dtype=out_dtype, device=logits.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return w, ids
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block_e = next_power_of_2(E)
    # one warp holds up to 256 probabilities in 8 registers a thread, with no shared-memory round in the reductions
    num_warps = 1 if block_e <= 256 else (2 if block_e <= 512 else 4)
    _router_topk[(T,)](logits, w, ids, E, logits.stride(0), K=k, RENORM=bool(renormalize), BLOCK_E=block_e,
                       BLOCK_K=next_power_of_2(k), num_warps=num_warps, **pdl_options(logits))
    return w, ids


@_router_topk_op.register_fake
def _(logits, k, renormalize, out_dtype):
    _check(logits, k, out_dtype)
    T = logits.shape[0]
    return logits.new_empty(T, k, dtype=out_dtype), logits.new_empty(T, k, dtype=torch.int64)


def router_topk(logits: torch.Tensor, k: int, renormalize: bool = True,
                out_dtype: Optional[torch.dtype] = None) -> tuple:
    """logits [T, E] (float32/bf16/fp16, CUDA) -> (weights [T, k] in ``out_dtype`` (default float32), ids [T, k]
    int64): softmax over E in float32, the k largest in descending order (ties: lowest expert first), renormalized to
    sum 1 when ``renormalize``. One kernel launch; shape-static and free of host syncs (CUDA-graph capturable);
    traceable by Dynamo (``torch.ops.ktorch.router_topk`` has a fake implementation)."""
    return torch.ops.ktorch.router_topk(logits, k, renormalize, torch.float32 if out_dtype is None else out_dtype)
