"""Text generation as ``ktorch generate`` runs it, and as the end-to-end benchmarks time it: one code path.

    result = ktorch.generate(model, input_ids, max_new_tokens=64)            # a ktorch.load / prepare'd model
    result.ids, result.timings                                               # new token ids; where the time went

What one call does (batch 1):

1. **Prefill**: one eager forward of the prompt into a static KV cache (transformers' ``StaticCache``) with no
   expert deferral; the routed experts run on the CPU op, or partly on the GPU where the model streams experts
   (``ktorch.prepare(..., stream_experts=...)``). The first new token is sampled on the device.
2. **Decode** on a GPU: the whole decode step (embedding, every layer, the CPU experts' submit/wait as host
   functions on the stream, lm_head, sampling, the position's increment) is captured once as ONE CUDA graph and
   replayed per token. The decoder layers are compiled regionally for the capture (``compiled_layers``: one
   Inductor compile shared by every layer, the KV-cache update and the experts left eager), so the capture takes
   seconds instead of the minutes a whole-model ``torch.compile`` takes; a replay costs the launching
   thread one ``cudaGraphLaunch``. The new token is copied to pinned memory after each replay and read one step
   later, so the host never waits for the step it just launched (an end-of-sequence token is seen one step late:
   the step after it is computed and dropped). The deferral the model was prepared with
   (``deferred_experts=d``) is captured in decode only: at prefill it has nothing to overlap.
   On the CPU (no GPU), or with ``cuda_graphs=False``, decode runs the same step eagerly.
3. Sampling on the device: greedy (``temperature=0``) or temperature + top-p, with an optional repetition
   penalty; seeded, so a run repeats.

The captured step and its cache are kept on the model (``model.kt_decoder``) for the next call of the same or a
smaller length (chat turns, benchmark repetitions); a longer one makes a larger cache and captures again.

``warm_up(model)`` (what ``ktorch.load`` and the command line's loading end with on a GPU, as llama.cpp's loading
ends with a warm-up forward) runs one prefill of ``WARM_UP_TOKENS`` random ids through a throwaway cache: a fresh
process's first prefill pays one-time costs that are not the prompt's (the first launches of cuBLAS, attention and
the split's kernels, the CPU op's scratch faulted in, page-locked and device stagings and CUDA memory segments
made), and they land in the load time instead of the first prompt's. It leaves no state behind (the split's
counters and routing frequency, the residents' hit counters, the experts runtime's counters are put back), so the
tokens are the same with and without it, but for one thing kept for the first prompt: a decoder
(``model.kt_decoder``) whose prefills of ``WARM_UP_TOKENS`` and ``WARM_UP_BUCKETS`` positions are captured as CUDA
graphs, of which a first prompt of up to ``WARM_UP_TOKENS`` tokens replays the smallest that holds it, padded, instead
of prefilling eagerly (an eager prefill is bound by its
launching thread). On the CPU it does nothing.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import threading
import time
import types
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ktorch import decode_attention
from ktorch.compile.experts_runtime import RUNTIME
from ktorch.integrations import fused_norms, fused_qkv

CACHE_BUCKET = 256  # static cache lengths are rounded up to this, so that calls of similar lengths share a capture
# (and captured prefills' prompts, padded)
PREFILL_GRAPHS = 4  # captured prefills kept per decoder (buckets), in one memory pool: about one prefill's activations
CAPTURE_AFTER = 2  # generate captures a bucket's prefill after this many of its prompts (generation.py's end)


@dataclass
class Timings:
    """Seconds, from the call's start: ``first_token_s`` is the time to the first new token (prefill + its
    sampling), ``warmup_s`` the decode step's capture (after the first token, with one eager step; 0 when reused),
    ``decode_s`` the time of the replayed steps after it."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    first_token_s: float = 0.0
    warmup_s: float = 0.0
    warmup_tokens: int = 0  # new tokens made during the capture (its eager step), not counted in the decode rate
    decode_s: float = 0.0
    cuda_graphs: bool = False
    resident_swaps: int = 0  # resident experts swapped after the prefill (ktorch.gpu_memory.begin_resident_swaps)
    resident_swap_s: float = 0.0  # the host's time starting them (on a GPU the copies run behind decode)
    prefill_capture_s: float = 0.0  # the prompt's bucket's prefill captured as a CUDA graph after the generation
    prefill_replayed: int = 0  # the captured prefill the prompt replayed, padded (its tokens); 0: an eager prefill

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.first_token_s if self.first_token_s > 0 else 0.0

    @property
    def decode_tokens(self) -> int:
        """New tokens timed by ``decode_s``: all but the first (prefill) and the capture's eager step's."""
        return max(self.new_tokens - 1 - self.warmup_tokens, 0)

    @property
    def decode_tok_s(self) -> float:
        n = self.decode_tokens
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    def line(self) -> str:
        """"prefill: P tokens in a s (x tok/s) | decode: N tokens in b s (y tok/s)" (the CLI's timing line)."""
        decode = (f"{self.decode_tokens} tokens in {self.decode_s:.3f} s ({self.decode_tok_s:.1f} tok/s)"
                  if self.decode_tokens else "0 tokens")
        return (f"prefill: {self.prompt_tokens} tokens in {self.first_token_s:.3f} s ({self.prefill_tok_s:.1f} tok/s)"
                f" | decode: {decode}")


@dataclass
class GenerationResult:
    ids: list = field(default_factory=list)  # the new token ids (the prompt's not included)
    timings: Timings = field(default_factory=Timings)


# ---------------------------------------------------------------- sampling (on the device, capturable)


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")


def sample_next(logits: torch.Tensor, sampling: Sampling, seen: Optional[torch.Tensor],
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """The next token [1] (int64) from ``logits`` [1, V]; no host sync, so it can be captured in a CUDA graph.

    ``seen`` [V] bool marks the tokens present so far (prompt and output) for the repetition penalty
    (transformers' rule: positive logits divided by it, negative ones multiplied)."""
    logits = logits[-1].float()
    if sampling.repetition_penalty != 1.0 and seen is not None:
        p = sampling.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
    if sampling.temperature == 0:
        return logits.argmax(-1, keepdim=True)
    probs = torch.softmax(logits / sampling.temperature, -1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= sampling.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)


# ---------------------------------------------------------------- the decode step


def _cache_argument(model: nn.Module) -> str:
    """The forward's name for the KV cache: ``cache`` (transformers >= 5.24, where ``past_key_values`` still works
    with a FutureWarning until 5.40) or ``past_key_values`` (before)."""
    name = getattr(type(model), "_kt_cache_argument", None)
    if name is None:
        name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
        type(model)._kt_cache_argument = name
    return name


def _vocab_size(model: nn.Module) -> int:
    config = model.config
    return config.get_text_config().vocab_size if hasattr(config, "get_text_config") else config.vocab_size


# SDPA backends for an eager prefill, in order: every fused backend but cuDNN's. On sm90/sm100 with cuDNN >= 9.15, torch
# (2.11+) puts cuDNN attention first; for a call with a mask (a static cache's prefill has one) it builds an execution
# plan per new shape (batch, query and key lengths, strides: ATen's MHA.cpp plan cache), tens of ms each: a prompt of
# a length not seen before paid it in its first layer (device, H200, 12-layer Q8_0 file: "attention, layer 0" 54.6 ms
# on a new length against 0.9 ms on a repeated one; a 2048-token warm-up left a 512-token prompt 55-80 ms of such
# first uses). Flash and memory-efficient attention need no plan. The decode step is captured once per cache and
# keeps torch's own order. Merged without its own A/B (session 29): with it, a fresh `ktorch generate` on the
# 48-layer Q8_0 file prefilled its one 512-token prompt in 0.17 s with every expert resident, 0.42 s with every
# expert in host memory (benchmarks/RESULTS.md section 2).
_PREFILL_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def prefill_attention():
    """A context in which SDPA calls skip cuDNN attention (``_PREFILL_SDPA``, in that order)."""
    return sdpa_kernel(_PREFILL_SDPA, set_priority=True)


@dataclass
class PrefillGraph:
    """A prefill of ``tokens`` positions captured as a CUDA graph (``Decoder.capture_prefill``): the prompt's ids go
    into ``ids`` [1, tokens] (the rest padding), ``real`` [1] holds the prompt's length (rows at or past it get no
    experts: ``padding_mask_hooks``), ``keep`` [1] its last position (the logits the graph writes to ``logits``
    [1, V]); ``counts`` [L, E] the routing-aware split's layers' rows per expert (None where no layer counts),
    read after each replay into their counters."""

    tokens: int
    ids: torch.Tensor
    real: torch.Tensor
    keep: torch.Tensor
    graph: Optional[torch.cuda.CUDAGraph] = None
    logits: Optional[torch.Tensor] = None
    counts: Optional[torch.Tensor] = None  # [L, 2, E]: per counting layer its rows per expert and copied ids (-1 pad)
    counted: list = field(default_factory=list)  # the experts module of each counts row


def captured_prefill_problem(model: nn.Module, cache, device: torch.device) -> Optional[str]:
    """Why a prefill of ``model`` into ``cache`` cannot be captured as a CUDA graph (None where it can): a prefill
    that decides on the host per layer (streamed experts, adapters, or a routing-aware split whose copies the
    captured split cannot run: ``RoutedExperts.captured_split_problem``), or a cache layer whose length is not a
    device tensor (transformers' ``StaticLayer`` keeps it as one; a sliding window keeps a host-side count too)."""
    from ktorch.placement import experts_modules

    if device.type != "cuda":
        return "not on a GPU"
    failed = getattr(model, "kt_prefill_capture_failed", None)
    if failed:
        return f"its capture failed before ({failed})"
    for layer in cache.layers:
        if not isinstance(getattr(layer, "cumulative_length", None), torch.Tensor) or getattr(layer, "is_sliding",
                                                                                             False):
            return f"the cache's {type(layer).__name__} keeps its length on the host"
    dtype = model.get_input_embeddings().weight.dtype
    for name, m in experts_modules(model):
        routed = getattr(m, "kt_routed", None)
        if routed is not None and routed.copies_possible(getattr(m, "kt_gpu_expert_ids", None)):
            problem = routed.captured_split_problem(dtype, device)
            if problem:
                return f"{name}'s prefill split: {problem}"
        if getattr(m, "kt_stream_plan", None) is not None:
            return f"{name} streams experts"
        if getattr(m, "kt_lora", None) is not None:
            return f"{name} has expert adapters"
    return None


CAUSAL_PREFILL = "ktorch_causal_prefill"  # the captured prefill's attention in transformers' registries
_CAUSAL_REGISTERED = False


def _causal_prefill_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention with no mask (so causal, upper-left aligned, on the keys of the prompt's length:
    flash attention): what transformers itself picks for a prefill into an empty static cache, which it decides by
    reading the cache's offset on the host; a capture cannot (it then built a mask: memory-efficient attention, 7.4
    ms against flash's 1.9 for 12 layers at 2048 tokens, device, H200 host). Correct for a prefill from position 0
    only, which is what the captured prefill is."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, None, **kwargs)


@contextlib.contextmanager
def causal_prefill_attention(model: nn.Module):
    """While open, a model whose attention is transformers' "sdpa" takes ``_causal_prefill_attention`` (and builds
    no mask); others keep theirs."""
    global _CAUSAL_REGISTERED
    before = model.config._attn_implementation
    if before != "sdpa":
        yield
        return
    if not _CAUSAL_REGISTERED:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(CAUSAL_PREFILL, _causal_prefill_attention)
        AttentionMaskInterface.register(CAUSAL_PREFILL, lambda *args, **kwargs: None)
        _CAUSAL_REGISTERED = True
    model.config._attn_implementation = CAUSAL_PREFILL
    try:
        yield
    finally:
        model.config._attn_implementation = before


# The experts runtime gives each layer's captured CPU call pinned buffers of its own per prompt length (the graph
# records their addresses), kept for the process: ~16 MB a layer at 2048 tokens of H = 2048, 0.8 GB for 48 layers.
# Past this many bytes taken by captured prefills, new prompt lengths prefill eagerly (a warning says so once).
CAPTURED_PINNED_LIMIT = 8 << 30
_captured_pinned = {"bytes": 0, "warned": False, "made": set()}  # bytes taken, warned, (model id, tokens) made


def captured_prefill_pinned_bytes(model: nn.Module, tokens: int) -> int:
    """Pinned host bytes the experts runtime takes for a captured prefill of ``tokens`` positions: per layer that
    calls the CPU op (not every expert on the device), its hidden states in and its result out (in the activations'
    dtype) and its ids and weights."""
    from ktorch.placement import experts_modules

    dtype = model.get_input_embeddings().weight.dtype
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    hidden = config.hidden_size * torch.empty((), dtype=dtype).element_size()
    top_k = getattr(config, "num_experts_per_tok", 1)
    per_layer = tokens * (2 * hidden + top_k * (8 + 4))
    return per_layer * sum(1 for _, m in experts_modules(model)
                           if len(getattr(m, "kt_gpu_expert_ids", None) or ()) < m.kt_w13.shape[0])


def _take_captured_pinned(model: nn.Module, tokens: int) -> bool:
    """Whether a captured prefill of ``tokens`` positions of ``model`` may be made within ``CAPTURED_PINNED_LIMIT``
    (a length captured before for the model, by any decoder, reuses its layers' buffers); counts its bytes if so."""
    key = (id(model), tokens)
    if key in _captured_pinned["made"]:
        return True
    nbytes = captured_prefill_pinned_bytes(model, tokens)
    if _captured_pinned["bytes"] + nbytes > CAPTURED_PINNED_LIMIT:
        if not _captured_pinned["warned"]:
            _captured_pinned["warned"] = True
            warnings.warn(f"ktorch: captured prefills have taken {_captured_pinned['bytes'] / 2**30:.1f} GiB of pinned "
                          f"host buffers for the CPU experts (limit {CAPTURED_PINNED_LIMIT / 2**30:.0f} GiB); prompts "
                          "of lengths not captured yet prefill eagerly from now on", stacklevel=3)
        return False
    _captured_pinned["bytes"] += nbytes
    _captured_pinned["made"].add(key)
    return True


class Decoder:
    """A static KV cache of ``max_len`` tokens for ``model`` and its decode step (captured as a CUDA graph on a GPU).

    The step reads ``self.token`` [1, 1] and ``self.position`` [1] (device tensors, fixed addresses), writes the
    sampled token back into ``self.token`` and adds 1 to ``self.position``: a replay advances by itself.

    The prefill too is replayed from a CUDA graph where one was captured for the prompt's bucket (``capture_prefill``:
    the prompt padded to a multiple of ``CACHE_BUCKET`` tokens, its padding rows given no experts, the logits taken
    at its last position), else run eagerly; ``generate`` captures a bucket after its ``CAPTURE_AFTER``-th prompt.
    Graphs are kept per bucket, ``PREFILL_GRAPHS`` at most, in one memory pool: they never run at once, and each
    replay's logits are read before the next replay."""

    def __init__(self, model: nn.Module, max_len: int, device: torch.device, sampling: Sampling, cuda_graphs: bool):
        from transformers import StaticCache

        self.model, self.max_len, self.device, self.sampling = model, max_len, device, sampling
        self.cuda_graphs = cuda_graphs and device.type == "cuda"
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self.token = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.seen = (torch.zeros(_vocab_size(model), dtype=torch.bool, device=device)
                     if sampling.repetition_penalty != 1.0 else None)
        self.generator = torch.Generator(device=device)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.captured_step_ran = False  # capture() ran its eager step (the step's token made) before recording
        self.replayed = 0  # the last prefill's replayed captured graph (its tokens), 0 where it ran eagerly
        self.swapped: dict = {}  # what the capture ran on ktorch's Triton kernels: routers, cache layers (counts)
        self.deferred = 0  # the deferral the capture was made with
        # the captured step's attention over the cache's filled blocks (ktorch/decode_attention.py), where it applies
        self.attention = None
        if self.cuda_graphs and decode_attention.applies(model, device) is None:
            self.attention = decode_attention.DecodeAttention(max_len, self.position)
        self.prefill_graphs: collections.OrderedDict = collections.OrderedDict()  # captured prefills by bucket
        self._prefill_pool = None
        self.bucket_uses: collections.Counter = collections.Counter()  # generate's prompts per bucket not captured

    def restep(self, sampling: Sampling, deferred: int) -> None:
        """Another sampling and deferral for the decode step: the captured one is dropped (the next ``capture``
        makes it anew); the cache and the captured prefills stay."""
        self.sampling, self.deferred = sampling, deferred
        self.seen = (torch.zeros(_vocab_size(self.model), dtype=torch.bool, device=self.device)
                     if sampling.repetition_penalty != 1.0 else None)
        self.graph = None
        self.swapped = {}

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, **extra) -> torch.Tensor:
        cache = {_cache_argument(self.model): self.cache}
        out = self.model(input_ids=ids, cache_position=positions, position_ids=positions[None], use_cache=True,
                         logits_to_keep=1, **cache, **extra)
        return out.logits[0]  # [1, V]

    def prefill_bucket(self, prompt_len: int) -> Optional[int]:
        """The tokens a captured prefill of ``prompt_len`` tokens runs (None where it would not fit the cache)."""
        tokens = _round_up(prompt_len, CACHE_BUCKET)
        return tokens if tokens <= self.max_len else None

    def prefill_graph(self, prompt_len: int) -> Optional[PrefillGraph]:
        """The kept prefill (``prefill_graphs``) a prompt of ``prompt_len`` tokens runs, padded: its own bucket's, else
        the smallest longer one (the warm-up's, ``warm_up``), else None (an eager prefill). Padding costs the GPU its
        dense work on the padded rows (no experts: they route nowhere) and no launches, where an eager prefill is
        bound by its launching thread."""
        bucket = self.prefill_bucket(prompt_len)
        if bucket is None:
            return None
        fits = [tokens for tokens in self.prefill_graphs if tokens >= bucket]
        return self.prefill_graphs[min(fits)] if fits else None

    def _prefill_context(self, waits: bool = True):
        """What an eager or captured prefill runs in on a GPU: an eager prefill is launch-bound, so one kernel a norm
        and one product for each attention's q, k and v (its device A/B: benchmarks/RESULTS.md section 2, session
        44), SDPA without cuDNN's plans; ``waits``: the launching thread does not wait for each layer's CPU experts
        (a GPU wait kernel holds the stream; a capture has its own)."""
        stack = contextlib.ExitStack()
        stack.enter_context(prefill_attention())
        if self.device.type == "cuda":
            stack.enter_context(fused_norms.swapped(self.model))
            stack.enter_context(fused_qkv.eager_swapped(self.model))
            if waits:
                stack.enter_context(RUNTIME.async_waits(self.device))
        return stack

    def capture_prefill(self, prompt_len: int) -> float:
        """Captures the prefill of prompts of ``prompt_len``'s bucket as a CUDA graph (``PrefillGraph``), unless one is
        kept or a prefill of this model cannot be captured (``captured_prefill_problem``); returns its seconds (0.0
        where nothing was captured). One padded prefill runs first, eagerly on a side stream (every lazy allocation,
        pinned buffer and kernel compile made outside the capture), with the model's prefill state put back after
        (``_prefill_state``): the split's counters and routing frequency see prompts only."""
        tokens = self.prefill_bucket(prompt_len) if self.cuda_graphs else None
        if tokens is None or tokens in self.prefill_graphs or captured_prefill_problem(self.model, self.cache,
                                                                                       self.device):
            return 0.0
        if not _take_captured_pinned(self.model, tokens):
            return 0.0
        t0 = time.perf_counter()
        while len(self.prefill_graphs) >= PREFILL_GRAPHS:
            self.prefill_graphs.popitem(last=False)
        g = self.padded_prefill(tokens)
        with _unseen_prefill(self.model):
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self.cache.reset()
                self._prefill_forward(g, waits=False)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
        if self._prefill_pool is None:
            self._prefill_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with capturing(graph, self.device, pool=self._prefill_pool):
                g.logits, counted = self._prefill_forward(g, waits=False)
                if counted:  # per counting layer its rows per expert and copied ids, written by each replay
                    g.counts = torch.stack([torch.stack([c, torch.full_like(c, -1) if chosen is None
                                                         else chosen.to(c.dtype)]) for _, c, chosen in counted])
                    g.counted = [m for m, _, _ in counted]
        except Exception as e:  # what a capture may not do (a host read, ...) in a model not tried: eager prefills
            RUNTIME.abandon_capture()
            self.model.kt_prefill_capture_failed = f"{type(e).__name__}: {str(e)[:300]}"
            warnings.warn(f"ktorch: this model's prefill could not be captured as a CUDA graph "
                          f"({self.model.kt_prefill_capture_failed}); its prompts prefill eagerly", stacklevel=2)
            return 0.0
        g.graph = graph
        self.prefill_graphs[tokens] = g
        return time.perf_counter() - t0

    def padded_prefill(self, tokens: int) -> PrefillGraph:
        """A ``PrefillGraph`` of ``tokens`` positions, not captured: kept in ``prefill_graphs`` as it is, prompts of its
        bucket run its padded prefill eagerly (how the CPU tests check the padding)."""
        return PrefillGraph(tokens, torch.zeros(1, tokens, dtype=torch.long, device=self.device),
                            torch.full((1,), tokens, dtype=torch.long, device=self.device),
                            torch.full((1,), tokens - 1, dtype=torch.long, device=self.device))

    def _prefill_forward(self, g: PrefillGraph, waits: bool) -> tuple:
        """The padded prefill of ``g`` (eager, or recorded where the stream captures): (logits [1, V] at ``g.keep``,
        what a capture recorded of each counting layer: (module, rows per expert, copied ids or None), from
        ``ktorch_experts_forward``; empty where not capturing)."""
        from ktorch.integrations.transformers_experts import padding_mask_hooks, recording_counts

        positions = torch.arange(g.tokens, device=self.device)
        cache = {_cache_argument(self.model): self.cache}
        hooks = padding_mask_hooks(self.model, lambda: g.real)
        counts: list = []
        try:
            with self._prefill_context(waits), causal_prefill_attention(self.model), recording_counts(counts):
                out = self.model(input_ids=g.ids, cache_position=positions, position_ids=positions[None],
                                 use_cache=True, logits_to_keep=g.keep, **cache)
        finally:
            for h in hooks:
                h.remove()
        return out.logits[0], counts

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Runs the prompt ids [1, P] from an empty cache; returns the first new token [1, 1] (and sets up the step).
        Replays the prompt's bucket's captured prefill where ``capture_prefill`` made one, else runs it eagerly."""
        P = ids.shape[1]
        self.cache.reset()
        if self.seen is not None:
            self.seen.zero_()
            self.seen[ids[0]] = True
        g = self.prefill_graph(P)
        self.replayed = g.tokens if g is not None and g.graph is not None else 0
        if g is not None:
            g.ids[:, :P].copy_(ids)
            g.ids[:, P:].zero_()
            g.real.fill_(P)
            g.keep.fill_(P - 1)
            if g.graph is not None:
                g.graph.replay()
                logits = g.logits
            else:
                logits = self._prefill_forward(g, waits=True)[0]
            for layer in self.cache.layers:  # the padding's positions were written too: the next write goes at P
                layer.cumulative_length.fill_(P)
            # the counting layers' rows per expert, read with their counters where an eager prefill's call of the
            # prompt's length would be counted (``min_tokens`` and more)
            counting = [(i, m) for i, m in enumerate(g.counted) if P >= m.kt_routed.min_tokens]
            if counting:
                rows = g.counts.clone()
                for i, m in counting:
                    m.kt_routed.record(rows[i, 0], getattr(m, "kt_gpu_expert_ids", None), rows[i, 1])
        else:
            positions = torch.arange(P, device=self.device)
            with self._prefill_context():
                logits = self._forward(ids, positions)
        nxt = sample_next(logits, self.sampling, self.seen, self.generator)
        self.token.copy_(nxt[None])
        self.position.fill_(ids.shape[1])
        if self.seen is not None:
            self.seen[nxt] = True
        return self.token

    def _step(self) -> None:
        extra = {}
        if self.attention is not None and self.model.config._attn_implementation == decode_attention.NAME:
            self.attention.update()  # inside capture(): the step's block count, on the device
            extra["kt_decode"] = self.attention
        logits = self._forward(self.token, self.position, **extra)
        nxt = sample_next(logits, self.sampling, self.seen, self.generator)
        if self.seen is not None:
            self.seen[nxt] = True
        self.token.copy_(nxt[None])
        self.position.add_(1)

    def capture(self) -> None:
        """Captures the decode step with its decoder layers compiled regionally (``compiled_layers``) and, where it
        applies, its attention over the cache's filled blocks only (ktorch/decode_attention.py), its softmax routers'
        top-k in one Triton kernel each (integrations/transformers_routers.py) and the KV cache's writes in one
        Triton launch a layer (integrations/transformers_cache.py)."""
        from ktorch.integrations import transformers_cache, transformers_routers

        self.captured_step_ran = False
        switch = decode_attention.switched(self.model) if self.attention is not None else contextlib.nullcontext()
        # looked up in their modules at each capture: the benchmark's A/B turns them off there
        with compiled_layers(self.model, self.cache), switch, transformers_routers.swapped(self.model) as routers, \
                transformers_cache.swapped(self.cache) as cache_layers:
            self.swapped = {"routers": len(routers), "cache layers": len(cache_layers)}
            self._capture()

    def _capture(self) -> None:
        """Runs the next decode step eagerly (on a side stream: every lazy allocation, cuBLAS handle and the experts'
        pinned buffers for this shape are made outside the capture), then captures the step as a CUDA graph. The
        eager step is a real one (its token is in ``self.token``): the cache's own counters (transformers'
        ``StaticLayer.cumulative_length``) have advanced with it, as they do in every replay after."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._step()
        self.captured_step_ran = True  # the next token is in self.token whatever the recording does
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        sampled = self.sampling.temperature > 0
        if sampled:
            graph.register_generator_state(self.generator)  # replays draw new numbers from it
        with capturing(graph, self.device, generators=[self.generator] if sampled else []):
            self._step()  # recorded, not run: the state is still the one after the eager step
        self.graph = graph

    def step(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()


@contextlib.contextmanager
def capturing(graph: "torch.cuda.CUDAGraph", device: torch.device, generators: Sequence[torch.Generator] = (),
              **kwargs):
    """``torch.cuda.graph(graph, **kwargs)`` that leaves the process usable where the capture fails: PyTorch's ending
    of a capture stops at a failed ``cudaStreamEndCapture`` (e.g. a host sync inside the capture invalidated it), so
    the capture's stream stays the current one and the device's random generator, and each of ``generators``
    registered with the graph, keep their capturing state, in which every later random draw on the device raises
    ("Offset increment outside graph capture encountered unexpectedly": device, session 53, the next model's load after
    a prefill capture had failed). Here a failure puts back the stream and gives each generator a fresh state at its
    seed and offset (``clone_state``), then re-raises."""
    stream = torch.cuda.current_stream(device)
    try:
        with torch.cuda.graph(graph, **kwargs):
            yield
    except BaseException:
        torch.cuda.set_stream(stream)
        index = device.index if device.index is not None else torch.cuda.current_device()
        for g in (torch.cuda.default_generators[index], *generators):
            g.graphsafe_set_state(g.clone_state())
        raise


_COMPILED_FORWARDS: dict = {}  # module class -> its forward compiled by Inductor (one per class, shapes guarded inside)
RECOMPILE_LIMIT = 256  # Dynamo's cache entries per code object while compiled_layers is open (see there)


def _compiled_forward(cls: type):
    if cls not in _COMPILED_FORWARDS:
        from torch._inductor import config as inductor_config

        from ktorch.passes import cse

        # the q/k/v projections' three products of one weight (fused_qkv.swapped, which compiled_layers opens)
        # become one: ktorch/passes/cse.py. Their Triton kernels launch with programmatic dependent launch where this
        # torch's Inductor has triton.enable_pdl (it emits it on sm_90+ only), as ktorch's decode kernels do
        # (triton_experts.PDL): 1034.0 against 997.7 tok/s without it (session 54, 12 layers, captured decode).
        options = {"post_grad_custom_pre_pass": cse.PASS}
        if hasattr(inductor_config.triton, "enable_pdl"):
            options["triton.enable_pdl"] = True
        _COMPILED_FORWARDS[cls] = torch.compile(cls.forward, dynamic=False, options=options)
    return _COMPILED_FORWARDS[cls]


_PRELOAD: Optional[threading.Thread] = None


def preload_compiler() -> None:
    """Imports Inductor's compiler modules on a daemon thread (once per process), so that the decode step's capture
    does not pay them (about a second) after the first token: the CLI calls it before loading the model,
    ``generate`` before its prefill. The imports take the GIL in short turns; loading and prefill spend their time
    in ops that release it."""
    global _PRELOAD
    if _PRELOAD is None:
        def work():
            try:
                import torch._inductor.compile_fx  # noqa: F401
                import torch._inductor.codecache  # noqa: F401
            except Exception:  # the capture imports them again and reports what fails
                pass

        _PRELOAD = threading.Thread(target=work, name="ktorch-preload-inductor", daemon=True)
        _PRELOAD.start()


def decoder_layers(model: nn.Module) -> list:
    """The model's decoder layers (transformers' ``*DecoderLayer`` modules), in order."""
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


EAGER_ATTENTION_PREFIX = "ktorch_eager|"  # compiled_layers(eager_attention=True): the model's attention under this
# name plus its own, registered in transformers' attention and mask registries as the same function run eagerly


def _eager_attention_name(implementation: str) -> str:
    """Registers (once per implementation) the model's attention function wrapped in ``torch.compiler.disable`` under
    ``EAGER_ATTENTION_PREFIX + implementation``, with the implementation's mask function; returns the name. One
    wrapper object per implementation and process: Dynamo guards the attention function it calls by identity, so a
    new wrapper at each capture would compile the layer again."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = EAGER_ATTENTION_PREFIX + implementation
    if name not in ALL_ATTENTION_FUNCTIONS:
        if implementation not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"compiled_layers: the model's attention {implementation!r} is not in transformers' "
                             "attention registry; eager_attention needs it there")
        AttentionInterface.register(name, torch.compiler.disable(ALL_ATTENTION_FUNCTIONS[implementation]))
        if implementation in ALL_MASK_ATTENTION_FUNCTIONS:
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[implementation])
    return name


@contextlib.contextmanager
def compiled_layers(model: nn.Module, cache, eager_attention: bool = False) -> None:
    """Regional compilation of the decode step: while the context is open, each decoder layer runs an
    Inductor-compiled forward that all layers of one class share (compiled once, on the first layer: the layers are
    the same code with other weights, which Dynamo passes as inputs), with two holes that stay eager: the KV cache's
    update and the routed experts (their pinned copies and host functions; ``torch.compiler.disable``d, so Dynamo
    breaks the graph there and resumes after). So a layer's ~40 small kernels (norms, rotary, router softmax/top-k,
    residual adds) become a handful of fused Triton kernels between the cuBLAS projections, which is what the
    captured CUDA graph then replays; the compile of a 48-layer model is that of one layer (about ten small graphs),
    and Inductor's on-disk cache (keyed by the graphs' code, shapes and the torch version) serves the next process.

    The attention modules' ``layer_idx`` becomes a 0-d tensor for the duration (the cache's update, eager, reads it
    back as an int): Dynamo would otherwise specialize each layer's graph on its index and compile 48 times. Norms
    outside the layers (the final one) get a compiled forward of their own. Prefill runs outside this context: its
    prompt lengths would each compile.

    ``eager_attention``: the attention function (the model's implementation, e.g. SDPA) is a third hole, run
    eagerly (``_eager_attention_name``), and the keys and values the cache's update returns have their length
    marked dynamic. ``ktorch serve`` captures its steps this way: there the keys' length (the step's padded cache
    reads) varies from graph to graph while the tokens take a few buckets, and only the attention computes with it,
    so the layers compile once per token bucket, not once per (tokens, reads) pair (the caller marks the reads'
    dimension of the layers' own inputs, the mask and the read indices, dynamic too: serve's
    ``_mark_reads_dynamic``)."""
    from ktorch.integrations import fused_qkv
    from ktorch.placement import experts_modules

    layers = decoder_layers(model)
    inside = {id(m) for layer in layers for m in layer.modules()}
    norms = [m for m in model.modules()
             if type(m).__name__.endswith("RMSNorm") and not list(m.children()) and id(m) not in inside]
    experts = [m for _, m in experts_modules(model)]
    attentions = [m for layer in layers for m in layer.modules()
                  if type(m).__name__.endswith("Attention") and isinstance(getattr(m, "layer_idx", None), int)]
    update = cache.update
    implementation = model.config._attn_implementation
    attention = _eager_attention_name(implementation) if eager_attention else implementation

    def eager_update(key_states, value_states, layer_idx, *args, **kwargs):
        out = update(key_states, value_states, int(layer_idx), *args, **kwargs)
        if eager_attention:  # their length is the step's reads: the frame handing them on guards the tokens only
            for t in out:
                torch._dynamo.maybe_mark_dynamic(t, t.dim() - 2)
        return out

    own_forwards = {id(m): m.__dict__["forward"] for m in layers + norms + experts if "forward" in m.__dict__}
    own_update = getattr(cache, "__dict__", {}).get("update")
    try:
        cache.update = torch.compiler.disable(eager_update)
        for m in experts:
            m.forward = torch.compiler.disable(m.forward)
        for m in attentions:
            m.layer_idx = torch.tensor(m.layer_idx)
        for m in layers + norms:
            m.forward = types.MethodType(_compiled_forward(type(m)), m)
        if attention != implementation:
            model.config._attn_implementation = attention
        # transformers (5.2x) wraps layer and attention forwards in one decorator (deprecate_kwarg's wrapped_func):
        # every decorated forward of every model in the process shares its code object, and so Dynamo's cache
        # entries. At 16 a test worker's 17th (class, shapes) ran its layers eagerly, and a decode step captured that
        # way fails (flex attention's eager form; device, session 36). The entries cost a guard check at capture
        # only: replays check none. Past the limit Dynamo raises instead of running the layers eagerly: an error that
        # names the limit, not a captured step that fails somewhere inside.
        limits = {"recompile_limit": max(RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)}
        if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
            limits["fail_on_recompile_limit_hit"] = True
        with torch._dynamo.config.patch(**limits), fused_qkv.swapped(model):
            yield
    finally:
        if model.config._attn_implementation != implementation:
            model.config._attn_implementation = implementation
        for m in attentions:
            if isinstance(m.layer_idx, torch.Tensor):
                m.layer_idx = int(m.layer_idx)
        for m in layers + norms + experts:  # an instance's own forward (a wrapper set before) comes back
            m.__dict__.pop("forward", None)
            if id(m) in own_forwards:
                m.forward = own_forwards[id(m)]
        cache.__dict__.pop("update", None)
        if own_update is not None:
            cache.update = own_update


def _set_deferral(model: nn.Module, n: int) -> None:
    """Eager deferral of the model's experts modules on (n > 0) or off, leaving its recorded setting alone."""
    from ktorch.integrations.deferral import set_deferred_experts as set_chain
    from ktorch.placement import experts_modules

    set_chain([m for _, m in experts_modules(model)], n)


def _model_device(model: nn.Module) -> torch.device:
    return model.get_input_embeddings().weight.device


def cache_length(max_len: int, context: Optional[int]) -> int:
    """The static cache's length for ``max_len`` positions: rounded up to ``CACHE_BUCKET``, but not past the
    model's ``context`` (max_position_embeddings) where ``max_len`` fits in it, and always a multiple of the decode
    attention's block (a prompt past the context once made a cache of 2104 positions, which the GPU's decode
    attention refused)."""
    length = _round_up(max_len, CACHE_BUCKET)
    if context:
        length = min(length, max(context, max_len))
    return _round_up(length, decode_attention.BLOCK)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _decoder_for(model: nn.Module, max_len: int, sampling: Sampling, cuda_graphs: bool) -> Decoder:
    """The model's kept decoder if it fits (length, graphs), else a new one; a kept one of another sampling or
    deferral drops its captured decode step (they are part of it) and keeps its cache and captured prefills (which
    give logits: deferral is off at prefill)."""
    device = _model_device(model)
    deferred = getattr(model, "kt_deferred_experts", 0)
    old: Optional[Decoder] = getattr(model, "kt_decoder", None)
    if old is not None and old.max_len >= max_len and old.cuda_graphs == (cuda_graphs and device.type == "cuda"):
        if old.sampling != sampling or old.deferred != deferred:
            old.restep(sampling, deferred)
        return old
    if old is not None:  # free its cache and graph before making the next
        model.kt_decoder = None
        del old
        if device.type == "cuda":
            torch.cuda.empty_cache()
    length = cache_length(max_len, getattr(model.config, "max_position_embeddings", None))
    decoder = Decoder(model, length, device, sampling, cuda_graphs)
    decoder.deferred = deferred
    model.kt_decoder = decoder
    return decoder


# ---------------------------------------------------------------- the load-time warm-up

# Device, 2026-11-26, H200 host, a 12-layer random Q8_0 file, fresh `ktorch generate` processes: a first prefill of
# P=512 took 0.47 s against 0.08 s warm, of P=2048 0.54 s against 0.11 s. Most of the one-time cost is per process
# (first kernel launches: ~0.4 s whatever the length), but a prompt longer than an earlier prefill still paid
# 0.08-0.1 s of size-dependent first uses (new kernel shapes, scratch page faults, new CUDA segments: P=2048 after
# three P=512 prefills 0.228 s against 0.127 warm). 2048 covers the 512- and 2048-token prompts the benchmarks and
# issues time; shorter prompts then run warm too.
WARM_UP_TOKENS = 2048
# shorter prefills the warm-up's kept decoder captures too, where they are shorter than its own: a prompt replays the
# smallest captured bucket that holds it, and padding costs the GPU the padded rows' dense work (session 48, 12
# layers, every expert resident: a 512-token prompt 8.2 ms in its own graph against 13.5 padded into 2048's)
WARM_UP_BUCKETS = (512,)
WARM_UP_SEED = 20261126  # the warm-up's random ids (fixed: a warm-up repeats)


def _max_positions(model: nn.Module) -> Optional[int]:
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "max_position_embeddings", None) or getattr(config, "max_position_embeddings", None)


def _prefill_state(model: nn.Module) -> list:
    """What a prefill changes besides its KV cache: per experts module the routing-aware split's counters, last hit
    count and routing frequency (``kt_routed``; the frequency picks the residents) and the residents' hit counter
    (``kt_gpu_hits``); and the experts runtime's counters and timeline."""
    from ktorch.compile.experts_runtime import RUNTIME
    from ktorch.placement import experts_modules

    modules = []
    for _, m in experts_modules(model):
        routed = getattr(m, "kt_routed", None)
        hits = getattr(m, "kt_gpu_hits", None)
        modules.append((m, None if routed is None else (collections.Counter(routed.stats), routed.last_hit,
                                                        routed.frequency.clone()),
                        None if hits is None else hits.clone()))
    timeline = RUNTIME.timeline
    return [modules, collections.Counter(RUNTIME.stats), None if timeline is None else len(timeline)]


def _restore_prefill_state(state: list) -> None:
    from ktorch.compile.experts_runtime import RUNTIME

    modules, stats, timeline = state
    for m, routed, hits in modules:
        if routed is not None:
            m.kt_routed.stats.clear()
            m.kt_routed.stats.update(routed[0])
            m.kt_routed.last_hit = routed[1]
            m.kt_routed.frequency.copy_(routed[2])
        if hits is not None:
            m.kt_gpu_hits.copy_(hits)
    RUNTIME.stats.clear()
    RUNTIME.stats.update(stats)
    if timeline is not None and RUNTIME.timeline is not None:
        del RUNTIME.timeline[timeline:]


@contextlib.contextmanager
def _unseen_prefill(model: nn.Module):
    """A prefill that is no prompt's (the load-time warm-up, a capture's padded run): the model's prefill state
    (``_prefill_state``) put back after it, the experts runtime's observers (routing recorders) not shown its calls."""
    state = _prefill_state(model)
    observers, RUNTIME.observers = RUNTIME.observers, []
    try:
        yield
    finally:
        RUNTIME.observers = observers
        _restore_prefill_state(state)


@contextlib.contextmanager
def _no_deferral(model: nn.Module, deferred: int):
    """The model's eager expert deferral off while open (``deferred``: its setting, put back after), as every prefill
    runs: nothing to overlap it with, and two CPU calls a layer instead of one."""
    if deferred:
        _set_deferral(model, 0)
    try:
        yield
    finally:
        if deferred:
            _set_deferral(model, deferred)


def warm_up(model: nn.Module, tokens: int = WARM_UP_TOKENS, capture: bool = True) -> float:
    """One prefill of ``tokens`` random ids (capped by the model's maximum positions) through a throwaway cache, so
    that the first prompt after loading runs at warm speed; returns its seconds (the device synchronized), 0.0 on
    the CPU, where it does nothing (the one-time costs it takes are the GPU's: a first prefill on the CPU measured
    as fast as the next ones).

    ``ktorch.load`` ends with it on a GPU, and so does the command line's loading (after the placement options:
    the split's stagings and the residents are warmed too); after ``ktorch.prepare`` call it yourself. It runs as
    ``generate``'s prefill does (the model's expert deferral off): the split's counters and routing frequency, the
    residents' hit counters and the experts runtime's counters and timeline are put back, and the experts runtime's
    observers do not see its calls. What it keeps: the split's costs learn from its CPU calls
    (``SplitCosts.observe_cpu``), so a first prompt splits with them; its routing picks the first residents where the
    GPU budget placed them without a profile (``_unseeded_residents``); and, where the model keeps no decoder yet,
    one whose prefills of ``tokens`` and ``WARM_UP_BUCKETS`` positions are captured (``_warm_up_capture``), for a
    first prompt to replay.
    ``capture=False``: not that decoder, where no prompt would replay it (``generate(cuda_graphs=False)``, the
    command line's ``--no-compile``; ``serve``, whose engine captures its own steps)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"warm_up: tokens must be an int >= 1, got {tokens!r}")
    if _model_device(model).type != "cuda":
        return 0.0
    return _warm_up_prefill(model, tokens) + (_warm_up_capture(model, tokens) if capture else 0.0)


@torch.inference_mode()
def _warm_up_capture(model: nn.Module, tokens: int) -> float:
    """Keeps a decoder on the model (``model.kt_decoder``, greedy, with CUDA graphs) whose cache holds the positions
    the GPU budget reserves (``gpu_memory.KV_TOKENS``, within the model's context), with the prefill of ``tokens``
    positions captured, and those of the ``WARM_UP_BUCKETS`` shorter than it, so that a first prompt of up to
    ``tokens`` tokens replays the smallest that holds it, padded (``Decoder.prefill_graph``), instead of prefilling
    eagerly; returns its seconds. Not where the model keeps a
    decoder already, where its decode attention would read the whole cache (``decode_attention.applies``: each decode
    step would read the longer cache), or where its prefill cannot be captured (``captured_prefill_problem``: nothing
    is kept then)."""
    t0 = time.perf_counter()
    if getattr(model, "kt_decoder", None) is not None:
        return 0.0
    limit = _max_positions(model)
    tokens = min(tokens, limit) if limit else tokens
    device = _model_device(model)
    if decode_attention.applies(model, device) is not None:
        return 0.0
    from ktorch.gpu_memory import KV_TOKENS  # the KV cache the GPU budget reserves

    length = max(min(KV_TOKENS, limit) if limit else KV_TOKENS, tokens)
    decoder = _decoder_for(model, length, Sampling(), cuda_graphs=True)
    with _no_deferral(model, decoder.deferred):
        decoder.capture_prefill(tokens)
        longest = decoder.prefill_bucket(tokens)
        if longest not in decoder.prefill_graphs:
            model.kt_decoder = None
            del decoder
            torch.cuda.empty_cache()
            return time.perf_counter() - t0
        for shorter in WARM_UP_BUCKETS:
            if shorter < longest:
                decoder.capture_prefill(shorter)
        decoder.prefill_graphs.move_to_end(longest)  # the longest, which serves any prompt, is evicted last
    return time.perf_counter() - t0


@torch.inference_mode()
def _warm_up_prefill(model: nn.Module, tokens: int) -> float:
    """``warm_up``'s prefill on any device (the CPU tests run it there)."""
    t0 = time.perf_counter()
    limit = _max_positions(model)
    tokens = min(tokens, limit) if limit else tokens
    device = _model_device(model)
    decoder = Decoder(model, tokens, device, Sampling(), cuda_graphs=False)  # not model.kt_decoder: thrown away
    ids = torch.randint(0, _vocab_size(model), (1, tokens), generator=torch.Generator().manual_seed(WARM_UP_SEED))
    _warm_resident_tiles(model)  # first: the prefill's own tile is among them
    unseeded = _unseeded_residents(model)
    with _unseen_prefill(model), _no_deferral(model, getattr(model, "kt_deferred_experts", 0)):
        int(decoder.prefill(ids.to(device)).item())  # the host read waits for the device, as a prompt's does
        routing = {m: m.kt_routed.frequency.clone() for m in unseeded}  # its rows per expert (none counted before)
    if routing:
        from ktorch.gpu_memory import seed_resident_experts

        seed_resident_experts(model, routing)
    return time.perf_counter() - t0


def _unseeded_residents(model: nn.Module) -> list:
    """The experts modules whose residents the warm-up's routing picks: residents placed by the GPU budget without an
    expert profile (``kt_residents_profiled``: each layer's first experts), before any prompt counted routing. A
    model's expert popularity shows in its routers whatever the tokens (their biases; session 58: skewed routers'
    first 512-token prompt hit 57% of its experts among 73 first residents of 128, the share of arbitrary ones, and
    99% after the swaps its prefill made), so random ids pick better first residents than ids 0, 1, 2, ...; prompts'
    routing swaps them from then on (``begin_resident_swaps``)."""
    from ktorch.placement import experts_modules

    return [m for _, m in experts_modules(model)
            if getattr(m, "kt_gpu_expert_ids", None) and getattr(m, "kt_routed", None) is not None
            and not getattr(m, "kt_residents_profiled", False) and float(m.kt_routed.frequency.sum()) == 0]


TILE_COMPILE_THREADS = 16  # the warm-up's tile launches run in at most this many threads at once


def _warm_resident_tiles(model: nn.Module) -> int:
    """The grouped prefill kernels at every tile on the residents' formats and on the split's copied experts (packed
    blocks in the staging: ``routed_experts.reads_blocks``), once per distinct format (``triton_prefill
    .tile_launches``: a prefill compiles the tile of its own length only); returns the launches. They run side by
    side in threads, before the warm-up's prefill: Triton's compile releases the GIL (dev machine, session 58: four
    compiles of one kernel 1.15 s one after another, 0.64 s in two threads), and a fresh machine spent 4.5 s of a
    5.8 s warm-up prefill compiling 12 grouped-kernel specializations and 1.1 s on three alignment scans, one at a
    time (session 58 call 1)."""
    from concurrent.futures import ThreadPoolExecutor

    from ktorch.ops.resident_rows import RowExperts
    from ktorch.ops.routed_experts import reads_blocks
    from ktorch.ops.triton_prefill import PackedBlocks, tile_launches

    seen, launches = set(), []
    dtype = model.get_input_embeddings().weight.dtype  # the activations' dtype
    for m in model.modules():
        activation = getattr(m, "kt_activation", "silu")
        candidates = [getattr(m, "kt_gpu_packed", None)]
        routed = getattr(m, "kt_routed", None)  # the split's copied experts, read as packed blocks in the staging
        staging = None if routed is None else routed.staging
        if staging is not None and staging.capacity and staging.packed.is_cuda and \
                reads_blocks(routed.layer, dtype, staging.packed.device, routed.kernel):
            candidates.append(PackedBlocks(*routed.layer.views_in(staging.packed, 1)))  # one expert's bytes
        for rows in candidates:
            if not isinstance(rows, (RowExperts, PackedBlocks)) or not rows.w13.is_cuda:
                continue
            key = (type(rows), tuple(None if t is None else (t.dtype, tuple(t.shape[1:])) for t in rows), activation)
            if key not in seen:
                seen.add(key)
                launches += [(rows.w13.device, launch) for launch in tile_launches(rows, activation, dtype)]
    if not launches:
        return 0

    def run(job) -> None:  # a thread of its own: inference mode and the device are per thread
        device, launch = job
        with torch.inference_mode(), torch.cuda.device(device):
            launch()

    workers = min(len(launches), TILE_COMPILE_THREADS)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kt-tiles") as pool:
        list(pool.map(run, launches))  # re-raises a launch's error here
    for device in {device for device, _ in launches}:
        torch.cuda.synchronize(device)
    return len(launches)


@torch.inference_mode()
def generate(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int = 64, *, temperature: float = 0.0,
             top_p: float = 1.0, repetition_penalty: float = 1.0, seed: int = 0,
             eos_token_id: Optional[Sequence[int] | int] = None, cuda_graphs: bool = True,
             on_tokens: Optional[Callable[[list], None]] = None, on_status: Optional[Callable[[str], None]] = None
             ) -> GenerationResult:
    """Generates up to ``max_new_tokens`` after ``input_ids`` ([1, P] or [P]) with a ktorch-prepared model.

    ``eos_token_id`` (default: the model's generation config's) ends generation after it; ``on_tokens(ids)`` is
    called with each new token as it is known (a list of one id; the last step's may come with the one before);
    ``on_status(text)`` with progress messages (the capture). ``cuda_graphs=False`` decodes eagerly on a GPU
    too. The model's ``deferred_experts`` (``ktorch.prepare`` / ``set_deferred_experts``) applies to decode."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    sampling = Sampling(float(temperature), float(top_p), float(repetition_penalty))
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [1, P] or [P] with P >= 1 (batch 1), got {tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be integer token ids, got {ids.dtype}")
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(embeddings, "num_embeddings", None) or _vocab_size(model)
    low, high = int(ids.min()), int(ids.max())  # (one sync a call; on a GPU a bad id would be a device-side assert)
    if low < 0 or high >= vocab:
        raise ValueError(f"input_ids must be token ids in [0, {vocab}) (the model's vocabulary), got values from {low} "
                         f"to {high}")
    if eos_token_id is None:
        gc = getattr(model, "generation_config", None)
        eos_token_id = getattr(gc, "eos_token_id", None)
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    prompt_len = ids.shape[1]
    limit = _max_positions(model)
    if limit and prompt_len + max_new_tokens > limit:  # runs (rotary positions have no hard end), but untrained
        # stacklevel 3: the caller's line (inference_mode's wrapper is the second frame)
        warnings.warn(f"the prompt ({prompt_len} tokens) and max_new_tokens ({max_new_tokens}) pass this model's "
                      f"context of {limit} positions (config.max_position_embeddings): the model was not trained "
                      "on positions beyond it, and its output there may be meaningless", stacklevel=3)
    device = _model_device(model)
    ids = ids.to(device)
    decoder = _decoder_for(model, prompt_len + max_new_tokens, sampling, cuda_graphs)
    decoder.generator.manual_seed(seed)
    timings = Timings(prompt_tokens=prompt_len, cuda_graphs=decoder.cuda_graphs)
    result = GenerationResult(timings=timings)
    deferred = decoder.deferred

    if decoder.cuda_graphs and decoder.graph is None:
        preload_compiler()  # while prefill runs
    with _no_deferral(model, deferred):
        t0 = time.perf_counter()
        first = decoder.prefill(ids)
        first_id = int(first.item())
        RUNTIME.check_handoff()  # a captured prefill's CPU experts call that timed out is an error, not a token
    timings.first_token_s = time.perf_counter() - t0
    timings.prefill_replayed = decoder.replayed
    result.ids.append(first_id)
    if on_tokens:
        on_tokens([first_id])
    if max_new_tokens == 1 or first_id in eos:
        timings.new_tokens = len(result.ids)
        return _capture_repeated_prefill(model, decoder, prompt_len, result, on_status)

    swaps = None
    if getattr(model, "kt_gpu_memory", None) is not None:  # residents follow the prefill's routing, behind decode
        from ktorch.gpu_memory import begin_resident_swaps

        swaps = begin_resident_swaps(model)  # copies on a side stream; poll() flips the slot maps between steps
        timings.resident_swaps, timings.resident_swap_s = swaps.swapped, swaps.seconds

    stepped = 0  # decode steps already run (the capture's eager one)
    if decoder.cuda_graphs and decoder.graph is None and not getattr(model, "kt_decode_capture_failed", None):
        if on_status:
            on_status("compiling the decoder layers and capturing the decode step as a CUDA graph (once per model "
                      "and cache size; the compiled code is cached on disk for the next run)...")
        t1 = time.perf_counter()
        try:
            decoder.capture()
        except Exception as e:  # what a compile or a capture cannot take in a model not tried: eager decode steps
            RUNTIME.abandon_capture()
            model.kt_decode_capture_failed = f"{type(e).__name__}: {str(e)[:300]}"
            warnings.warn(f"ktorch: this model's decode step could not be compiled and captured as a CUDA graph "
                          f"({model.kt_decode_capture_failed}); it decodes eagerly (slower)", stacklevel=3)
        stepped = 1 if decoder.captured_step_ran else 0
        timings.warmup_s = time.perf_counter() - t1
        timings.warmup_tokens = stepped
        if on_status and decoder.graph is not None:
            on_status(f"decode step captured in {timings.warmup_s:.1f} s")

    # decode: step i + 1 is launched before step i's token is read (copied to pinned memory behind the step)
    n_steps = max_new_tokens - 1
    lag = 1 if device.type == "cuda" else 0
    host = torch.empty(n_steps, dtype=torch.long, pin_memory=device.type == "cuda")
    events: list = [None] * n_steps
    pending: collections.deque = collections.deque()
    stopped = False

    def read(i: int) -> bool:
        if events[i] is not None:
            events[i].synchronize()
            RUNTIME.check_handoff()  # a captured step whose CPU experts call timed out is an error, not a token
        tok = int(host[i])
        result.ids.append(tok)
        if on_tokens:
            on_tokens([tok])
        return tok in eos

    t2 = time.perf_counter()
    for i in range(n_steps):
        if i >= stepped:
            decoder.step()
        if swaps is not None and swaps.pending:
            swaps.poll()
        host[i].copy_(decoder.token[0, 0], non_blocking=True)
        if device.type == "cuda":
            events[i] = torch.cuda.Event()
            events[i].record()
        pending.append(i)
        while len(pending) > lag and not stopped:
            stopped = read(pending.popleft())
        if stopped:
            break
    while pending and not stopped:
        stopped = read(pending.popleft())
    if swaps is not None:
        swaps.finish()  # in stream order: the next prefill sees the new residents
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # steps launched after an end-of-sequence token
    timings.decode_s = time.perf_counter() - t2
    timings.new_tokens = len(result.ids)
    return _capture_repeated_prefill(model, decoder, prompt_len, result, on_status)


def _capture_repeated_prefill(model: nn.Module, decoder: Decoder, prompt_len: int, result: GenerationResult,
                              on_status: Optional[Callable[[str], None]]) -> GenerationResult:
    """After a generation (its tokens all given out): where this was the ``CAPTURE_AFTER``-th prompt of its bucket
    on ``decoder`` and none is captured yet, captures the bucket's prefill (``Decoder.capture_prefill``, deferral
    off as at prefill), which the later prompts of that bucket replay; its seconds in ``prefill_capture_s``. Not
    before a prefill: a capture costs more than one eager prefill (a padded eager run, then the recording: 0.04-0.7 s
    for 12 layers, device, session 46, against 16-170 ms for the eager prefill), so a prompt that comes once (a
    ``ktorch generate`` command, most chat turns, whose lengths grow) would wait longer for its first token."""
    bucket = decoder.prefill_bucket(prompt_len)
    if not decoder.cuda_graphs or bucket is None or bucket in decoder.prefill_graphs:
        return result
    decoder.bucket_uses[bucket] += 1
    if decoder.bucket_uses[bucket] < CAPTURE_AFTER:
        return result
    with _no_deferral(model, decoder.deferred):
        result.timings.prefill_capture_s = decoder.capture_prefill(prompt_len)
    if on_status and result.timings.prefill_capture_s:
        on_status(f"prefill of {bucket} tokens captured as a CUDA graph in {result.timings.prefill_capture_s:.2f} s "
                  "(prompts of this length replay it from now on)")
    return result
