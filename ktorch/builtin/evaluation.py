"""Perplexity of a causal LM on documents: the built-in model's quality measure.

The held-out text (``eval.txt`` beside this file) holds documents separated by ``<|endoftext|>`` and a newline.
``token_stream`` turns documents into one token stream the way training packs them (an end-of-text id before
the first document and after every document), and ``perplexity`` scores it in consecutive windows: each
window of ``seq_len`` + 1 tokens starts where the previous one ended, so every token but the first is
predicted once, with at most ``seq_len`` tokens of context (none across window boundaries).

This module imports only torch: ``scripts/train_builtin.py`` loads it by path on machines where the ktorch
extension is not built.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Union

import torch
import torch.nn.functional as F

EOT = "<|endoftext|>"


def read_documents(path: Union[str, Path]) -> list[str]:
    """The documents of a corpus file (``doc<|endoftext|>\\n`` repeated), in file order."""
    text = Path(path).read_text(encoding="utf-8")
    return [d for d in text.split(EOT + "\n") if d]


def token_stream(tokenizer, documents: list[str]) -> torch.Tensor:
    """[N] int64: ``<|endoftext|>`` doc0 ``<|endoftext|>`` doc1 ... ``<|endoftext|>``.

    ``tokenizer``: a ``tokenizers.Tokenizer`` or a transformers fast tokenizer (its ``backend_tokenizer`` is used).
    """
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    eot = backend.token_to_id(EOT)
    if eot is None:
        raise ValueError(f"token_stream: the tokenizer has no {EOT} token")
    ids = [eot]
    for encoding in backend.encode_batch(documents, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int64)


@torch.no_grad()
def perplexity(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    seq_len: int = 512,
    batch_size: int = 8,
    n_bytes: int | None = None,
) -> dict[str, float]:
    """Mean next-token negative log-likelihood of ``tokens`` ([N] int64) under ``model``, scored in windows.

    Returns ``{"loss": nats per token, "perplexity": exp(loss), "tokens": predicted tokens}`` and, when
    ``n_bytes`` (the UTF-8 size of the scored text) is given, ``"bits_per_byte"``, which does not depend on
    the tokenizer. Inputs go to the device of the model's input embeddings; the model runs in its own dtype
    (or the caller's autocast) and log-probabilities are taken in fp32.
    """
    if tokens.dim() != 1 or tokens.numel() < 2:
        raise ValueError(f"perplexity: tokens must be 1-D with at least 2 ids, got shape {tuple(tokens.shape)}")
    device = model.get_input_embeddings().weight.device
    was_training = model.training
    model.eval()
    n_windows = (tokens.numel() - 1 + seq_len - 1) // seq_len
    starts = [i * seq_len for i in range(n_windows)]
    full = [s for s in starts if s + seq_len + 1 <= tokens.numel()]
    last = [s for s in starts if s + seq_len + 1 > tokens.numel()]
    total_nll, total_tokens = 0.0, 0
    for i in range(0, len(full), batch_size):
        batch = torch.stack([tokens[s : s + seq_len + 1] for s in full[i : i + batch_size]]).to(device)
        total_nll += _sum_nll(model, batch)
        total_tokens += batch.shape[0] * seq_len
    for s in last:  # the shorter tail window
        batch = tokens[s:].unsqueeze(0).to(device)
        total_nll += _sum_nll(model, batch)
        total_tokens += batch.shape[1] - 1
    model.train(was_training)
    loss = total_nll / total_tokens
    result = {"loss": loss, "perplexity": math.exp(loss), "tokens": total_tokens}
    if n_bytes is not None:
        result["bits_per_byte"] = total_nll / math.log(2) / n_bytes
    return result


def _sum_nll(model: torch.nn.Module, batch: torch.Tensor) -> float:
    """Sum over batch [B, L+1] of -log p(batch[:, t+1] | batch[:, :t+1])."""
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()


def documents_bytes(documents: list[str]) -> int:
    """UTF-8 size of the documents, separators excluded (the denominator of bits per byte)."""
    return sum(len(d.encode("utf-8")) for d in documents)
