"""benchmarks/bench_gguf_perplexity.py's llama.cpp comparison: ktorch's side scored as llama-perplexity scores (chunks
of 512, second halves, BOS first) and llama-perplexity's log read back (its final estimate, or the running estimate
after its last chunk when the logger lost the final line)."""

from __future__ import annotations

import math
import stat

import pytest
import torch

from conftest import load_benchmark

bench = load_benchmark("bench_gguf_perplexity")


class _Uniform(torch.nn.Module):
    """Logits all zero: every next token has probability 1/V, so any scoring gives perplexity V."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.seen = []

    def forward(self, ids):
        self.seen.append(ids.clone())
        return type("Out", (), {"logits": torch.zeros(*ids.shape, self.vocab)})()


class _Tokenizer:
    bos_token_id = 7

    def __call__(self, text):
        return type("Enc", (), {"input_ids": [7] + [ord(c) % 50 + 10 for c in text]})()


def test_llama_style_scoring_counts_second_halves_and_puts_bos_first():
    model = _Uniform(vocab=64)
    text = "x" * (3 * 512 + 100)  # 1 BOS + 1636 ids: 3 whole chunks, the tail dropped as llama.cpp drops it
    ppl, chunks = bench.llama_style_perplexity(model, _Tokenizer(), text, batch=2)
    assert chunks == 3 and ppl == pytest.approx(64, rel=1e-6)
    batches = torch.cat(model.seen)
    assert batches.shape == (3, 512) and (batches[:, 0] == 7).all()


def test_llama_style_scoring_matches_the_second_half_nll():
    torch.manual_seed(0)
    vocab = 32

    class Bigram(torch.nn.Module):  # logits depend on the current token only: the expected NLL is computable
        def __init__(self):
            super().__init__()
            self.table = torch.randn(vocab, vocab)

        def forward(self, ids):
            return type("Out", (), {"logits": self.table[ids]})()

    class Tok:
        bos_token_id = None

        def __call__(self, text):
            return type("Enc", (), {"input_ids": [int(c) for c in text.split() if c.isdigit()]})()

    ids = torch.randint(0, vocab, (2 * 512 + 3,))
    model = Bigram()
    ppl, chunks = bench.llama_style_perplexity(model, Tok(), " ".join(map(str, ids.tolist())))
    logp = torch.log_softmax(model.table.double(), -1)
    nll = [-float(logp[ids[c * 512 + j], ids[c * 512 + j + 1]]) for c in range(2) for j in range(256, 511)]
    assert chunks == 2 and ppl == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5)


@pytest.mark.parametrize("final_line", [True, False])
def test_llama_perplexity_log_is_read(tmp_path, final_line):
    fake = tmp_path / "llama-perplexity"
    lines = ["perplexity: calculating perplexity over 3 chunks, n_ctx=512, batch_size=512, n_seq=1",
             "[1]20.5,[2]19.25,[3]18.125,"]
    if final_line:
        lines.append("Final estimate: PPL = 18.1250 +/- 0.5")
    fake.write_text("#!/bin/sh\n" + "".join(f"echo '{line}'\n" for line in lines))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    ppl, chunks = bench.llama_cpp_perplexity(str(fake), tmp_path / "model.gguf", tmp_path / "text.txt")
    assert ppl == 18.125 and chunks == "3"


def test_llama_perplexity_without_an_estimate_is_an_error(tmp_path):
    fake = tmp_path / "llama-perplexity"
    fake.write_text("#!/bin/sh\necho 'error: no model'\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(RuntimeError, match="no final estimate .rc 1.: error: no model"):
        bench.llama_cpp_perplexity(str(fake), tmp_path / "model.gguf", tmp_path / "text.txt")
