"""ktorch serve on a GPU: decode-sized steps replay CUDA graphs (ktorch's bucketed plan, ktorch/serve/engine.py).

In-process ``ServeEngine`` runs of the built-in model in fp32 (no HTTP client needed, so this file runs where the
``openai`` package is not installed); the CPU side of the plan (which steps are padded to which bucket, padding rows
kept out of the experts, the warm-up's forwards) is tested in tests/test_serve.py."""

from __future__ import annotations

import asyncio
import gc
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

    model, _ = ktorch.load("builtin", device="cuda", dtype=torch.float32, progress=False, stream_experts="off",
                           gpu_memory="off")
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
    model, _ = ktorch.load("builtin", device="cuda", dtype=torch.float32, progress=False, stream_experts="off",
                           gpu_memory="off")
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


@needs_cuda
def test_cuda_compiled_captures_compile_once_per_token_bucket():
    """The graphed steps' layers are compiled (``compiled_step_layers``) during the warm-up, once per token bucket:
    serving a prompt whose prefill chunks (graphed, 128 tokens) meet cache-reads buckets the warm-up left out
    captures new graphs and compiles nothing more; the tokens equal the eager engine's, and while graphs are
    captured the model runs the eager-wrapped attention, put back after."""
    from torch._dynamo.utils import counters

    from ktorch.generation import decoder_layers

    model, _ = ktorch.load("builtin", device="cuda", dtype=torch.float32, progress=False, stream_experts="off",
                           gpu_memory="off")
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 4096) for _ in range(700)], [rng.randrange(3, 4096) for _ in range(9)]]
    eager, _ = _cuda_run(model, prompts, 10, cuda_graphs=False)
    engine = ServeEngine(model, model.generation_config.eos_token_id, 0,
                         EngineConfig(page_size=PAGE, num_blocks=256, max_batch_tokens=128))
    engine.start()
    try:
        warm_captures, warm_graphs = engine.graph_captures, counters["stats"]["unique_graphs"]
        async def both():  # gather() needs the running loop: build it inside the coroutine
            return await asyncio.wait_for(asyncio.gather(*[generated(engine, p, 10, 300) for p in prompts]), 600)

        graphed = asyncio.run(both())
    finally:
        engine.stop()
    assert graphed == eager
    assert engine.graph_captures > warm_captures  # (128, 512), (128, 1024): the 700-token prompt's chunks
    assert counters["stats"]["unique_graphs"] == warm_graphs > 0
    assert model.config._attn_implementation == "sdpa"
    assert not any("forward" in layer.__dict__ for layer in decoder_layers(model))


@needs_cuda
def test_cuda_default_residents_serve_under_graphs():
    """ktorch.load's default on a GPU (--gpu-memory auto): the built-in model's experts all fit, so every layer's
    experts are resident; graphed steps give the eager engine's tokens, no CPU experts call is made, captured or
    not, and /v1/stats reports every real routed slot on a resident."""
    from ktorch.compile.experts_runtime import RUNTIME

    model, _ = ktorch.load("builtin", device="cuda", dtype=torch.float32, progress=False)
    plan = model.kt_gpu_memory
    assert plan is not None and plan.resident_per_layer == model.config.num_experts
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 4096) for _ in range(rng.randint(5, 40))] for _ in range(4)]
    submits, captured = RUNTIME.stats["submits"], RUNTIME.stats["captured_submits"]
    eager, _ = _cuda_run(model, prompts, 10, cuda_graphs=False)
    graphed, engine = _cuda_run(model, prompts, 10)
    assert graphed == eager and engine.graph_replays > 0
    assert (RUNTIME.stats["submits"], RUNTIME.stats["captured_submits"]) == (submits, captured)
    stats = engine.stats()
    assert stats["resident_experts_per_layer"] == model.config.num_experts
    assert stats["resident_rows"] > 0 and stats["resident_hit_rate"] == 1.0


@needs_cuda
def test_cuda_serve_reserves_the_kv_pool_before_residents(monkeypatch, capsys):
    """ktorch serve on a GPU with the default budget: the plan's reserve is the KV pool's bytes (kv_pool_for), the
    pool the engine gets is that one (--kv-pages given) or grown by what the residents left (default), the plan and
    the pool are printed at start-up, and transformers allocates the planned pool (no memory error) and serves."""
    import ktorch.serve
    from ktorch.cli import main
    from ktorch.serve.engine import KV_POOL_TOKENS, kv_pool_for

    runs = []
    monkeypatch.setattr(ktorch.serve, "run_server", lambda model, tok, name, **k: runs.append((model, k["config"])))
    assert main(["serve", "--model", "builtin", "--dtype", "fp32", "--kv-pages", "512",
                 "--max-batch-tokens", "128"]) == 0
    err = capsys.readouterr().err
    model, config = runs[-1]
    plan = model.kt_gpu_memory
    assert config.num_blocks == 512 and config.max_batch_tokens == 128 and config.max_memory_percent == 1.0
    assert plan.reserve == kv_pool_for(model.config, model.dtype, config).nbytes and plan.used <= plan.budget
    assert "GPU memory: budget" in err and "KV pool 512 pages of 16 tokens" in err
    out = run_engine(ServeEngine(model, model.generation_config.eos_token_id, 0, config), [[5, 6, 7, 8]], 4,
                     timeout=300)
    assert len(out[0]) == 4
    del model, runs[:]
    gc.collect()
    torch.cuda.empty_cache()
    assert main(["serve", "--model", "builtin", "--dtype", "fp32"]) == 0
    model, config = runs[-1]
    plan = model.kt_gpu_memory
    asked = kv_pool_for(model.config, model.dtype, ktorch.serve.EngineConfig())
    assert plan.reserve == asked.nbytes and asked.tokens == KV_POOL_TOKENS
    assert config.num_blocks == asked.grown_by(plan.budget - plan.used).num_blocks >= asked.num_blocks
    assert "KV pool" in capsys.readouterr().err
