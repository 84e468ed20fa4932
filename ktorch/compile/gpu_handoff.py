"""The GPU's side of a captured CPU experts call with no host function: a doorbell it rings, a done word it waits for.

Under CUDA graphs a CPU experts call used to cost the stream a host function to start it and another (or the
same one) to join it: CUDA runs a host function ~55 us after the work before it has landed, and the stream cannot
go on until it returns (docs/architecture.md, "GPU handoff"). Here both are small Triton kernels on the stream:

    ring(counter, seq, words)        after the input copies: counter[0] += 1 (one int64 a device, so numbers grow
                                     across tasks in stream order), seq[0] = counter[0] (the task's number, device
                                     memory), words[0] = it (the doorbell, pinned host memory). The C++ worker
                                     (runtime/host_tasks.cpp), spinning between calls, starts the call whose
                                     doorbell moved, lowest number first.
    wait(seq, words, part, error)    before the result's H2D copy: spins on volatile loads of words[part] (1: the
                                     call's done number, 2: a split call's deferred part), which the worker writes
                                     with release semantics once the pinned output is complete, until it reaches
                                     seq[0]. Bounded: after ``limit_ns`` on the GPU's global timer (LIMIT_NS, 2 s)
                                     it gives up and writes seq[0] into error[0] (pinned), which the host checks
                                     after the step; the result is then never used silently
                                     (``ExpertsRuntime.check_handoff``).

The result itself is read by the existing H2D copy node (a copy engine read of host memory as it is then), never
by kernel loads that could hit stale L2 lines. The ring kernel's doorbell store writes through to system memory
(``.wt``) and is fenced at system scope (``membar.sys``); the copies before it on the stream have completed when it
runs, so a moved doorbell means the inputs are in memory.

Triton's launcher takes a pinned CPU tensor as a pointer argument (it asks CUDA for the pointer's device address:
with unified addressing the host address itself) and refuses a pageable one ("cannot be accessed from Triton").
Under Triton's interpreter (TRITON_INTERPRET=1) the kernels run on CPU tensors: the tests play the GPU that way.
"""

from __future__ import annotations

import torch

from ktorch.ops.triton_experts import interpreting, triton

# The wait's bound: 2 s on the GPU's global timer (%globaltimer), far past any decode call (hundreds of
# microseconds) or prefill-sized call of a captured graph, short enough that a stuck worker is an error and not a
# hang. Where the timer is missing (Triton's interpreter, a Triton without triton.language.extra.cuda.globaltimer)
# the bound is limit_ns / 1000 loads of the done word (a load of pinned host memory crosses PCIe, ~1 us). A
# constant: the tests' timeout path passes a small limit.
LIMIT_NS = 2_000_000_000


def available() -> bool:
    """Whether the kernels can run: Triton with a CUDA GPU, or Triton's interpreter (CPU tensors, tests)."""
    return triton is not None and (torch.cuda.is_available() or interpreting())


if triton is not None:
    import triton.language as tl

    try:
        from triton.language.extra.cuda import globaltimer as _globaltimer
    except ImportError:  # an older Triton: the bound counts loads
        _globaltimer = None

    @triton.jit
    def _ring_kernel(counter_ptr, seq_ptr, words_ptr, FENCE: tl.constexpr):
        s = tl.load(counter_ptr) + 1
        tl.store(counter_ptr, s)
        tl.store(seq_ptr, s)
        # the doorbell (pinned host memory), after the inputs (stream order): written through to system memory
        # and fenced at system scope, so that the spinning worker sees it now rather than when the kernel ends
        tl.store(words_ptr, s, cache_modifier=".wt")
        if FENCE:
            tl.inline_asm_elementwise("membar.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _wait_kernel(seq_ptr, words_ptr, error_ptr, limit, PART: tl.constexpr, CLOCK: tl.constexpr):
        # limit: nanoseconds on the global timer (CLOCK), else loads
        want = tl.load(seq_ptr)
        done = tl.load(words_ptr + PART, volatile=True)
        if CLOCK:
            start = _globaltimer()
            elapsed = start - start
            while (done < want) & (elapsed < limit):
                done = tl.load(words_ptr + PART, volatile=True)
                elapsed = _globaltimer() - start
        else:
            polls = limit - limit
            while (done < want) & (polls < limit):
                done = tl.load(words_ptr + PART, volatile=True)
                polls += 1
        if done < want:
            tl.store(error_ptr, want, cache_modifier=".wt")  # the host's check after the step raises


def ring(counter: torch.Tensor, seq: torch.Tensor, words: torch.Tensor) -> None:
    """Enqueues the doorbell kernel on the current stream (captured if it is capturing). ``counter``, ``seq``:
    int64 [1] on the GPU (the device's counter, the task's number); ``words``: the task's int64 [3] handoff words,
    pinned (CPU tensors throughout under the interpreter)."""
    _ring_kernel[(1,)](counter, seq, words, FENCE=not interpreting(), num_warps=1)


def has_clock() -> bool:
    """Whether the wait is bounded by the GPU's global timer (else by a count of loads)."""
    return triton is not None and _globaltimer is not None and not interpreting()


def wait(seq: torch.Tensor, words: torch.Tensor, part: int, error: torch.Tensor, limit_ns: int = LIMIT_NS) -> None:
    """Enqueues the wait kernel: the stream goes on once ``words[part]`` (1: done, 2: done_later) >= ``seq[0]``,
    or after ``limit_ns`` (``limit_ns / 1000`` loads without the timer) with ``error[0]`` (int64 [1], pinned) set
    to ``seq[0]``."""
    if part not in (1, 2):
        raise ValueError(f"gpu_handoff.wait: part must be 1 (done) or 2 (done_later), got {part}")
    if limit_ns < 1000:
        raise ValueError(f"gpu_handoff.wait: limit_ns must be >= 1000, got {limit_ns}")
    clock = has_clock()
    _wait_kernel[(1,)](seq, words, error, limit_ns if clock else limit_ns // 1000, PART=part, CLOCK=clock,
                       num_warps=1)


def new_words() -> torch.Tensor:
    """A task's handoff words: int64 [3] (doorbell, done, done_later), zeros, pinned where CUDA is. Plain tensors even
    under torch.inference_mode (the worker updates them from its thread)."""
    with torch.inference_mode(False):
        return torch.zeros(3, dtype=torch.int64, pin_memory=torch.cuda.is_available() and not interpreting())
