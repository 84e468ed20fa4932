"""ktorch's built-in model: a small trained Qwen3-MoE language model that ships with the package.

It exists so that quality effects (int8/int4 experts, deferred experts, compile passes) can be measured
on real trained weights without a download, and so that ``ktorch generate --model builtin`` runs on a
fresh machine. Architecture, corpus, training and perplexity: docs/builtin_model.md.

Files here: config.json, generation_config.json, model.safetensors (bf16), tokenizer.json,
tokenizer_config.json, chat_template.jinja (a transformers checkpoint folder: ``from_pretrained(BUILTIN_PATH)``
works), eval.txt (held-out text, never trained on), train_metrics.json (how the weights were made and
what they score), evaluation.py (perplexity).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch

from ktorch.builtin.evaluation import documents_bytes, perplexity, read_documents, token_stream

BUILTIN_PATH = Path(__file__).resolve().parent
EVAL_TEXT_PATH = BUILTIN_PATH / "eval.txt"

__all__ = ["BUILTIN_PATH", "EVAL_TEXT_PATH", "eval_perplexity", "load_builtin", "perplexity", "read_documents", "token_stream"]


def load_builtin(
    device: Union[str, torch.device] = "cpu",
    dtype: Optional[torch.dtype] = None,
    experts_implementation: Optional[str] = None,
):
    """(model, tokenizer): the built-in Qwen3MoeForCausalLM in eval mode on ``device``, and its tokenizer.

    ``dtype``: default float32 on the CPU (exact: the stored bf16 weights widen losslessly), bfloat16 on
    other devices. ``experts_implementation``: transformers' name ("eager", "grouped_mm", "ktorch", ...);
    default: what transformers picks. For hybrid placement call ``ktorch.prepare(model, ...)`` afterwards.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(device)
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    kwargs = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    model = AutoModelForCausalLM.from_pretrained(str(BUILTIN_PATH), dtype=dtype, **kwargs).to(device)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(BUILTIN_PATH))
    return model, tokenizer


def eval_perplexity(
    model: torch.nn.Module,
    tokenizer,
    max_tokens: Optional[int] = None,
    seq_len: int = 512,
    batch_size: int = 8,
) -> dict[str, float]:
    """Perplexity of ``model`` on the held-out text (its first ``max_tokens`` tokens, or all of it).

    Returns ``{"loss", "perplexity", "tokens"}`` and, for the whole text, ``"bits_per_byte"``. The
    whole text (about 51 k tokens) scores in a few seconds on two CPU cores; docs/builtin_model.md gives
    the reference figures.
    """
    documents = read_documents(EVAL_TEXT_PATH)
    tokens = token_stream(tokenizer, documents)
    n_bytes = documents_bytes(documents)
    if max_tokens is not None and max_tokens < tokens.numel():
        tokens, n_bytes = tokens[:max_tokens], None
    return perplexity(model, tokens, seq_len=seq_len, batch_size=batch_size, n_bytes=n_bytes)
