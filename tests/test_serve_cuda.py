"""ktorch serve on a GPU: decode-sized steps replay CUDA graphs (ktorch's bucketed plan, ktorch/serve/engine.py).

In-process ``ServeEngine`` runs of the built-in model in fp32 (no HTTP client needed, so this file runs where the
``openai`` package is not installed); the CPU side of the plan (which steps are padded to which bucket, padding rows
kept out of the experts, the warm-up's forwards) is tested in tests/test_serve.py."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

import ktorch
from ktorch.serve import EngineConfig, ServeEngine
from ktorch.serve.engine import check_transformers
from serving import generated, run_engine

try:
    check_transformers()
except RuntimeError as e:
    pytest.skip(str(e), allow_module_level=True)

PAGE = 16

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _cuda_run(model, prompts, n, **config):
    engine = ServeEngine(model, model.generation_config.eos_token_id, 0,
                         EngineConfig(page_size=PAGE, num_blocks=256, max_batch_tokens=128, step_stats=True, **config))
    return run_engine(engine, prompts, n, timeout=300), engine


@needs_cuda
def test_cuda_decode_steps_replay_graphs_and_equal_eager():
    """On a GPU the default engine replays a captured graph for every decode-sized step (one replay a step, at the
    step's bucket), its tokens equal the eager engine's for a batch, and each replayed step's record reads the
    experts it routed (the padding rows' -1 ids are not counted as experts)."""
    from ktorch.serve.engine import GRAPH_TOKEN_BUCKETS, step_bucket

    model, _ = ktorch.load("builtin", device="cuda", dtype=torch.float32, progress=False)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 4096) for _ in range(rng.randint(5, 40))] for _ in range(6)]
    eager, e_engine = _cuda_run(model, prompts, 12, cuda_graphs=False)
    graphed, g_engine = _cuda_run(model, prompts, 12)
    assert e_engine.graph_plan == "off" and g_engine.graph_plan == "ktorch"
    assert graphed == eager
    assert e_engine.graph_replays == 0 and all(s.mode == "eager" for s in e_engine.steps)
    assert g_engine.graph_captures >= len(GRAPH_TOKEN_BUCKETS) - 1  # the warm-up's (128-token batches: not 256)
    assert g_engine.stats()["experts_captured_submits"] > 0  # the CPU experts run from host functions in the graphs
    steps = list(g_engine.steps)
    assert g_engine.forwards == len(steps) and g_engine.tokens_computed == e_engine.tokens_computed
    decode = [s for s in steps if s.tokens <= len(prompts)]
    assert decode and all(s.mode == "replay" for s in decode), [(s.tokens, s.mode) for s in steps]
    assert g_engine.graph_replays == sum(s.mode == "replay" for s in steps)
    assert all(0 < s.distinct_experts for s in decode)
    # a lone stream's steps: bucket 1, at most top_k experts per layer read
    _, lone = _cuda_run(model, prompts[:1], 8)
    top_k = model.config.num_experts_per_tok
    layers = sum(1 for m in model.modules() if getattr(m, "kt_w13", None) is not None)
    for s in lone.steps:
        if s.tokens == 1:
            assert s.mode == "replay" and 0 < s.distinct_experts <= top_k * layers
    assert step_bucket(1, 50, 128, 1 << 20)[0] == 1


@needs_cuda
def test_cuda_shared_prefix_computes_only_the_suffix_under_graphs():
    """A prompt sharing a cached prefix computes only the suffix on the GPU too (its step is graphed), with the
    tokens of an uncached run."""
    model, _ = ktorch.load("builtin", device="cuda", dtype=torch.float32, progress=False)
    rng = random.Random(6)
    prefix = [rng.randrange(3, 4096) for _ in range(20 * PAGE + 3)]
    second = prefix + [rng.randrange(3, 4096) for _ in range(7)]
    engine = ServeEngine(model, model.generation_config.eos_token_id, 0,
                         EngineConfig(page_size=PAGE, num_blocks=256, max_batch_tokens=128))

    async def go():
        await generated(engine, prefix, 1, 300)
        before, replays = engine.tokens_computed, engine.graph_replays
        out = await generated(engine, second, 4, 300)
        return out, engine.tokens_computed - before, engine.graph_replays - replays

    engine.start()
    try:
        out, computed, replays = asyncio.run(go())
    finally:
        engine.stop()
    assert computed == len(second) - 20 * PAGE + len(out) - 1 and replays == 4
    with torch.inference_mode():
        ref = model.generate(torch.tensor([second], device="cuda"), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out == ref[0, len(second):].tolist()
