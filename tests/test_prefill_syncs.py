"""Host syncs of a prefill (ktorch/generation.py ``Decoder.prefill``): on a GPU each read of a device value on the
host (``.item()``, ``.cpu()``, ``nonzero``, ``bincount``'s size, boolean indexing, ``if tensor``) stalls the launching
thread until the GPU catches up, so a sync per layer makes the prefill launch-bound. These tests count them.

CPU (the built-in model; with a budget given on the CPU, the CPU stands in for the device and every expert is
resident, as ``--gpu-memory auto`` places them on an H200): the ops that read values on the host, recorded by a
dispatch mode. The one left, per forward and not per layer: transformers' ``_ignore_causal_mask_sdpa`` asks whether
the cache position is 0 (a static cache's prefill then runs SDPA with ``is_causal`` instead of a mask). The routed
experts' counts (the split's, the residents' routing frequency) stay on the device where the split has nothing to
decide (``RoutedExperts.record``) and are read with the counters. GPU (device): the same with
``torch.cuda.set_sync_debug_mode``, which also sees device-to-host copies.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ktorch
from ktorch.generation import Decoder, Sampling
from ktorch.ops.routed_experts import expert_counts
from ktorch.placement import experts_modules

A = torch.ops.aten
MASK_CHECK = "_ignore_causal_mask_sdpa"  # the one allowed: transformers' mask creation, once per forward


class _HostReads(TorchDispatchMode):
    """Records ops that read tensor values on the host (on a GPU: a sync), with the innermost Python function."""

    SYNCING = {A._local_scalar_dense.default, A.nonzero.default, A.masked_select.default, A._unique2.default,
               A.unique_consecutive.default, A.unique_dim.default, A.bincount.default, A.equal.default,
               A.is_nonzero.default}

    def __init__(self):
        super().__init__()
        self.seen: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        syncing = func in self.SYNCING or (
            func is A.repeat_interleave.Tensor and kwargs.get("output_size") is None) or (
            func in (A.index.Tensor, A.index_put_.default, A.index_put.default)
            and any(i is not None and i.dtype == torch.bool for i in args[1]))
        if syncing:
            import traceback

            frames = [f.name for f in traceback.extract_stack()[:-1]
                      if "transformers" in f.filename or "ktorch" in f.filename]  # not torch's wrappers
            self.seen.append((str(func), frames[-1]))
        return func(*args, **kwargs)


def _prefill_reads(model, tokens: int) -> list:
    decoder = Decoder(model, tokens + 8, torch.device("cpu"), Sampling(), cuda_graphs=False)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    with torch.inference_mode():
        decoder.prefill(ids)  # first uses
        with _HostReads() as mode:
            decoder.prefill(ids)
    return mode.seen


@pytest.mark.parametrize("gpu_memory", [None, "1GiB"])
@pytest.mark.parametrize("tokens", [80, 300])
def test_prefill_reads_one_value_on_the_host_whatever_the_layers(gpu_memory, tokens):
    """The built-in model's prefill (4 MoE layers, tokens >= the split's MIN_TOKENS = 64): one host read per
    forward, in transformers' mask creation; none per layer (a layer's were the split's bincount and counts copy)."""
    model, _ = ktorch.load("builtin", device="cpu", tokenizer=False, progress=False, gpu_memory=gpu_memory)
    if gpu_memory is not None:  # every expert resident on the stand-in device, the split counting
        assert all(len(m.kt_gpu_expert_ids) == m.kt_w13.shape[0] and m.kt_routed is not None
                   for _, m in experts_modules(model))
    seen = _prefill_reads(model, tokens)
    assert [where for _, where in seen] == [MASK_CHECK], seen


def test_counts_recorded_on_the_device_equal_per_call_counting():
    """Every expert resident: each call records its counts on the device; the counters read afterwards (stats,
    last_hit, frequency) are what counting each call on the host gave (from the ids each layer was routed)."""
    model, _ = ktorch.load("builtin", device="cpu", tokenizer=False, progress=False, gpu_memory="1GiB")
    modules = [m for _, m in experts_modules(model)]
    routed_ids = {id(m): [] for m in modules}
    hooks = [m.register_forward_pre_hook(lambda mod, args: routed_ids[id(mod)].append(args[1].clone()))
             for m in modules]
    before = {id(m): m.kt_routed.frequency.clone() for m in modules}
    for tokens in (100, 70, 30):  # 30 < MIN_TOKENS: not counted
        _prefill_reads(model, tokens)  # two prefills each
    for h in hooks:
        h.remove()
    for m in modules:
        routed = m.kt_routed
        assert routed._pending  # not read yet
        calls = [ids for ids in routed_ids[id(m)] if ids.shape[0] >= routed.min_tokens]
        assert len(calls) == 4
        counts = [expert_counts(ids, routed.num_experts) for ids in calls]
        hit = [int((c > 0).sum()) for c in counts]
        total = sum(counts)
        assert routed.stats["passes"] == 4 and not routed._pending
        assert routed.stats["experts_hit"] == sum(hit) == routed.stats["resident_hit"]
        assert routed.stats["rows"] == int(total.sum()) == routed.stats["rows_resident"]
        assert routed.stats["experts_copied"] == routed.stats["bytes_copied"] == routed.stats["rows_copied"] == 0
        assert routed.last_hit == hit[-1]
        assert torch.equal(routed.frequency, before[id(m)] + total.double())


def test_pending_counts_are_bounded():
    """Calls nobody reads the counters of (a server's prefills) hold at most PENDING_LIMIT count vectors."""
    from ktorch.ops import routed_experts

    model, _ = ktorch.load("builtin", device="cpu", tokenizer=False, progress=False, gpu_memory="1GiB")
    routed = experts_modules(model)[0][1].kt_routed
    ids = torch.randint(0, routed.num_experts, (100, 4))
    for _ in range(routed_experts.PENDING_LIMIT + 5):
        routed.record(expert_counts(ids, routed.num_experts), None)
    assert len(routed._pending) == 5
    assert routed.stats["passes"] == routed_experts.PENDING_LIMIT + 5


CUDA = torch.cuda.is_available()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (counts syncs with torch.cuda.set_sync_debug_mode)")
@pytest.mark.parametrize("experts_dtype", ["bf16", "int8"])  # int8: residents in the row layout, Triton's GEMM
def test_cuda_prefill_syncs_once(experts_dtype):
    """On the GPU (every expert resident, the default placement): the prefill synchronizes at most once, in
    transformers' mask creation (its version decides), whatever the number of layers; sync debug mode also sees
    device-to-host copies, and names the Python line that made each."""
    model, _ = ktorch.load("builtin", device="cuda", experts_dtype=experts_dtype, tokenizer=False, progress=False,
                           warm_up=False)
    decoder = Decoder(model, 264, torch.device("cuda"), Sampling(), cuda_graphs=False)
    ids = torch.randint(0, model.config.vocab_size, (1, 256), device="cuda")
    with torch.inference_mode():
        decoder.prefill(ids)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                decoder.prefill(ids)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    # "called a synchronizing CUDA operation"; not the mode's own "Synchronization debug mode is a prototype" notice
    # (the device's first run counted it as a sync)
    syncs = [w for w in caught if "called a synchronizing" in str(w.message)]
    where = [f"{w.filename}:{w.lineno}: {w.message}" for w in syncs]
    assert len(syncs) <= 1 and all("masking_utils" in w.filename for w in syncs), where  # transformers' mask check
