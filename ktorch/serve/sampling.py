"""Per-request sampling for continuous batching: greedy, or seeded sampling that does not depend on the batch.

transformers' continuous-batching manager samples every row of a step with one ``do_sample`` switch and one random
generator, so a greedy request could not share a step with a sampling one, and a request's ``seed`` would draw
different tokens depending on what else ran beside it. ktorch runs the manager with argmax selection and adds one
logits processor last (after the per-request temperature and top-p warpers): for a sampling row it adds Gumbel noise
drawn from a counter-based hash of (the request's seed, the token's position, the vocabulary index), so that
``argmax(logits / T + G)`` is a sample of ``softmax(logits / T)`` (top-p filtered) that is the same whatever batch the
row is in; for a greedy row (key 0) it leaves the scores as they are, so the argmax is exactly the greedy token. The
processor is tensor code only (no Python per row at call time), so it can run under CUDA graphs.
"""

from __future__ import annotations

import torch
from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor

# splitmix64 constants (Steele et al., "Fast splittable pseudorandom number generators"), as signed int64
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 31)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_key(seed: int, position: int) -> int:
    """The nonzero int32 key of the token at ``position`` of a request sampled with ``seed`` (0 means greedy)."""
    key = _splitmix64(_splitmix64(seed & _MASK64) ^ position) & 0x7FFFFFFF
    return key or 1


def _shift_right_logical(x: torch.Tensor, n: int) -> torch.Tensor:
    return (x >> n) & ((1 << (64 - n)) - 1)  # torch's >> on int64 is arithmetic


def gumbel_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise [B, V] float32, a pure function of keys [B] (int64) and the column index."""
    v = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    x = keys[:, None] * _GOLDEN + v[None, :] * 0x2545F491  # distinct per (key, column); int64 wraps
    x = (x ^ _shift_right_logical(x, 30)) * _MIX1
    x = (x ^ _shift_right_logical(x, 27)) * _MIX2
    x = x ^ _shift_right_logical(x, 31)
    u = (_shift_right_logical(x, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # uniform in (0, 1)
    return -torch.log(-torch.log(u))


class SeededSampling(ContinuousBatchingLogitsProcessor):
    """The last processor of ktorch's continuous batching: Gumbel-max sampling for rows with a nonzero key.

    A request passes ``logit_processor_kwargs={"seed": s}`` with s > 0 to sample (s = 0: greedy)."""

    supported_kwargs = {"seed": int}
    ignored_kwargs: tuple[str, ...] = ()

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)

    def prepare_tensor_args(self, requests_with_new_token) -> torch.Tensor:
        keys = []
        for request in requests_with_new_token:
            state = request.state
            seed = state.logit_processor_kwargs.get("seed", 0)
            # the position of the token drawn: unchanged when a preempted request re-prefills its generated tokens
            keys.append(0 if seed == 0 else sample_key(seed, len(state.initial_tokens) + len(state.generated_tokens)))
        return torch.tensor(keys, dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        keys = tensor_arg[: scores.size(0)].to(torch.int64)
        noise = gumbel_noise(keys, scores.size(-1)).to(scores.device)
        return torch.where((keys != 0)[:, None], scores + noise, scores)
