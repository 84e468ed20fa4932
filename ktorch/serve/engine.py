"""The serving engine: transformers' continuous-batching manager driving a ktorch-prepared model.

transformers (>= 5.2x) ships a continuous-batching manager (``model.init_continuous_batching()``) that does what the
server needs and runs a ktorch-loaded model unchanged (its greedy outputs equal ``model.generate``'s:
tests/test_serve.py): a paged KV cache with block tables, a scheduler that adds requests to and removes them from
the running batch at every step and cuts long prompts into chunks of at most ``max_batch_tokens`` tokens that share
a step with the other requests' decode tokens, all flattened into one ragged batch ``[1, T]`` per step (so each MoE
layer makes one ``kt.fused_moe`` call carrying every active sequence's tokens), prefix sharing (each full page of a
prompt is hashed with its prefix; a later prompt with the same leading pages reuses their KV blocks and computes only
the rest; pages no request holds stay cached until the pool runs short), CUDA-graph capture and replay of a step,
and an optional pinned host-memory swap pool for preempted requests' KV (``cpu_offload_gib``). Under pressure
transformers evicts all unheld cached pages at once; ``host_cache_gib`` keeps them in host memory instead
(ktorch/serve/host_tier.py: the prefix cache's second tier, least recently used dropped first).

ktorch adds: per-request greedy / seeded sampling (ktorch/serve/sampling.py), admission limits (requests in flight,
prompt tokens not yet prefilled: 429), counters of the tokens each step computed (the prefix cache's effect is
visible there) and of graph replays, optional per-step statistics (tokens, seconds, distinct experts read), and on a
GPU its own choice of which steps run under CUDA graphs (``plan_cuda_graphs``, ``step_bucket``): transformers turns
graphs on by itself only with flash attention, whose block-table decode path it graphs; with sdpa (what ktorch
models run) every step takes the varlen path, which ktorch pads to a few token buckets and graphs up to
``GRAPH_MAX_TOKENS`` tokens (decode steps, short prompt chunks), their decoder layers compiled regionally as
``ktorch.generate``'s decode step (``compiled_step_layers``), larger steps (prefill chunks, where the experts'
compute dominates) running eagerly.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import secrets
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

log = logging.getLogger("ktorch.serve")


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def check_transformers() -> None:
    """Raises RuntimeError unless transformers has the continuous-batching manager as ktorch uses it (>= 5.24)."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__).release < (5, 24):
        raise RuntimeError(f"ktorch serve needs transformers >= 5.24 (its continuous-batching manager as ktorch uses "
                           f"it); this is {transformers.__version__}: pip install 'transformers>=5.24'")


def _register_final_step_pages(cache) -> None:
    """transformers 5.24 registers the pages a step completed only if the request is still running after it
    (``PagedAttentionCache.mark_complete_blocks`` returns early for a finished request, a guard for async batching,
    where the block table may already be gone); so a request ending with its last prefill chunk (max_tokens 1) or
    its last decode token leaves those pages unshared. Register them too, whenever the block table still exists."""
    from transformers.generation.continuous_batching.requests import RequestStatus

    mark = cache.mark_complete_blocks

    def mark_complete_blocks(state, complete_blocks) -> None:
        if (state.status == RequestStatus.FINISHED and complete_blocks and cache.allow_block_sharing
                and all(state.request_id in a.block_table for a in cache.cache_allocators.values())):
            token_ids = state.initial_tokens + state.generated_tokens
            for name, new_complete_blocks in complete_blocks.items():
                cache.cache_allocators[name].mark_complete_blocks(state.request_id, token_ids, new_complete_blocks)
            return
        mark(state, complete_blocks)

    cache.mark_complete_blocks = mark_complete_blocks


FIRST_OUTPUT_WAIT_S = 0.005  # the most a step giving first tokens waits for the server's loop to send them


# ---------------------------------------------------------------- CUDA graphs on a GPU

GRAPH_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # a graphed step's tokens are padded up to one of these
GRAPH_MAX_TOKENS = GRAPH_TOKEN_BUCKETS[-1]  # larger steps (prefill chunks) run eagerly, unpadded
GRAPH_KV_MIN = 256  # a graphed step's cache reads (all its sequences' past tokens) are padded to a power of two from
# this up to GRAPH_KV_INTERVAL, and to a multiple of GRAPH_KV_INTERVAL above it: the attention (the one part of a
# step that sees the reads) computes over the padded length, so one stream at 300 tokens of context attends 512
# positions instead of 4096. Benchmarks set it to GRAPH_KV_INTERVAL for session 31's buckets (multiples only).
GRAPH_KV_INTERVAL = 4096


def plan_cuda_graphs(device_type: str, attn_implementation: Optional[str], cuda_graphs: Optional[bool]) -> str:
    """Who captures the steps' CUDA graphs: ``"off"`` (CPU, or turned off), ``"ktorch"`` (sdpa / eager attention on a
    GPU: transformers would leave graphs off; ktorch pads the varlen step to its buckets and graphs the small ones),
    or ``"transformers"`` (flash attention: its own block-table decode graphs and asynchronous batching)."""
    if device_type != "cuda" or cuda_graphs is False:
        return "off"
    if attn_implementation is not None and "flash" in attn_implementation:
        return "transformers"
    return "ktorch"


def _round_up(n: int, interval: int) -> int:
    return -(-n // interval) * interval


def kv_bucket(reads: int, max_tokens_read: int) -> int:
    """A graphed step's cache reads as run: the next power of two from ``GRAPH_KV_MIN`` up to ``GRAPH_KV_INTERVAL``,
    above it the next multiple of ``GRAPH_KV_INTERVAL``, capped at the pool's ``max_tokens_read`` (0 reads take the
    first bucket, as transformers pads them: one graph whether or not the step reads the cache)."""
    if reads < 0 or max_tokens_read < 1:
        raise ValueError(f"kv_bucket: reads must be >= 0 and max_tokens_read >= 1, got {reads} and {max_tokens_read}")
    bucket = max(GRAPH_KV_MIN, 1 << max(reads - 1, 0).bit_length())
    if bucket > GRAPH_KV_INTERVAL:
        bucket = _round_up(reads, GRAPH_KV_INTERVAL)
    return min(bucket, max_tokens_read)


def step_bucket(num_q_tokens: int, max_kv_read: int, max_batch_tokens: int,
                max_tokens_read: int) -> tuple[int, int, bool]:
    """A step's (tokens, cache reads) as run, and whether it runs under a CUDA graph (ktorch's plan).

    Steps of at most ``GRAPH_MAX_TOKENS`` tokens are padded to the next of ``GRAPH_TOKEN_BUCKETS`` (within
    ``max_batch_tokens``) and their cache reads to ``kv_bucket``'s; a graph is kept per (tokens, reads) pair.
    Larger steps run as they are, eagerly."""
    if num_q_tokens < 1 or max_kv_read < 0:
        raise ValueError(f"step_bucket: {num_q_tokens} tokens, {max_kv_read} cache reads")
    if num_q_tokens > min(GRAPH_MAX_TOKENS, max_batch_tokens):
        return num_q_tokens, max_kv_read, False
    q = min(next(b for b in GRAPH_TOKEN_BUCKETS if b >= num_q_tokens), max_batch_tokens)
    return q, kv_bucket(max_kv_read, max_tokens_read), True


WARM_UP_READS_TOKENS = 16  # token buckets up to this are warmed up at every reads bucket up to GRAPH_KV_INTERVAL


def warm_up_steps(max_batch_tokens: int, max_tokens_read: int) -> list[tuple[int, int]]:
    """The graphs captured before serving, as (tokens, cache reads) pairs of buckets: every token bucket
    ``step_bucket`` can give at the first reads bucket, then the token buckets up to ``WARM_UP_READS_TOKENS`` at
    each reads bucket after it up to ``GRAPH_KV_INTERVAL`` (512, 1024, 2048, 4096): one stream's decode up to 4096
    tokens of context, a few streams' at short contexts, and a short suffix after a cached prefix (issue 33's
    second request: 8 new tokens after 2000 cached, bucket (8, 2048)) capture nothing while serving. Other pairs
    are captured when first met (a capture of a token bucket already compiled compiles nothing)."""
    top = min(GRAPH_MAX_TOKENS, max_batch_tokens)
    sizes = sorted({step_bucket(q, 0, max_batch_tokens, max_tokens_read)[0] for q in range(1, top + 1)})
    first = kv_bucket(0, max_tokens_read)
    steps, r = [(q, first) for q in sizes], first
    while r < min(GRAPH_KV_INTERVAL, max_tokens_read):
        r = kv_bucket(r + 1, max_tokens_read)
        steps += [(q, r) for q in sizes if q <= WARM_UP_READS_TOKENS]
    return steps


def compiled_step_layers(model, cache):
    """The context a graphed step is captured in: its decoder layers compiled regionally as ``ktorch.generate``'s
    decode step (ktorch/generation.py ``compiled_layers``: one Inductor compile shared by every layer, the KV cache's
    update and the routed experts eager), with the attention eager too (it alone sees the step's padded cache reads:
    the layers then compile once per token bucket, not per (tokens, reads) pair). Benchmarks swap it for a no-op
    context for the eager layers (session 31's capture)."""
    from ktorch.generation import compiled_layers

    return compiled_layers(model, cache, eager_attention=True)


def count_distinct_experts(refs: list) -> tuple[int, int]:
    """(distinct experts, their bytes) of one step, summed over its MoE layers: ``refs`` holds each layer's routing
    ids (negative: padding rows, left out), its bytes per expert and its number of experts. All layers in one
    scatter and one read back to the host (a unique per layer was a device sync each: 48 on the 48-layer model,
    after the step and before its outputs went out)."""
    if not refs:
        return 0, 0
    ids = [r[0].reshape(-1) for r in refs]
    if len({(t.numel(), t.device) for t in ids}) != 1:  # layers of different shapes: one at a time
        used = [torch.unique(t[t >= 0]).numel() for t in ids]
    else:
        experts = max(r[2] for r in refs)
        flat = torch.stack(ids).to(torch.int64)
        flat = torch.where(flat >= 0, flat, experts)  # padding rows to a column of their own
        seen = torch.zeros(len(ids), experts + 1, dtype=torch.bool, device=flat.device).scatter_(1, flat, True)
        used = seen[:, :experts].sum(1).tolist()
    return sum(used), sum(u * r[1] for u, r in zip(used, refs))


def _mark_reads_dynamic(batch_data: dict) -> None:
    """Marks the dimension of a step's inputs that counts its cache reads (the attention mask's keys, the read
    indices) dynamic for Dynamo. The compiled layers only pass them to the eager cache update and attention, but
    their outer frames (the layer's call) guard every input's shape, and with static shapes each new (tokens, reads)
    pair would trace them again, up to Dynamo's limit of entries per frame; marked, they guard the tokens only."""
    masks = batch_data.get("attention_mask")
    for mask in (masks.values() if isinstance(masks, dict) else [masks]):
        if isinstance(mask, torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(mask, mask.dim() - 1)
    for index in batch_data.get("read_index") or []:
        if isinstance(index, torch.Tensor) and index.dim() == 1:
            torch._dynamo.maybe_mark_dynamic(index, 0)


# ---------------------------------------------------------------- the KV pool in the GPU memory budget

DEFAULT_MAX_BATCH_TOKENS = 8192  # transformers' tokens per step on a GPU when none is given (its memory handler's)
KV_POOL_TOKENS = 32768  # the pool's default size on a GPU whose memory resident experts share (ktorch/gpu_memory.py):
# 3 GiB of KV for Qwen3-30B-A3B (96 KiB a token), e.g. 32 requests of 1k tokens; what the budget leaves over joins it
LOGIT_ROWS = 1024  # rows of logits a step may hold (transformers' default requests per step)
LOGIT_BYTES = 16  # per row and vocabulary entry: fp32 logits, and top-p's sorted fp32 copy with its int64 indices


@dataclass
class KvPool:
    """The paged pool ``ktorch serve`` sizes before resident experts fill the GPU: ``num_blocks`` pages of
    ``page_size`` tokens, steps of at most ``max_batch_tokens`` tokens; ``kv_bytes_per_token`` over all layers;
    ``activation_bytes`` the device memory a step takes beside the pool (attention masks over the whole pool, the
    experts' and attention's temporaries, the logits); ``mask_bytes_per_token``: what one more pooled token adds to
    the masks."""

    num_blocks: int
    page_size: int
    max_batch_tokens: int
    kv_bytes_per_token: int
    mask_bytes_per_token: int
    activation_bytes: int

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.page_size

    @property
    def nbytes(self) -> int:
        """The reserve: the pool's KV pages plus what a step takes beside them."""
        return self.tokens * (self.kv_bytes_per_token + self.mask_bytes_per_token) + self.activation_bytes

    def grown_by(self, extra_bytes: int) -> "KvPool":
        """The pool with as many more pages as ``extra_bytes`` pay for (their KV and their share of the masks)."""
        per_page = self.page_size * (self.kv_bytes_per_token + self.mask_bytes_per_token)
        return KvPool(self.num_blocks + max(int(extra_bytes), 0) // per_page, self.page_size, self.max_batch_tokens,
                      self.kv_bytes_per_token, self.mask_bytes_per_token, self.activation_bytes)

    def line(self) -> str:
        g = 1 << 30
        return (f"KV pool {self.num_blocks} pages of {self.page_size} tokens ({self.tokens} tokens, "
                f"{self.tokens * self.kv_bytes_per_token / g:.2f} GiB; with the steps' masks and activations "
                f"{self.nbytes / g:.2f} GiB, reserved before the resident experts)")


def kv_pool_for(model_config, dtype: torch.dtype, config: "EngineConfig") -> KvPool:
    """The pool ``config`` asks for on a GPU whose memory resident experts share: ``num_blocks`` pages, else
    ``kv_cache_gib`` of KV, else ``KV_POOL_TOKENS`` tokens; steps of ``max_batch_tokens`` (default transformers' 8192).

    Its bytes (``KvPool.nbytes``) are the GPU memory plan's reserve (``ktorch.set_stream_experts(..., reserve=)``),
    counted as transformers' memory handler counts a pool (pages, attention masks [M, pool + M] in the model's dtype
    for sdpa/eager attention, the per-token activations; ktorch's generous per-token activation estimate of
    ktorch/gpu_memory.py covers the experts' temporaries and transformers' attention peak), plus ``LOGIT_ROWS`` rows
    of logits and their sampling's copies (``LOGIT_BYTES``)."""
    from ktorch.gpu_memory import ACTIVATION_BYTES_PER_TOKEN_HIDDEN

    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    size = torch.empty((), dtype=dtype).element_size()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    kv_per_token = 2 * text.num_hidden_layers * kv_heads * head_dim * size
    page = config.page_size
    if config.num_blocks is not None:
        blocks = config.num_blocks
    elif config.kv_cache_gib is not None:
        blocks = max(4, int(config.kv_cache_gib * (1 << 30) // (page * kv_per_token)))
    else:
        blocks = -(-KV_POOL_TOKENS // page)
    m = config.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS
    flash = "flash" in str(getattr(model_config, "_attn_implementation", None) or "")
    mask_per_token = 0 if flash else m * size  # one more pooled token: one more mask column for every step row
    activations = (m * m * size * (not flash) + m * text.hidden_size * ACTIVATION_BYTES_PER_TOKEN_HIDDEN
                   + min(m, LOGIT_ROWS) * text.vocab_size * LOGIT_BYTES)
    return KvPool(blocks, page, m, kv_per_token, mask_per_token, activations)


class AdmissionError(Exception):
    """The engine is full (requests in flight or prompt tokens waiting): the server answers 429."""


@dataclass
class EngineConfig:
    """What the serving engine is allowed to use. ``None`` leaves a value to transformers' own sizing."""

    page_size: int = 16  # tokens per KV page; prefix sharing matches whole pages (at 64, a second request sharing a
    # 2000-token prefix recomputed 24 tokens for its 8 new ones: device, session 26)
    num_blocks: Optional[int] = None  # KV pages in the pool (None: kv_cache_gib, or transformers' sizing on a GPU)
    kv_cache_gib: Optional[float] = None  # KV pool size when num_blocks is None (None: 1 GiB on the CPU, transformers'
    # sizing from free memory on a GPU: it would take 90% of the free host memory on the CPU)
    max_batch_tokens: Optional[int] = None  # tokens per step: decode tokens plus the prompt chunk (None: 512 on the
    # CPU, transformers' sizing on a GPU)
    max_requests: int = 256  # requests in flight (queued or running); one more gets 429
    max_queued_tokens: int = 1 << 17  # prompt tokens of admitted requests not yet through prefill; more gets 429
    max_batch_requests: Optional[int] = None  # requests per step (None: transformers' default)
    cuda_graphs: Optional[bool] = None  # None: on for a GPU (plan_cuda_graphs), off on the CPU
    warm_up_graphs: bool = True  # capture each token bucket's first graph before serving (GPU, ktorch's plan)
    cpu_offload_gib: float = 0.0  # pinned host memory for preempted requests' KV (0: re-prefill them instead)
    prefix_cache: bool = True
    host_cache_gib: float = 0.0  # the prefix cache's second tier: evicted pages kept in host memory (0: off)
    step_stats: bool = False  # record per-step tokens/seconds/distinct experts (syncs the device around each step)
    max_memory_percent: Optional[float] = None  # the share of free memory transformers checks the pool against
    # (None: its own 0.8 or 0.9); 1.0 when ktorch's GPU memory plan reserved the pool's bytes already (kv_pool_for)


@dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: Optional[int] = None  # sampling only; None: a fresh random seed


@dataclass
class StepRecord:
    tokens: int
    seconds: float
    distinct_experts: int = 0  # summed over MoE layers
    expert_bytes: int = 0  # packed bytes of those experts
    mode: str = "eager"  # "replay" (a CUDA graph replayed), "capture" (one captured: ran twice) or "eager"


@dataclass
class _Request:
    request_id: str
    prompt_len: int
    queue: asyncio.Queue
    prefilled: bool = False
    finished: bool = False


class ServeEngine:
    """Owns the continuous-batching manager of one model; async ``submit`` / ``cancel`` from the server's loop."""

    def __init__(self, model, eos_token_id, pad_token_id: Optional[int], config: EngineConfig = EngineConfig()):
        check_transformers()
        from transformers import ContinuousBatchingConfig, GenerationConfig
        from transformers.generation.continuous_batching.cb_logits_processors import (
            ContinuousBatchingTemperatureLogitsWarper,
            ContinuousBatchingTopPLogitsWarper,
        )

        from ktorch.serve.sampling import SeededSampling

        self.model = model
        self.config = config
        self.context_length = int(getattr(model.config.get_text_config(), "max_position_embeddings", 0) or 0)
        # do_sample with non-default temperature/top_p makes transformers build their per-request warpers; the
        # selection itself is switched to argmax below, SeededSampling doing the sampling (ktorch/serve/sampling.py)
        gen = GenerationConfig(do_sample=True, temperature=0.5, top_p=0.5, top_k=None, max_new_tokens=16,
                               eos_token_id=eos_token_id, pad_token_id=pad_token_id if pad_token_id is not None else 0)
        text = model.config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        self.kv_bytes_per_token = 2 * text.num_hidden_layers * kv_heads * head_dim * model.dtype.itemsize
        on_cpu = model.device.type == "cpu"
        num_blocks, max_batch_tokens = config.num_blocks, config.max_batch_tokens
        if num_blocks is None and (config.kv_cache_gib is not None or on_cpu):
            budget = (config.kv_cache_gib if config.kv_cache_gib is not None else 1.0) * (1 << 30)
            num_blocks = max(4, int(budget // (config.page_size * self.kv_bytes_per_token)))
        if max_batch_tokens is None and on_cpu:
            max_batch_tokens = 512
        self.graph_plan = plan_cuda_graphs(model.device.type, getattr(model.config, "_attn_implementation", None),
                                           config.cuda_graphs)
        graphs = {"off": None if on_cpu and config.cuda_graphs is None else False,  # the CPU: as before
                  "ktorch": (True, False),  # the varlen path may be graphed (ktorch picks the steps); no decode path
                  "transformers": True}[self.graph_plan]
        cb = ContinuousBatchingConfig(
            page_size=config.page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
            max_requests_per_batch=config.max_batch_requests, allow_block_sharing=config.prefix_cache,
            use_cuda_graph=graphs, cpu_offload_space=config.cpu_offload_gib,
            use_async_batching=False if self.graph_plan == "ktorch" else None,
            per_request_processors=True, auto_switch_to_flash=False, return_logprobs=False,
            max_memory_percent=config.max_memory_percent,
        )
        self.manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        processors = self.manager.logit_processor
        kinds = [type(p) for p in processors.logits_processor]
        if kinds != [ContinuousBatchingTemperatureLogitsWarper, ContinuousBatchingTopPLogitsWarper]:
            raise RuntimeError(f"ktorch serve: unexpected logits processors from transformers {kinds}; expected "
                               "per-request temperature then top-p (transformers changed?)")
        processors.logits_processor.append(SeededSampling())
        processors.tensors_required += 1
        processors.supported_keys.update(SeededSampling.supported_kwargs)
        processors.do_processing = True
        # argmax over the processed scores: exact greedy for key-0 rows, Gumbel-max sampling for the others
        self.manager.generation_config = copy.copy(self.manager.generation_config)
        self.manager.generation_config.do_sample = False

        self.host_tier = None
        if config.host_cache_gib > 0 and config.prefix_cache:
            from ktorch.serve.host_tier import HostPrefixTier

            self.host_tier = HostPrefixTier(int(config.host_cache_gib * (1 << 30)))
        create = self.manager._create_batch_processor

        def create_and_extend():  # in the generation thread, before its first step
            processor = create()
            self._runner = processor.model_runner
            self._wrap_compute_batch(processor)
            if self.graph_plan == "ktorch":
                self._install_buckets(processor)
                if config.warm_up_graphs:
                    self._warm_up_buckets(processor)
            if config.prefix_cache:
                _register_final_step_pages(processor.cache)
            if self.host_tier is not None:
                self.host_tier.install(processor.cache)
            self._ready.set()
            return processor

        self.manager._create_batch_processor = create_and_extend
        self._install_first_output_hand_off()

        self._lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self.queued_tokens = 0
        # counters (read by /v1/stats and the tests)
        self.forwards = 0  # steps run (a captured step's two forwards count once)
        self.tokens_computed = 0  # the steps' real tokens (no padding)
        self.graph_replays = 0  # steps run by replaying a CUDA graph
        self.graph_captures = 0  # steps that captured a graph (warm-up captures included)
        self.graph_compile_failures = 0  # captures whose compiled layers failed (then every capture is eager)
        self.warmup_seconds = 0.0
        self.steps: deque[StepRecord] = deque(maxlen=4096)
        self.requests_done = 0
        self.requests_cancelled = 0
        self.resident_swaps = 0  # resident experts swapped toward the prompts' routing (_follow_routing)
        self._resident_counted = [0, 0]  # (hits, rows) counted before the counters' last reset by a swap
        self._resident_lock = threading.Lock()
        self._routed = None  # _follow_routing's routed layer (False: none)
        self._hooks = []
        self._ready = threading.Event()  # set by the generation thread once its processor (and graphs) are made
        self._warming_up = False
        self._runner = None  # the batch processor's ModelRunner, once the generation thread has made it
        self._install_padding_mask()
        if config.step_stats:
            self._install_step_stats()

    def _install_first_output_hand_off(self) -> None:
        """A step that gives requests their first token hands the server's loop the GIL until those outputs are out.

        The generation thread delivers a step's outputs to the server's asyncio loop (transformers'
        ``call_soon_threadsafe``) and goes straight on with the next step, whose preparation is Python holding the
        GIL: the loop's turn (detokenize, the response's headers, the chunk's write) then waits for that thread to
        release it, up to the interpreter's switch interval (5 ms). For a request's first token (its time to first
        token) the generation thread instead waits, at most ``FIRST_OUTPUT_WAIT_S``, until the loop has run those
        requests' handlers up to their next wait (``_first_output_delivered``, called by each one's delivery,
        schedules the wake-up after them). Later tokens go out while the next step runs, as before."""
        router = self.manager.output_router
        deliver_batch = router.deliver_batch
        self._first_outputs_left = 0
        self._first_outputs_out = threading.Event()

        def deliver_batch_first_outputs_first(outputs) -> None:
            with router._lock:
                firsts = sum(1 for o in outputs
                             if len(o.generated_tokens) == 1 and o.request_id in router.result_handlers)
            if not firsts:
                return deliver_batch(outputs)
            self._first_outputs_left = firsts
            self._first_outputs_out.clear()
            deliver_batch(outputs)
            self._first_outputs_out.wait(FIRST_OUTPUT_WAIT_S)

        router.deliver_batch = deliver_batch_first_outputs_first

    def _first_output_delivered(self) -> None:
        """On the loop, in a first output's delivery: once the step's last first output is queued, the generation
        thread's wake-up is scheduled behind the handlers those deliveries woke."""
        self._first_outputs_left -= 1
        if self._first_outputs_left == 0:
            asyncio.get_running_loop().call_soon(self._first_outputs_out.set)

    # ------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 900) -> None:
        """Starts the generation thread and returns once it can take requests (on a GPU: its first graphs captured)."""
        self.manager.start()
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.2):
            status = self.manager.background_thread_status
            if not self.manager.is_running() or status.fatal_error is not None:
                raise RuntimeError(f"ktorch serve: the generation thread failed while starting: {status.fatal_error}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"ktorch serve: the generation thread was not ready in {timeout} s")

    def stop(self) -> None:
        if self.manager.is_running():
            self.manager.stop(block=True, timeout=30)
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def healthy(self) -> bool:
        return self.manager.is_running() and self.manager.background_thread_status.fatal_error is None

    # ------------------------------------------------------------ counters

    def _wrap_compute_batch(self, processor) -> None:
        """Counts each step once, with its real tokens and how it ran (graph replay, capture, eager); with
        ``step_stats`` also its seconds (device synced before and after) and the distinct experts it read."""
        runner = processor.model_runner
        compute = runner.compute_batch

        def step_io():  # the IOs holding this step's inputs and graphs (asynchronous batching: the current pair's)
            io = processor.inputs_and_outputs
            return io.io_pairs[io.current_pair].device_io if hasattr(io, "io_pairs") else io

        def compute_batch(model, batch_data) -> None:
            from ktorch.compile.experts_runtime import RUNTIME

            # a captured step whose CPU experts call timed out on the GPU's wait (gpu_handoff.py) stops the
            # engine (a fatal error of its thread) at the next step; the tokens of that step itself may have been
            # sent, as transformers reads them before this runs
            RUNTIME.check_handoff()
            io = step_io()
            graphed = runner._get_forward_fn(io.use_block_table)[1] if runner.pad_inputs else False
            key = io._get_graph_key() if graphed else None
            mode = "eager" if not graphed else ("replay" if io.graphs.get_graph(key) is not None else "capture")
            stats = self.config.step_stats and not self._warming_up
            if self.config.step_stats:
                self._step_ids = []
                self._capture_ids = []
            if stats:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
            if mode == "eager":  # prompt chunks of new lengths: SDPA without cuDNN's per-shape plans (generation.py)
                from ktorch.generation import prefill_attention

                with prefill_attention():
                    compute(model, batch_data)
            elif mode == "capture" and self.graph_plan == "ktorch" and not self.graph_compile_failures:
                # transformers' eager run, then the capture, both with the layers compiled (flash attention's own
                # plan, untried compiled, captures them eager)
                _mark_reads_dynamic(batch_data)
                try:
                    with compiled_step_layers(model, processor.cache):
                        compute(model, batch_data)
                except Exception as e:  # a layer Dynamo or Inductor cannot take: this and later captures eager
                    self.graph_compile_failures += 1
                    log.warning("ktorch serve: capturing a step with its decoder layers compiled failed (%s: %s); "
                                "this and later steps are captured with the layers eager", type(e).__name__, e)
                    compute(model, batch_data)  # the same step again (its KV writes and outputs are rewritten)
            else:
                compute(model, batch_data)
            self.graph_replays += mode == "replay"
            self.graph_captures += mode == "capture"
            if self.config.step_stats and mode == "capture":
                self._graph_ids[key] = self._capture_ids  # the ids tensors each replay of this graph rewrites
            if self._warming_up:
                return
            tokens = int(io.total_seqlen_q)
            self.forwards += 1
            self.tokens_computed += tokens
            if stats:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - t0
                refs = self._graph_ids.get(key, []) if mode == "replay" else self._step_ids
                self.steps.append(StepRecord(tokens, seconds, *count_distinct_experts(refs), mode))
                self._step_ids = []
            if mode == "eager":
                self._follow_routing(tokens, getattr(io, "compute_stream", None))

        runner.compute_batch = compute_batch

    def _install_buckets(self, processor, graphs: bool = True) -> None:
        """ktorch's plan (``step_bucket``): the runner pads small steps to a bucket and graphs them, runs larger ones
        eagerly; a graph is keyed by its (tokens, cache reads) alone (sdpa reads neither ``max_length_k`` nor the
        block table, the rest of transformers' key). ``graphs=False`` pads the same way and runs every step eagerly
        (the CPU tests' view of the padding)."""
        from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs

        runner, io, cache = processor.model_runner, processor.inputs_and_outputs, processor.cache
        if type(io) is not ContinuousBatchingIOs or (graphs and io.use_cuda_graph_varlen is not True):
            raise RuntimeError(f"ktorch serve: expected transformers' synchronous IOs with varlen graphs, got "
                               f"{type(io).__name__} (transformers changed?)")
        runner.pad_inputs = True
        plan = {"graphed": False}
        forward = runner._forward_process_and_sample if runner._compiled_varlen is None else runner._compiled_varlen

        def maybe_pad_inputs(num_q_tokens: int, max_kv_read: int, use_decode_fast_path: bool) -> tuple[int, int]:
            q, kv, graphed = step_bucket(num_q_tokens, max_kv_read, cache.max_batch_tokens, cache.max_tokens_read)
            plan["graphed"] = graphed and graphs
            return q, kv

        def get_forward_fn(use_block_table: bool):
            return forward, plan["graphed"]

        runner.maybe_pad_inputs = maybe_pad_inputs
        runner._get_forward_fn = get_forward_fn
        io._get_graph_key = lambda: (io.num_q_tokens, io.max_kv_read)

    def _warm_up_buckets(self, processor) -> None:
        """Captures the graphs of ``warm_up_steps`` before the first request (so that no request's first token
        waits for a capture of the common sizes, nor a decode step for one at the common context lengths); other
        (tokens, cache reads) pairs are captured when met. The first capture of each token bucket compiles its
        layers (``compiled_step_layers``; Inductor's on-disk cache serves the next process)."""
        runner, cache = processor.model_runner, processor.cache
        t0 = time.perf_counter()
        self._warming_up = True
        captures = self.graph_captures
        steps = warm_up_steps(cache.max_batch_tokens, cache.max_tokens_read)
        try:
            with torch.no_grad():  # as transformers' own warm-up and steps (no autograd path in the experts)
                for q, kv in steps:
                    runner.run_one_warmup(self.model, num_q_tokens=q, max_kv_read=kv)
        finally:
            self._warming_up = False
        if runner.use_cuda_graph_varlen and self.graph_captures - captures < len(steps):
            log.warning("ktorch serve: the warm-up captured %d of %d graphs (transformers' warning above says why); "
                        "the rest are captured when first needed", self.graph_captures - captures, len(steps))
        cache.reset()  # the warm-up requests' pages back to the pool (as transformers' own warm-up)
        self.warmup_seconds = time.perf_counter() - t0

    def _install_padding_mask(self) -> None:
        """Padded steps leave the padding rows out of the CPU experts.

        Under CUDA graphs (or compile) transformers pads each step's tokens to a bucket (64 tokens by default) so
        that a captured graph fits; the padding rows run through the router like real tokens, and on the CPU each
        would make kt.fused_moe read its experts: one stream padded to 64 tokens could read as many experts as 64
        streams. The real tokens are the first ``cu_seq_lens_q[-1]`` rows (padding sequences have length 0); the
        rest get expert id -1, which kt.fused_moe skips (their output rows are 0 and unused). Tensor ops on the
        step's own buffers, so a captured graph replays the mask with the step."""
        from ktorch.integrations.transformers_experts import padding_mask_hooks

        state: dict = {"real": None}

        def model_pre(module, args, kwargs):
            runner = self._runner
            cu = kwargs.get("cu_seq_lens_q")
            state["real"] = cu[-1] if runner is not None and runner.pad_inputs and cu is not None else None

        self._hooks.append(self.model.register_forward_pre_hook(model_pre, with_kwargs=True))
        self._hooks.extend(padding_mask_hooks(self.model, lambda: state["real"]))

    def _install_step_stats(self) -> None:
        """Records each MoE layer's expert ids (after the padding mask) for ``_wrap_compute_batch``'s step record: an
        eager forward's for that step; a capture's are kept per graph, and each replay of the graph rewrites them in
        place, so a replayed step's distinct experts are read from them after the replay."""
        self._step_ids: list = []
        self._capture_ids: list = []
        self._graph_ids: dict = {}
        for m in self.model.modules():
            if getattr(m, "kt_w13", None) is not None:
                per_expert = sum(t.nbytes for t in (m.kt_w13, m.kt_w13_scales, m.kt_w2, m.kt_w2_scales)
                                 if t is not None) // m.kt_w13.shape[0]

                @torch.compiler.disable  # under a compiled capture too: it asks whether the stream is capturing
                def pre(module, args, kwargs, _b=per_expert, _e=m.kt_w13.shape[0]):
                    top_k_index = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
                    if top_k_index is None:
                        return
                    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                        self._capture_ids.append((top_k_index, _b, _e))
                    elif not self._warming_up:
                        self._step_ids.append((top_k_index, _b, _e))

                self._hooks.append(m.register_forward_pre_hook(pre, with_kwargs=True))

    def cache_state(self) -> dict:
        """KV pool use in bytes: held by requests, kept only for prefix reuse (held by none), free."""
        bp = self.manager.batch_processor
        if bp is None:
            return {}
        cache = bp.cache
        total = cache.num_sectors * cache.bytes_per_sector
        free = int(cache.compute_free_capacity(relative=False))
        cached = sum(len(a.ledger.cached_blocks) * a.bytes_per_block for a in cache.cache_allocators.values())
        return {"kv_bytes_total": total, "kv_bytes_free": free, "kv_bytes_prefix_cached": cached,
                "kv_bytes_in_use": total - free - cached, "page_size": self.config.page_size}

    def stats(self) -> dict:
        with self._lock:
            active = len(self._requests)
            queued = self.queued_tokens
        memory = {"rss_bytes": _rss_bytes()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            memory["cuda_memory_allocated"] = torch.cuda.memory_allocated()
            memory["cuda_memory_reserved"] = torch.cuda.memory_reserved()
            from ktorch.compile.experts_runtime import RUNTIME

            # the CPU experts' submits from the GPU: eager ones, and those captured into CUDA graphs (whose replays
            # run them again without counting: a nonzero captured count says the steps run under graphs)
            memory["experts_submits"] = RUNTIME.stats["submits"]
            memory["experts_captured_submits"] = RUNTIME.stats["captured_submits"]
        memory.update(self.resident_stats())
        return {"requests_in_flight": active, "queued_prompt_tokens": queued, "forwards": self.forwards,
                "tokens_computed": self.tokens_computed, "cuda_graphs": self.graph_plan,
                "graph_replays": self.graph_replays, "graph_captures": self.graph_captures,
                "graph_compile_failures": self.graph_compile_failures,
                "graph_warmup_seconds": round(self.warmup_seconds, 3), "requests_done": self.requests_done,
                "requests_cancelled": self.requests_cancelled, **memory, **self.cache_state(),
                **(self.host_tier.stats() if self.host_tier is not None else {})}

    def _follow_routing(self, tokens: int, stream) -> None:
        """After an eager step of at least ``RoutedExperts.min_tokens`` tokens (prompt chunks: the routed layers
        counted their routing, ktorch/ops/routed_experts.py) the resident experts follow it, as ``ktorch.generate``
        has them follow each prompt's: swapped in place where the gain passes the swap policy's thresholds
        (``update_resident_experts``, ``resident_swap_pairs``), on the compute stream, so captured graphs (which read
        the same buffers) stay valid and the next step sees the new ones. The hit counters it resets are kept in
        ``_resident_counted``."""
        plan = getattr(self.model, "kt_gpu_memory", None)
        if plan is None or not plan.resident_per_layer:
            return
        if self._routed is None:  # the first routed layer, found once (the placement is fixed while serving)
            self._routed = next((m.kt_routed for m in self.model.modules()
                                 if getattr(m, "kt_routed", None) is not None), False)
        if not self._routed or tokens < self._routed.min_tokens:
            return
        import contextlib

        from ktorch.gpu_memory import update_resident_experts

        with self._resident_lock, (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
            result = update_resident_experts(self.model)
            self.resident_swaps += result["swapped"]
            for i, n in enumerate(result["prefill_hits"]):
                self._resident_counted[i] += n

    def resident_stats(self) -> dict:
        """The GPU memory plan's resident experts (ktorch/gpu_memory.py), the swaps that made them follow the prompts'
        routing, and their hit rate since the start: routed slots of real tokens computed by residents / all routed
        slots (the padding rows' -1 ids are not counted); empty without residents. One read of the counters (a
        device sync)."""
        plan = getattr(self.model, "kt_gpu_memory", None)
        if plan is None or not plan.resident_per_layer:
            return {}
        from ktorch.gpu_memory import resident_hits

        with self._resident_lock:
            hits, rows = resident_hits(self.model)
            hits, rows = hits + self._resident_counted[0], rows + self._resident_counted[1]
        return {"resident_experts_per_layer": plan.resident_per_layer, "resident_swaps": self.resident_swaps,
                "resident_hits": hits, "resident_rows": rows,
                "resident_hit_rate": round(hits / rows, 6) if rows else 0.0}

    # ------------------------------------------------------------ requests

    async def submit(self, prompt_ids: list[int], params: SamplingParams, eos_token_id=None) -> tuple[str, asyncio.Queue]:
        """Adds a request; returns its id and a queue of transformers ``GenerationOutput``s (one per new token, the
        last one finished). Raises AdmissionError when the limits are reached."""
        request_id = f"kt-{uuid.uuid4().hex}"
        q: asyncio.Queue = asyncio.Queue()
        req = _Request(request_id, len(prompt_ids), q)
        with self._lock:
            if len(self._requests) >= self.config.max_requests:
                raise AdmissionError(f"{len(self._requests)} requests in flight, the server's limit "
                                     f"(--max-requests {self.config.max_requests}); retry later")
            if self._requests and self.queued_tokens + len(prompt_ids) > self.config.max_queued_tokens:
                raise AdmissionError(f"{self.queued_tokens} prompt tokens already wait for prefill; this request's "
                                     f"{len(prompt_ids)} would pass the limit (--max-queued-tokens "
                                     f"{self.config.max_queued_tokens}); retry later")
            self._requests[request_id] = req
            self.queued_tokens += len(prompt_ids)

        def deliver(output) -> None:  # on this loop (transformers calls it through call_soon_threadsafe)
            self._note_progress(req, output)
            q.put_nowait(output)
            if len(output.generated_tokens) == 1:
                self._first_output_delivered()

        self.manager.register_result_handler(request_id, deliver)
        if params.temperature > 0:
            seed = params.seed if params.seed is not None else secrets.randbits(62)
            kwargs = dict(temperature=float(params.temperature), top_p=float(params.top_p),
                          seed=int(seed) or 1)  # seed 0 would mean greedy
        else:
            kwargs = dict(temperature=1.0, top_p=1.0, seed=0)
        try:
            rid = self.manager.add_request(list(prompt_ids), request_id=request_id,
                                           max_new_tokens=params.max_new_tokens, streaming=True,
                                           eos_token_id=eos_token_id, **kwargs)
        except BaseException:
            self._forget(req)
            raise
        if rid is None:
            self._forget(req)
            raise AdmissionError("the generation loop is not accepting requests (stopping or failed)")
        return request_id, q

    def _note_progress(self, req: _Request, output) -> None:
        with self._lock:
            if not req.prefilled and (output.generated_tokens or output.is_finished()):
                req.prefilled = True
                self.queued_tokens -= req.prompt_len
        if output.is_finished():
            self.requests_done += 1
            self._forget(req)

    def _forget(self, req: _Request) -> None:
        with self._lock:
            if self._requests.pop(req.request_id, None) is not None and not req.prefilled:
                req.prefilled = True
                self.queued_tokens -= req.prompt_len
            req.finished = True
        with self.manager.output_router._lock:
            self.manager.output_router.result_handlers.pop(req.request_id, None)

    def drain_orphan_outputs(self) -> int:
        """Drops outputs the manager produced for requests already forgotten (cancelled between two steps: their
        handler is gone, so transformers queues them on its shared output queue, which nothing else reads)."""
        import queue

        dropped = 0
        while True:
            try:
                self.manager.output_router.output_queue.get_nowait()
                dropped += 1
            except queue.Empty:
                return dropped

    def cancel(self, request_id: str) -> None:
        """Stops a request (client gone, stop string met): its KV pages are freed at the next step."""
        with self._lock:
            req = self._requests.get(request_id)
        if req is None or req.finished:
            return
        self.manager.cancel_request(request_id)
        self.requests_cancelled += 1
        self._forget(req)
