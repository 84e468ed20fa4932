"""The built-in model (ktorch/builtin): committed files, architecture, generation, perplexity, held-out text.

The perplexity test recomputes the figure that scripts/train_builtin.py recorded in train_metrics.json for the
first tokens of the held-out text, so it checks that the committed weights are the ones the metrics describe
and that they load and run the same way here.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

import ktorch
from ktorch.builtin import BUILTIN_PATH, EVAL_TEXT_PATH, eval_perplexity, load_builtin, read_documents

REPO = Path(__file__).resolve().parent.parent
METRICS = json.loads((BUILTIN_PATH / "train_metrics.json").read_text())
SLICE = METRICS["eval_slice"]
# Far below the vocabulary size (4096, a uniform guess); the committed weights score well under it
# (train_metrics.json, docs/builtin_model.md).
PERPLEXITY_BOUND = 500.0


@pytest.fixture(scope="module")
def builtin():
    return load_builtin()


def test_committed_files_and_sizes():
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "eval.txt", "train_metrics.json"):
        assert (BUILTIN_PATH / name).is_file(), name
    assert (BUILTIN_PATH / "model.safetensors").stat().st_size <= 20 * 1000**2
    assert EVAL_TEXT_PATH.stat().st_size <= 200 * 1000


def test_config_is_qwen3_moe(builtin):
    model, tokenizer = builtin
    config = model.config
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and config.model_type == "qwen3_moe"
    assert 4 <= config.num_hidden_layers <= 6
    assert 16 <= config.num_experts <= 32 and config.num_experts_per_tok == 4
    assert config.hidden_size % 32 == 0 and config.moe_intermediate_size % 32 == 0  # kt.fused_moe packing
    assert config.mlp_only_layers == [] and config.decoder_sparse_step == 1  # every layer is MoE
    assert config.vocab_size == len(tokenizer)
    assert model.dtype == torch.float32 and model.device.type == "cpu"


def test_tokenizer_bos_eos_and_chat_template(builtin):
    _, tokenizer = builtin
    ids = tokenizer("Hello, world.").input_ids
    assert ids[0] == tokenizer.bos_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Hello, world."
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi."}], add_generation_prompt=True, tokenize=False)
    assert text == "<|endoftext|><|im_start|>user\nHi.<|im_end|>\n<|im_start|>assistant\n"


def test_greedy_generation_is_deterministic_and_nonempty(builtin):
    model, tokenizer = builtin
    ids = tokenizer("The meaning of life is", return_tensors="pt").input_ids
    runs = [model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    new = runs[0][0, ids.shape[1]:]
    assert new.numel() > 0
    assert tokenizer.decode(new, skip_special_tokens=True).strip()


def test_perplexity_on_held_out_slice(builtin):
    model, tokenizer = builtin
    result = eval_perplexity(model, tokenizer, max_tokens=SLICE["tokens"], seq_len=SLICE["seq_len"])
    assert result["tokens"] == SLICE["tokens"] - 1
    assert math.isfinite(result["perplexity"]) and result["perplexity"] < PERPLEXITY_BOUND
    assert result["perplexity"] == pytest.approx(SLICE["perplexity"], rel=0.01), (
        f"recomputed {result['perplexity']:.3f}, train_metrics.json says {SLICE['perplexity']}"
    )


def test_recorded_perplexity_is_below_bound():
    assert math.isfinite(METRICS["eval"]["perplexity"]) and METRICS["eval"]["perplexity"] < PERPLEXITY_BOUND


@pytest.mark.parametrize("experts_dtype, max_increase", [("bf16", 0.01), ("int8", 0.03)])
def test_prepared_experts_keep_perplexity(builtin, experts_dtype, max_increase):
    """kt.fused_moe on packed experts scores the held-out slice like transformers' own experts."""
    model, tokenizer = builtin
    reference = eval_perplexity(model, tokenizer, max_tokens=SLICE["tokens"], seq_len=SLICE["seq_len"])["perplexity"]
    prepared = ktorch.prepare(copy.deepcopy(model), device="cpu", experts_dtype=experts_dtype)
    got = eval_perplexity(prepared, tokenizer, max_tokens=SLICE["tokens"], seq_len=SLICE["seq_len"])["perplexity"]
    assert abs(got / reference - 1) < max_increase, f"{experts_dtype}: {got:.3f} vs {reference:.3f}"


def test_eval_text_is_the_held_out_split():
    """Every held-out document hashes to the eval split of scripts/build_corpus.py, so none was trained on."""
    spec = importlib.util.spec_from_file_location("build_corpus", REPO / "scripts" / "build_corpus.py")
    build_corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_corpus)
    documents = read_documents(EVAL_TEXT_PATH)
    assert len(documents) > 100
    assert {build_corpus.split_of(d) for d in documents} == {"eval"}
