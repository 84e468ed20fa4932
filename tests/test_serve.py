"""ktorch serve: the OpenAI-compatible server on the built-in model, driven by the ``openai`` client.

One server (``python -m ktorch.cli serve``, a subprocess on 127.0.0.1 and a free port) serves the module's tests;
engine-level tests run ``ServeEngine`` in-process. Greedy outputs are checked against ``model.generate`` and against
the same prompt run alone; every loop is bounded in count and time, and only loopback addresses are used.

The model runs in fp32 here: in bf16 a batched step rounds differently from a lone one (other GEMM shapes), and a
greedy near-tie can then flip (the built-in model in bf16: 31 of 32 concurrent requests equal to their lone runs,
fp32: 32 of 32); the serving machinery itself is what these tests check."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")

import ktorch  # noqa: E402
from ktorch.serve import AdmissionError, EngineConfig, SamplingParams, ServeEngine  # noqa: E402
from serving import collect, generated, run_engine  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = "127.0.0.1"
PAGE = 16
MAX_REQUESTS = 36


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *extra: str):
        self.port = _free_port()
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ktorch.cli", "serve", "--model", "builtin", "--device", "cpu", "--host", HOST,
             "--port", str(self.port), "--dtype", "fp32", "--page-size", str(PAGE), "--kv-pages", "512", "--max-batch-tokens", "96",
             *extra], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ktorch serve exited with {self.proc.returncode}: {self.proc.stderr.read()}")
            try:
                if self.get("/health")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            self.stop()
            raise RuntimeError("ktorch serve did not answer /health within 180 s")
        self.client = openai.OpenAI(base_url=f"http://{HOST}:{self.port}/v1", api_key="unused", max_retries=0,
                                    timeout=120)

    def request(self, method: str, path: str, body: bytes | None = None, headers=None):
        conn = http.client.HTTPConnection(HOST, self.port, timeout=60)
        try:
            conn.request(method, path, body=body, headers=headers or {"Content-Type": "application/json"})
            r = conn.getresponse()
            data = r.read()
            return r.status, (json.loads(data) if data else None)
        finally:
            conn.close()

    def get(self, path: str):
        return self.request("GET", path)

    def stats(self) -> dict:
        return self.get("/v1/stats")[1]

    def wait_idle(self, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if s["requests_in_flight"] == 0 and s["kv_bytes_in_use"] == 0 and s["queued_prompt_tokens"] == 0:
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"the server did not go back to idle: {s}")
            time.sleep(0.2)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module")
def server():
    s = Server("--max-requests", str(MAX_REQUESTS))
    yield s
    errors = s.stats()["server_errors"]
    s.stop()
    assert errors == 0, s.proc.stderr.read()[-3000:]
    assert s.proc.returncode == 0, s.proc.stderr.read()[-3000:]


@pytest.fixture(scope="module")
def builtin():
    model, tokenizer = ktorch.load("builtin", dtype=torch.float32)  # as the server runs it
    return model, tokenizer


def _complete(client, prompt, max_tokens, stream=False, **kw):
    """(text, finish_reason) of one completion, streamed or not."""
    r = client.completions.create(model="builtin", prompt=prompt, max_tokens=max_tokens, stream=stream,
                                  temperature=kw.pop("temperature", 0), **kw)
    if not stream:
        return r.choices[0].text, r.choices[0].finish_reason
    text, reason = [], None
    for chunk in r:
        if chunk.choices:
            text.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
    return "".join(text), reason


def _chat(client, content, max_tokens, stream=False):
    """(text, finish_reason) of one greedy chat completion, streamed or not."""
    r = client.chat.completions.create(model="builtin", messages=[{"role": "user", "content": content}],
                                       max_tokens=max_tokens, stream=stream, temperature=0)
    if not stream:
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, reason = [], None
    for chunk in r:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            reason = chunk.choices[0].finish_reason or reason
    return "".join(text), reason


PROMPTS = ["The meaning of life is", "Once upon a time", "In the beginning there was", "The capital of France",
           "def fibonacci(n):", "My favourite food is", "Rain in the mountains", "A list of colours:",
           "The history of the", "Water boils at", "She opened the door and", "import torch\n"]


# ---------------------------------------------------------------- basics


def test_models_and_health(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == ["builtin"]
    assert server.client.models.retrieve("builtin").id == "builtin"
    status, body = server.get("/health")
    assert status == 200 and body["status"] == "ok"


def test_completion_matches_generate(server, builtin):
    """Greedy text from the server equals transformers' model.generate on the same ktorch model."""
    model, tok = builtin
    for prompt in PROMPTS[:3]:
        ids = tok(prompt).input_ids
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, pad_token_id=0)
        new = out[0, len(ids):].tolist()
        expected = tok.decode(new, skip_special_tokens=True)
        r = server.client.completions.create(model="builtin", prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == expected
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(new)
        ended_on_eos = new[-1] in (model.generation_config.eos_token_id or [])
        assert r.choices[0].finish_reason == ("stop" if ended_on_eos else "length")


def test_streamed_equals_non_streamed(server):
    c = server.client
    for prompt in PROMPTS[3:6]:
        plain = _complete(c, prompt, 20)
        assert _complete(c, prompt, 20, stream=True) == plain
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a story"}]
    r = c.chat.completions.create(model="builtin", messages=msgs, max_tokens=20, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    s = c.chat.completions.create(model="builtin", messages=msgs, max_tokens=20, temperature=0, stream=True,
                                  stream_options={"include_usage": True})
    parts, usage, roles = [], None, []
    for chunk in s:
        assert chunk.object == "chat.completion.chunk"
        if chunk.choices:
            if chunk.choices[0].delta.role:
                roles.append(chunk.choices[0].delta.role)
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert roles == ["assistant"]
    assert "".join(parts) == r.choices[0].message.content
    assert usage is not None and usage.completion_tokens == r.usage.completion_tokens
    assert usage.prompt_tokens == r.usage.prompt_tokens


def test_stop_strings(server):
    c = server.client
    full, _ = _complete(c, PROMPTS[0], 40)
    words = [w for w in full.split() if len(w) > 2]
    assert words, full
    stop = words[len(words) // 2]
    cut = full[:full.index(stop)]
    for stream in (False, True):
        text, reason = _complete(c, PROMPTS[0], 40, stream=stream, stop=[stop, "\u2603never"])
        assert (text, reason) == (cut, "stop")
    server.wait_idle()


def test_seeded_sampling_is_reproducible(server):
    c = server.client
    a = _complete(c, PROMPTS[1], 24, temperature=0.9, top_p=0.95, seed=1234)[0]
    with ThreadPoolExecutor(6) as pool:  # the same seed gives the same text whatever runs beside it
        others = [pool.submit(_complete, c, p, 24, temperature=0.9, seed=7) for p in PROMPTS[4:9]]
        b = _complete(c, PROMPTS[1], 24, temperature=0.9, top_p=0.95, seed=1234)[0]
        [f.result() for f in others]
    assert a == b
    texts = {_complete(c, PROMPTS[1], 24, temperature=1.0, seed=s)[0] for s in range(1, 6)}
    assert len(texts) > 1  # sampling does sample
    greedy = _complete(c, PROMPTS[1], 24)[0]
    assert _complete(c, PROMPTS[1], 24, temperature=0, seed=99)[0] == greedy


# ---------------------------------------------------------------- continuous batching


WORDS = "river stone light music garden winter paper engine silver forest number window table storm bridge cloud".split()


def test_32_concurrent_equal_alone(server):
    """32 concurrent greedy requests (completions and chat, streamed and not) each return exactly what the same
    request returns alone (text and finish reason): none lost, crossed or truncated. The 32 are picked, in a
    bounded loop over random prompts, so that their lone answers all differ: a crossed answer would show. The steps
    carried several sequences at once."""
    rng = random.Random(0)

    def run(job):
        prompt, n, stream, chat = job
        return (_chat if chat else _complete)(server.client, prompt, n, stream=stream)

    jobs, alone = [], []
    for attempt in range(96):
        i = len(jobs)
        chat = i % 4 >= 2
        prompt = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8))) if chat
                  else [rng.randrange(100, 4000) for _ in range(rng.randint(6, 30))])
        job = (prompt, rng.randint(8, 40), i % 2 == 1, chat)  # (prompt, max_tokens, stream, chat)
        answer = run((prompt, job[1], False, chat))
        if answer[0] not in {text for text, _ in alone}:
            jobs.append(job)
            alone.append(answer)
        if len(jobs) == 32:
            break
    assert len(jobs) == 32, f"only {len(jobs)} distinct lone answers in 96 prompts"
    before = server.stats()
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(run, jobs))
    after = server.wait_idle()
    assert together == alone
    generated = sum(n for _, n, _, _ in jobs)  # an upper bound on decode steps were they run one by one
    assert after["forwards"] - before["forwards"] < generated / 3, (before, after)


def test_one_experts_call_per_layer_and_step(builtin):
    """Each step's forward carries every active sequence's tokens: one experts call per MoE layer per forward."""
    model, tok = builtin
    experts = [m for m in model.modules() if getattr(m, "kt_w13", None) is not None]
    calls, tokens = [], []
    hooks = [m.register_forward_pre_hook(lambda mod, args, kw: calls.append(1), with_kwargs=True) for m in experts]
    hooks.append(model.register_forward_pre_hook(lambda mod, args, kw: tokens.append(kw["input_ids"].shape[-1]),
                                                 with_kwargs=True))
    engine = ServeEngine(model, model.generation_config.eos_token_id, 0,
                         EngineConfig(page_size=PAGE, num_blocks=64, max_batch_tokens=32))
    outs = run_engine(engine, [tok(p + " and so on " * 3).input_ids for p in PROMPTS[:8]], 12, hooks)
    assert all(outs)
    assert len(calls) == len(experts) * len(tokens)
    assert max(tokens) == 32  # prompts were cut into 32-token chunks sharing steps with decode tokens
    assert max(tokens) > 1 and len(tokens) < sum(len(o) for o in outs)


def test_padded_steps_leave_padding_rows_out_of_the_experts(builtin):
    """Under CUDA graphs transformers pads each step's tokens to a bucket; the padding rows must not reach the CPU
    experts (each would make kt.fused_moe read its experts). Padding forced on here (the CPU has no graphs): the
    experts see the real rows' ids and -1 on every padding row, and the tokens equal an unpadded run's."""
    model, _ = builtin
    experts = [m for m in model.modules() if getattr(m, "kt_w13", None) is not None]
    prompts = [list(range(10 + i, 30 + 3 * i)) for i in range(3)]

    def run(pad: bool):
        engine = ServeEngine(model, model.generation_config.eos_token_id, 0,
                             EngineConfig(page_size=PAGE, num_blocks=64, max_batch_tokens=32))
        create = engine.manager._create_batch_processor

        def create_padded():
            processor = create()
            processor.model_runner.pad_inputs = pad  # what CUDA graphs or compile switch on
            return processor

        engine.manager._create_batch_processor = create_padded
        seen = []  # (rows, rows with an expert id >= 0), hooked after the engine's own hooks
        hooks = [m.register_forward_pre_hook(
            lambda mod, args, kw: seen.append((args[1].shape[0], int((args[1] >= 0).any(-1).sum()))), with_kwargs=True)
            for m in experts]
        tokens = []
        hooks.append(model.register_forward_pre_hook(
            lambda mod, args, kw: tokens.append(int(kw["cu_seq_lens_q"][-1])), with_kwargs=True))

        return run_engine(engine, prompts, 10, hooks), seen, tokens

    plain, seen_plain, _ = run(False)
    padded, seen_padded, real = run(True)
    assert padded == plain
    assert all(rows == used for rows, used in seen_plain)
    assert all(rows == 32 for rows, _ in seen_padded)  # every step padded to the 32-token bucket
    per_step = [used for _, used in seen_padded][::len(experts)]
    assert per_step == real and min(real) < 32  # the real tokens only, and some steps had padding


def test_step_buckets_and_graph_plan():
    """Which steps a GPU serves under CUDA graphs and at which padded sizes (ktorch's plan)."""
    from ktorch.serve.engine import (GRAPH_KV_INTERVAL, GRAPH_MAX_TOKENS, GRAPH_TOKEN_BUCKETS, kv_bucket,
                                     plan_cuda_graphs, step_bucket, warm_up_steps)

    assert plan_cuda_graphs("cpu", "sdpa", None) == "off" and plan_cuda_graphs("cpu", "sdpa", True) == "off"
    assert plan_cuda_graphs("cuda", "sdpa", None) == "ktorch"
    assert plan_cuda_graphs("cuda", "paged|eager", True) == "ktorch"
    assert plan_cuda_graphs("cuda", "sdpa", False) == "off"
    assert plan_cuda_graphs("cuda", "paged|flash_attention_2", None) == "transformers"
    # the CLI's default is the engine's: graphs on a GPU (measured 4.3x an eager step's speed at one stream)
    from ktorch.cli import build_parser
    from ktorch.serve.engine import EngineConfig

    serve_args = build_parser().parse_args(["serve", "--model", "builtin"])
    assert serve_args.cuda_graphs == "auto" and EngineConfig().cuda_graphs is None
    assert plan_cuda_graphs("cuda", "sdpa", EngineConfig().cuda_graphs) == "ktorch"
    kv_cap = 50 * GRAPH_KV_INTERVAL
    for q in range(1, GRAPH_MAX_TOKENS + 1):
        for kv in (0, 1, 37, 300, GRAPH_KV_INTERVAL - 1, GRAPH_KV_INTERVAL, GRAPH_KV_INTERVAL + 1,
                   3 * GRAPH_KV_INTERVAL + 5):
            pq, pkv, graphed = step_bucket(q, kv, 512, kv_cap)
            assert graphed and pq in GRAPH_TOKEN_BUCKETS and pq >= q and (pq == 1 or pq // 2 < q), (q, pq)
            assert pkv == kv_bucket(kv, kv_cap), (kv, pkv)
    assert step_bucket(1, 0, 512, kv_cap)[:2] == (1, 256)  # no reads: still the first reads bucket
    assert step_bucket(33, 10, 48, kv_cap)[:2] == (48, 256)  # capped at max_batch_tokens
    assert step_bucket(3, 4400, 512, 4500 + 3) == (4, 4503, True)  # capped at the pool's reads
    assert step_bucket(GRAPH_MAX_TOKENS + 1, 900, 512, kv_cap) == (GRAPH_MAX_TOKENS + 1, 900, False)  # eager as is
    # the warm-up: every token bucket at the first reads bucket, then those up to 16 tokens at each reads bucket up
    # to 4096 (one stream's decode, a few streams', a short suffix after a cached prefix)
    small = (1, 2, 4, 8, 16)
    assert warm_up_steps(512, kv_cap) == [(q, 256) for q in GRAPH_TOKEN_BUCKETS] + [
        (q, r) for r in (512, 1024, 2048, 4096) for q in small]
    assert warm_up_steps(100, 1000) == [(q, 256) for q in (1, 2, 4, 8, 16, 32, 64, 100)] + [
        (q, r) for r in (512, 1000) for q in small]
    assert warm_up_steps(8, 200) == [(1, 200), (2, 200), (4, 200), (8, 200)]  # a pool under the first bucket
    assert (8, kv_bucket(2000, kv_cap)) in warm_up_steps(512, kv_cap)  # issue 33's second request's step
    assert step_bucket(40, 900, 32, kv_cap) == (40, 900, False)  # past max_batch_tokens: eager
    with pytest.raises(ValueError):
        step_bucket(0, 0, 512, kv_cap)
    # the CPU serves as before: no graphs, no padding
    model, _ = ktorch.load("builtin", dtype=torch.float32, progress=False)
    engine = ServeEngine(model, model.generation_config.eos_token_id, 0, EngineConfig(page_size=PAGE, num_blocks=16))
    try:
        assert engine.graph_plan == "off"
        assert engine.manager.continuous_batching_config.use_cuda_graph in (None, False, (False, False))
    finally:
        engine.stop()


def test_kv_bucket_powers_of_two_then_multiples_of_the_interval(monkeypatch):
    """A graphed step's cache reads as run: the next power of two from 256 to 4096, then the next multiple of 4096,
    never fewer than the reads, capped at the pool's; GRAPH_KV_MIN at the interval gives session 31's multiples of
    4096 (the benchmarks' old variant); bad values are errors naming the argument."""
    from ktorch.serve import engine as engine_module
    from ktorch.serve.engine import GRAPH_KV_INTERVAL, GRAPH_KV_MIN, kv_bucket

    assert (GRAPH_KV_MIN, GRAPH_KV_INTERVAL) == (256, 4096)
    cap = 1 << 20
    assert [kv_bucket(n, cap) for n in (0, 1, 255, 256, 257, 511, 512, 513, 2000, 2048, 4095, 4096)] == \
        [256, 256, 256, 256, 512, 512, 512, 1024, 2048, 2048, 4096, 4096]
    assert [kv_bucket(n, cap) for n in (4097, 8192, 8193, 12288, 30000)] == [8192, 8192, 12288, 12288, 32768]
    rng = random.Random(7)
    for n in [rng.randrange(0, 70000) for _ in range(2000)] + list(range(0, 9000, 7)):
        b = kv_bucket(n, cap)
        assert b >= n and kv_bucket(b, cap) == b, n  # covers the reads; a bucket is its own bucket
        if n <= 256:
            assert b == 256
        elif n <= GRAPH_KV_INTERVAL:
            assert b & (b - 1) == 0 and b < 2 * n, n  # a power of two, under twice the reads
        else:
            assert b % GRAPH_KV_INTERVAL == 0 and b - n < GRAPH_KV_INTERVAL, n
        assert kv_bucket(n, 3000) == min(b, 3000)  # capped at the pool's reads
    monkeypatch.setattr(engine_module, "GRAPH_KV_MIN", GRAPH_KV_INTERVAL)  # the old buckets
    for n in list(range(0, 20000, 13)) + [4096, 4097, 8192]:
        assert kv_bucket(n, cap) == -(-max(n, 1) // GRAPH_KV_INTERVAL) * GRAPH_KV_INTERVAL, n
    assert engine_module.warm_up_steps(16, cap) == [(q, GRAPH_KV_INTERVAL) for q in (1, 2, 4, 8, 16)]
    with pytest.raises(ValueError, match="reads"):
        kv_bucket(-1, cap)
    with pytest.raises(ValueError, match="max_tokens_read"):
        kv_bucket(10, 0)


def test_bucketed_steps_pad_to_the_buckets_and_leave_padding_out_of_the_experts(builtin):
    """ktorch's GPU plan, run eagerly on the CPU (``_install_buckets(graphs=False)``): each step's tokens are padded
    to the bucket ``step_bucket`` names, the padding rows reach the experts with id -1 only, and every request's
    tokens equal an unpadded run's; the counters count the real tokens."""
    from ktorch.serve.engine import GRAPH_TOKEN_BUCKETS, step_bucket

    model, _ = builtin
    experts = [m for m in model.modules() if getattr(m, "kt_w13", None) is not None]
    prompts = [list(range(10 + i, 17 + 5 * i)) for i in range(3)]  # 7, 12, 17 tokens: decode steps of 3 -> 4 rows

    def run(bucketed: bool):
        engine = ServeEngine(model, model.generation_config.eos_token_id, 0,
                             EngineConfig(page_size=PAGE, num_blocks=64, max_batch_tokens=48))
        create = engine.manager._create_batch_processor
        caps = {}

        def create_bucketed():
            processor = create()
            caps["batch"], caps["reads"] = processor.cache.max_batch_tokens, processor.cache.max_tokens_read
            if bucketed:
                engine._install_buckets(processor, graphs=False)
                engine._warm_up_buckets(processor)  # what captures the graphs on a GPU: one forward per bucket here
                caps["warm"] = list(steps)
                steps.clear()
                caps["free_after_warmup"] = processor.cache.compute_free_capacity()
            return processor

        engine.manager._create_batch_processor = create_bucketed
        seen = []  # per experts call: (rows, rows with an id >= 0, rows all -1)
        hooks = [m.register_forward_pre_hook(lambda mod, args, kw: seen.append(
            (args[1].shape[0], int((args[1] >= 0).any(-1).sum()), int((args[1] == -1).all(-1).sum()))),
            with_kwargs=True) for m in experts]
        steps = []  # per forward: (rows, real tokens, attention mask's key length)
        hooks.append(model.register_forward_pre_hook(lambda mod, args, kw: steps.append(
            (kw["input_ids"].shape[-1], int(kw["cu_seq_lens_q"][-1]), kw["attention_mask"].shape[-1])),
            with_kwargs=True))

        return run_engine(engine, prompts, 9, hooks), seen, steps, caps, engine

    plain, _, plain_steps, _, plain_engine = run(False)
    padded, seen, steps, caps, engine = run(True)
    # the warm-up: one forward per bucket up to max_batch_tokens (48) at the first reads bucket, then one-token steps
    # at the next reads buckets up to the pool's (1024 tokens); one fake request each, the pool freed after
    assert caps["reads"] == 1024
    assert [(rows, keys - rows) for rows, _, keys in caps["warm"]] == [
        (1, 256), (2, 256), (4, 256), (8, 256), (16, 256), (32, 256), (48, 256)] + [  # 33-48 tokens pad to 48
        (q, r) for r in (512, 1024) for q in (1, 2, 4, 8, 16)]
    assert all(rows == real for rows, real, _ in caps["warm"]) and caps["free_after_warmup"] == 1.0
    seen = seen[len(caps["warm"]) * len(experts):]
    assert padded == plain and all(len(o) == 9 for o in plain)
    assert all(rows == real for rows, real, _ in plain_steps)
    reals = [real for _, real, _ in steps]
    assert engine.tokens_computed == plain_engine.tokens_computed == sum(reals)
    assert engine.forwards == len(steps) and engine.graph_replays == engine.graph_captures == 0
    padded_steps = 0
    for i, (rows, real, keys) in enumerate(steps):
        assert rows == step_bucket(real, 1, caps["batch"], caps["reads"])[0], (rows, real)
        padded_steps += rows > real
        for layer_rows, used, pad in seen[i * len(experts):(i + 1) * len(experts)]:
            assert (layer_rows, used, pad) == (rows, real, rows - real)  # padding rows: all -1, real rows: routed
        assert keys - rows in (caps["reads"], 256, 512)  # reads padded to a bucket (or capped)
    assert sum(real == 3 for _, real, _ in steps) >= 7  # the decode steps, padded to 4 rows
    assert padded_steps == sum(real not in GRAPH_TOKEN_BUCKETS for _, real, _ in steps) > 0
    assert len(seen) == len(experts) * len(steps)


class _StandInGraph:
    """A CUDA graph's stand-in on the CPU: its replay reruns the captured step on the step's static inputs."""

    def __init__(self, step):
        self.step, self.replays = step, 0

    def replay(self):
        self.replays += 1
        self.step()

    def reset(self):
        pass


def _stand_in_graphs(monkeypatch, replay_in=None) -> list:
    """ktorch's GPU plan on the CPU: the engine plans graphs, and transformers' capture makes a ``_StandInGraph``
    (its warm-up run, then the "capture", which runs the step once more); returns the list of graphs made.
    ``replay_in(model, cache)``: a context each replay runs in (a CUDA graph replays the captured kernels: the
    compiled layers' ones, where the capture ran in ``compiled_step_layers``)."""
    from transformers.generation.continuous_batching import initialization, model_runner

    from ktorch.serve import engine as engine_module

    graphs = []

    def capture(runner, forward_fn, compute_stream, *args):  # ModelRunner._capture_graph without CUDA
        forward_fn(*args)
        forward_fn(*args)

        def step():
            with replay_in(args[0], args[1]["cache"]) if replay_in else contextlib.nullcontext():
                forward_fn(*args)

        graphs.append(_StandInGraph(step))
        runner.inputs_and_outputs.set_graph(graphs[-1])

    monkeypatch.setattr(engine_module, "plan_cuda_graphs", lambda *args: "ktorch")
    monkeypatch.setattr(initialization, "get_accelerator_graph_name", lambda: "CUDAGraph")
    monkeypatch.setattr(model_runner, "get_memory_pools", lambda: (None, None))
    monkeypatch.setattr(model_runner.ModelRunner, "_capture_graph", capture)
    return graphs


def test_graph_plan_control_flow_with_a_stand_in_graph(builtin, monkeypatch):
    """ktorch's GPU plan end to end on the CPU, CUDA's graph replaced by a stand-in: its capture records the step's
    forward and its replay reruns it on the step's inputs (rewritten in place in transformers' static tensors, as a
    CUDA graph replay reads them). The warm-up captures one graph per padded size, every later step replays one
    (none captured: all their sizes were warmed up), the counters count real tokens, and the tokens equal the eager
    engine's. Each capture, and nothing else, runs inside ``compiled_step_layers`` (a recording no-op here: the
    compiled capture is the next test's). What only CUDA shows (recorded kernels, the experts' host functions) is
    tests/test_serve_cuda.py's."""
    import contextlib

    from ktorch.serve import engine as engine_module

    compiled_contexts = []

    @contextlib.contextmanager
    def recording_context(model, cache):
        compiled_contexts.append(cache)
        yield

    monkeypatch.setattr(engine_module, "compiled_step_layers", recording_context)
    model, _ = builtin
    prompts = [list(range(10 + i, 17 + 5 * i)) for i in range(3)]

    def run():
        engine = ServeEngine(model, model.generation_config.eos_token_id, 0,
                             EngineConfig(page_size=PAGE, num_blocks=64, max_batch_tokens=48))

        engine.start()
        warm = (engine.graph_captures, engine.forwards)
        try:
            return asyncio.run(collect(engine, prompts, 9)), engine, warm
        finally:
            engine.stop()

    eager, eager_engine, _ = run()
    graphs = _stand_in_graphs(monkeypatch)
    graphed, engine, (warm_captures, warm_forwards) = run()
    assert engine.graph_plan == "ktorch" and eager_engine.graph_plan == "off"
    assert graphed == eager
    # 1, 2, 4, 8, 16, 32, 48 tokens at 256 reads, 1 to 16 tokens at 512 and 1024 (the pool's 64 pages of 16)
    assert warm_captures == len(graphs) == 17 and warm_forwards == 0
    assert engine.graph_captures == 17 and engine.graph_replays == engine.forwards == sum(g.replays for g in graphs)
    assert len(compiled_contexts) == 17 and all(c is compiled_contexts[0] for c in compiled_contexts)
    assert engine.tokens_computed == eager_engine.tokens_computed and engine.forwards >= 9
    assert eager_engine.graph_replays == eager_engine.graph_captures == 0


def test_compiled_captures_equal_eager_and_compile_once_per_token_bucket(builtin, monkeypatch):
    """The captured steps' decoder layers compiled regionally (``compiled_step_layers``: Inductor, on the CPU here,
    under the stand-in graph): the tokens equal the eager engine's; while a capture runs, every decoder layer runs a
    compiled forward and the attention is its eager-wrapped implementation, all put back after; and a capture at a
    new cache-reads bucket compiles nothing (only the eager attention sees the reads): with the warm-up of the
    larger reads buckets cut to one-token steps, three 200-token prompts' prefill chunks, 8 tokens at up to ~600
    reads, are captured at (8, 512) while serving, after the warm-up's (8, 256), and their decode steps at (2, 512)
    (and more). The stand-in's replays rerun the compiled layers, as a CUDA graph replays their kernels; in them the
    padding rows reach the CPU experts with id -1 only (the padding mask, traced by Dynamo here)."""
    from torch._dynamo.utils import counters

    from ktorch.generation import EAGER_ATTENTION_PREFIX, decoder_layers
    from ktorch.serve import engine as engine_module

    model, _ = builtin
    layers = decoder_layers(model)
    attentions = [layer.self_attn for layer in layers]
    inside = []
    compiled = engine_module.compiled_step_layers
    state = {"compiled": False, "real": None}
    seen = []  # per experts call in a compiled capture: (rows, rows with an id >= 0, rows all -1, real tokens)

    @contextlib.contextmanager
    def watched(m, cache):
        with compiled(m, cache):
            inside.append((m.config._attn_implementation, all("forward" in layer.__dict__ for layer in layers),
                           all(isinstance(a.layer_idx, torch.Tensor) for a in attentions)))
            state["compiled"] = True
            try:
                yield
            finally:
                state["compiled"] = False

    def recording(forward):  # the experts' own forward, called (eagerly) by the compiled layers
        def record(hidden_states, top_k_index, *args, **kwargs):
            if state["compiled"]:
                seen.append((top_k_index.shape[0], int((top_k_index >= 0).any(-1).sum()),
                             int((top_k_index == -1).all(-1).sum()), state["real"]))
            return forward(hidden_states, top_k_index, *args, **kwargs)
        return record

    experts = [m for m in model.modules() if getattr(m, "kt_w13", None) is not None]
    for m in experts:
        m.forward = recording(m.forward)
    hooks = [model.register_forward_pre_hook(
        lambda mod, args, kw: state.update(real=int(kw["cu_seq_lens_q"][-1])), with_kwargs=True)]
    monkeypatch.setattr(engine_module, "compiled_step_layers", watched)
    monkeypatch.setattr(engine_module, "WARM_UP_READS_TOKENS", 1)
    prompts = [[(11 * i + j) % 4000 + 5 for i in range(200)] for j in range(3)]

    def run(graphed: bool):
        engine = ServeEngine(model, model.generation_config.eos_token_id, 0,
                             EngineConfig(page_size=PAGE, num_blocks=64, max_batch_tokens=8))
        engine.start()
        warm = (engine.graph_captures, counters["stats"]["unique_graphs"])
        try:
            return asyncio.run(collect(engine, prompts, 40, timeout=300)), engine, warm
        finally:
            engine.stop()

    try:
        eager, _, _ = run(False)
        graphs = _stand_in_graphs(monkeypatch, replay_in=lambda m, cache: engine_module.compiled_step_layers(m, cache))
        torch._dynamo.reset()
        counters.clear()
        graphed, engine, (warm_captures, warm_graphs) = run(True)
        for m in experts:
            assert "forward" in m.__dict__  # compiled_layers put the instance's own forward back
    finally:
        for h in hooks:
            h.remove()
        for m in experts:
            m.__dict__.pop("forward", None)
    assert graphed == eager
    assert seen and all((used, pad) == (real, rows - real) for rows, used, pad, real in seen), seen
    assert any(rows > real for rows, _, _, real in seen)  # some compiled steps had padding rows
    assert warm_captures == 6  # 1, 2, 4, 8 tokens at 256 reads, 1 token at 512 and 1024 (the pool's 64 pages)
    assert engine.graph_captures > warm_captures  # (8, 512), (2, 512): the prompts' chunks, their decode
    assert 0 < warm_graphs == counters["stats"]["unique_graphs"], dict(counters["stats"])
    assert len(inside) == engine.graph_captures + sum(g.replays for g in graphs)
    assert all(impl == EAGER_ATTENTION_PREFIX + "sdpa" and fwd and idx for impl, fwd, idx in inside), inside
    assert model.config._attn_implementation == "sdpa"  # put back
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert all(type(a.layer_idx) is int for a in attentions)


def test_a_failed_compiled_capture_falls_back_to_eager_layers(builtin, monkeypatch, caplog):
    """A capture whose compiled layers fail (a layer Dynamo or Inductor cannot take) is run again with the layers
    eager, and so is every later capture: the engine serves the eager engine's tokens, counts the failure once in
    /v1/stats and says so in its log."""
    from ktorch.serve import engine as engine_module

    attempts = []

    @contextlib.contextmanager
    def failing(model, cache):
        attempts.append(1)
        raise RuntimeError("this layer cannot be compiled")
        yield

    model, _ = builtin
    prompts = [list(range(10 + i, 17 + 5 * i)) for i in range(3)]

    def run():
        engine = ServeEngine(model, model.generation_config.eos_token_id, 0,
                             EngineConfig(page_size=PAGE, num_blocks=64, max_batch_tokens=8))
        return run_engine(engine, prompts, 9), engine

    eager, _ = run()
    _stand_in_graphs(monkeypatch)
    monkeypatch.setattr(engine_module, "compiled_step_layers", failing)
    with caplog.at_level("WARNING", logger="ktorch.serve"):
        graphed, engine = run()
    assert graphed == eager
    assert attempts == [1] and engine.graph_compile_failures == 1 == engine.stats()["graph_compile_failures"]
    assert engine.graph_captures >= 4 and engine.graph_replays > 0  # every bucket captured, eagerly
    assert "this and later steps are captured with the layers eager" in caplog.text


def test_queued_tokens_limit(builtin):
    model, tok = builtin
    engine = ServeEngine(model, model.generation_config.eos_token_id, 0,
                         EngineConfig(page_size=PAGE, num_blocks=64, max_requests=3, max_queued_tokens=100))

    async def run():
        _, q1 = await engine.submit(list(range(5, 65)), SamplingParams(2))  # 60 prompt tokens wait (not started)
        with pytest.raises(AdmissionError, match="max-queued-tokens"):
            await engine.submit(list(range(5, 65)), SamplingParams(2))
        _, q2 = await engine.submit(list(range(5, 35)), SamplingParams(2))
        _, q3 = await engine.submit([7, 8], SamplingParams(2))
        with pytest.raises(AdmissionError, match="max-requests"):
            await engine.submit([7, 8], SamplingParams(2))
        engine.start()
        for q in (q1, q2, q3):
            while not (await asyncio.wait_for(q.get(), 60)).is_finished():
                pass
        assert engine.stats()["queued_prompt_tokens"] == 0 and engine.stats()["requests_in_flight"] == 0
        _, q4 = await engine.submit(list(range(5, 65)), SamplingParams(2))  # room again
        while not (await asyncio.wait_for(q4.get(), 60)).is_finished():
            pass

    try:
        asyncio.run(run())
    finally:
        engine.stop()


# ---------------------------------------------------------------- prefix cache


def test_prefix_cache_computes_only_the_suffix(server, builtin):
    model, tok = builtin
    rng = random.Random(1)
    vocab = model.config.vocab_size
    prefix = [rng.randrange(3, vocab) for _ in range(10 * PAGE + 5)]
    second = prefix + [rng.randrange(3, vocab) for _ in range(9)]
    s0 = server.stats()
    # max_tokens 1: the request ends with its last prefill chunk, whose pages ktorch registers all the same
    # (transformers 5.24 alone skips a finished request's last step: engine._register_final_step_pages)
    first = server.client.completions.create(model="builtin", prompt=prefix, max_tokens=1, temperature=0)
    s1 = server.stats()
    r = server.client.completions.create(model="builtin", prompt=second, max_tokens=4, temperature=0)
    s2 = server.stats()
    # the first one computes its whole prompt (then one decode token)
    assert s1["tokens_computed"] - s0["tokens_computed"] == len(prefix) + first.usage.completion_tokens - 1
    reused = (len(prefix) // PAGE) * PAGE
    computed = s2["tokens_computed"] - s1["tokens_computed"]
    decode = r.usage.completion_tokens - 1
    assert computed - decode == len(second) - reused, (computed, decode, len(second), reused)
    with torch.inference_mode():  # and the reused KV gives the right tokens
        out = model.generate(torch.tensor([second]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert r.choices[0].text == tok.decode(out[0, len(second):].tolist(), skip_special_tokens=True)


# ---------------------------------------------------------------- bad and hostile input


def _error(status_body, status, code=None):
    st, body = status_body
    assert st == status, (st, body)
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err


def test_bad_inputs_get_4xx_and_the_server_goes_on(server):
    c = server.client
    ok = PROMPTS[0]
    expected = _complete(c, ok, 8)

    def post(path, body):
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return server.request("POST", path, raw)

    good = {"model": "builtin", "prompt": "hi", "max_tokens": 4}
    chat = {"model": "builtin", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [
        (post("/v1/completions", b'{"model": "builtin", "prompt": '), 400, "invalid_json"),
        (post("/v1/completions", b"\xff\xfe"), 400, "invalid_json"),
        (post("/v1/completions", [1, 2]), 400, "invalid_json"),
        (post("/v1/completions", {**good, "model": "gpt-5"}), 404, "model_not_found"),
        (post("/v1/completions", {"prompt": "hi"}), 400, "missing_model"),
        (post("/v1/completions", {**good, "prompt": "word " * 3000}), 400, "context_length_exceeded"),
        (post("/v1/completions", {**good, "max_tokens": 2047}), 400, "context_length_exceeded"),
        (post("/v1/completions", {**good, "max_tokens": 0}), 400, "invalid_value"),
        (post("/v1/completions", {**good, "max_tokens": "many"}), 400, "invalid_type"),
        (post("/v1/completions", {**good, "temperature": 5}), 400, "invalid_value"),
        (post("/v1/completions", {**good, "temperature": float("nan")}), 400, None),
        (post("/v1/completions", {**good, "top_p": 0}), 400, "invalid_value"),
        (post("/v1/completions", {**good, "seed": 1.5}), 400, "invalid_type"),
        (post("/v1/completions", {**good, "stop": ["a", "b", "c", "d", "e"]}), 400, "invalid_value"),
        (post("/v1/completions", {**good, "n": 3}), 400, "invalid_value"),
        (post("/v1/completions", {**good, "stream": "yes"}), 400, "invalid_type"),
        (post("/v1/completions", {**good, "prompt": [1, -4]}), 400, "invalid_value"),
        (post("/v1/completions", {**good, "prompt": []}), 400, "invalid_value"),
        (post("/v1/completions", {**good, "prompt": {"x": 1}}), 400, "invalid_value"),
        (post("/v1/chat/completions", {**chat, "messages": []}), 400, "invalid_value"),
        (post("/v1/chat/completions", {**chat, "messages": [{"role": "wizard", "content": "x"}]}), 400, "invalid_value"),
        (post("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": 3}]}), 400, "invalid_value"),
        (post("/v1/completions", {**good, "prompt": "x" * (17 << 20)}), 413, "request_too_large"),
        (post("/v1/nothing", good), 404, "not_found"),
        (server.get("/v1/completions"), 405, "method_not_allowed"),
        (server.get("/v1/models/gpt-5"), 404, "model_not_found"),
    ]
    for result, status, code in cases:
        _error(result, status, code)
        assert _complete(c, ok, 8) == expected  # still serving, same answer
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="builtin", prompt="x", temperature=-1)
    assert server.get("/health")[0] == 200
    server.wait_idle()


def test_disconnect_mid_stream_frees_the_slot(server):
    idle = server.wait_idle()
    conn = http.client.HTTPConnection(HOST, server.port, timeout=60)
    body = {"model": "builtin", "prompt": PROMPTS[2] * 20, "max_tokens": 1500, "temperature": 0, "stream": True,
            "stop": ["\u2603never"]}  # a stop string no token makes: it only ends by length or by us
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    got = b""
    while got.count(b"data: ") < 3:
        got += r.read1(4096)
    busy = server.stats()
    assert busy["requests_in_flight"] == 1 and busy["kv_bytes_in_use"] > 0
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    after = server.wait_idle(timeout=30)
    assert after["requests_cancelled"] > idle["requests_cancelled"]
    assert after["kv_bytes_in_use"] == 0
    assert _complete(server.client, PROMPTS[0], 8)[0]


def test_disconnect_before_a_non_streamed_answer_frees_the_slot(server):
    idle = server.wait_idle()
    conn = http.client.HTTPConnection(HOST, server.port, timeout=60)
    body = {"model": "builtin", "prompt": PROMPTS[2] * 20, "max_tokens": 1500, "temperature": 0,
            "stop": ["\u2603never"]}  # this prompt runs to max_tokens (no end-of-sequence token) unless stopped
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    deadline = time.monotonic() + 30
    while server.stats()["kv_bytes_in_use"] == 0:  # wait until it runs
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    conn.sock.close()  # the client gives up before the answer
    conn.close()
    after = server.wait_idle(timeout=30)  # the server polls the connection while it waits for tokens
    assert after["requests_cancelled"] > idle["requests_cancelled"]
    assert after["tokens_computed"] - idle["tokens_computed"] < 1500  # stopped long before max_tokens
    assert _complete(server.client, PROMPTS[0], 8)[0]


def test_429_when_full_and_serving_after(server):
    """MAX_REQUESTS streams in flight: one more gets 429 in OpenAI's shape; after they end, requests pass again."""
    server.wait_idle()
    conns = []
    body = {"model": "builtin", "prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0, "stream": True,
            "stop": ["\u2603never"]}
    try:
        for _ in range(MAX_REQUESTS):
            conn = http.client.HTTPConnection(HOST, server.port, timeout=60)
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            conns.append(conn)
        for conn in conns:
            assert conn.getresponse().status == 200  # each stream has started
        assert server.stats()["requests_in_flight"] == MAX_REQUESTS
        with pytest.raises(openai.RateLimitError) as e:
            server.client.completions.create(model="builtin", prompt="x", max_tokens=2)
        assert e.value.status_code == 429 and e.value.body["code"] == "rate_limit_exceeded"
    finally:
        for conn in conns:
            conn.close()
    server.wait_idle(timeout=60)
    assert _complete(server.client, PROMPTS[0], 8)[0]


# ---------------------------------------------------------------- load


def test_mixed_load(server):
    """120 mixed requests (short and long prompts, streamed or not, chat or completions, some disconnecting
    early), 24 at a time: every completed response is the one the prompt gives alone, no server error, and the
    KV pool and requests in flight go back to idle. (benchmarks/bench_serve.py --load 1000 runs the full one.)"""
    rng = random.Random(3)
    long_prompt = " ".join(PROMPTS) * 6
    pool = [p for p in PROMPTS] + [long_prompt + p for p in PROMPTS[:4]]
    alone = {(p, n): _complete(server.client, p, n) for p in pool for n in (6, 20)}
    idle = server.wait_idle()

    def one(i):
        p, n = rng.choice(pool), rng.choice((6, 20))
        mode = i % 4
        if mode == 3:  # disconnect after the first chunk
            conn = http.client.HTTPConnection(HOST, server.port, timeout=60)
            body = {"model": "builtin", "prompt": p, "max_tokens": n, "temperature": 0, "stream": True}
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            r = conn.getresponse()
            assert r.status == 200
            r.read1(64)
            conn.sock.close()
            conn.close()
            return None
        return (p, n), _complete(server.client, p, n, stream=mode == 1)

    with ThreadPoolExecutor(24) as ex:
        results = list(ex.map(one, range(120)))
    bad = [(key, got) for key, got in filter(None, results) if got != alone[key]]
    assert not bad, bad[:3]
    after = server.wait_idle(timeout=60)
    assert after["kv_bytes_in_use"] == 0 and after["queued_prompt_tokens"] == 0
    assert after["rss_bytes"] < idle["rss_bytes"] + (256 << 20), (idle["rss_bytes"], after["rss_bytes"])


def test_load_generator_mixed_load(server):
    """benchmarks/bench_serve.py's mixed load, 100 requests (its --load 1000 at a CI size): every completed
    response (greedy or seeded, streamed or not) equals the same request run alone, clients that disconnect early
    leave nothing behind, no server error (answers, error events, the server's count), and the server goes back to
    idle (no request, queued token or KV page held; RSS within 256 MiB of idle) and answers the next request."""
    from conftest import load_benchmark

    import aiohttp

    bench = load_benchmark("bench_serve")

    async def run():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            client = bench.Client(session, f"http://{HOST}:{server.port}", "builtin")
            return await bench.load(client, 100, 24, 4096, random.Random(5), long_len=200, token_choices=(4, 12),
                                    n_short=8, n_long=2, print_fn=lambda *a: None)

    r = asyncio.run(run())
    c = r["counts"]
    assert c["mismatch"] == c["http_4xx"] == c["http_5xx"] == c["stream_error"] == c["rate_limited"] == 0, r
    assert c["ok"] + c["disconnected"] == 100 and c["disconnected"] >= 6  # 12-13 of the kind that disconnects mid-stream
    assert set(r["kind_ok"]) >= {"plain", "stream", "seeded"}, r["kind_ok"]
    assert r["server_errors"] == 0 and r["next_ok"] and r["health"]["status"] == "ok"
    assert r["after"]["requests_in_flight"] == 0 and r["after"]["kv_bytes_in_use"] == 0
    assert r["after"]["queued_prompt_tokens"] == 0
    assert r["after"]["rss_bytes"] < r["idle"]["rss_bytes"] + (256 << 20), (r["idle"], r["after"])


def test_host_tier_restores_evicted_prefix_pages(builtin):
    """A small device pool: the first prompt's pages are evicted by later prompts, spill to the host tier, and a
    prompt starting with them gets them copied back: it computes only the rest, and its tokens are right."""
    model, tok = builtin
    engine = ServeEngine(model, model.generation_config.eos_token_id, 0,
                         EngineConfig(page_size=PAGE, num_blocks=40, max_batch_tokens=64, host_cache_gib=0.05))
    rng = random.Random(2)
    first = [rng.randrange(3, 4096) for _ in range(10 * PAGE + 5)]
    second = first + [rng.randrange(3, 4096) for _ in range(9)]
    fillers = [[rng.randrange(3, 4096) for _ in range(300)] for _ in range(3)]

    async def run():
        engine.start()
        await generated(engine, first, 2)
        for f in fillers:  # 3 x 19 pages through a 40-page pool: the cached pages are evicted
            await generated(engine, f, 2)
        spilled = engine.stats()
        before = engine.tokens_computed
        out = await generated(engine, second, 4)
        return spilled, engine.tokens_computed - before, out, engine.stats()

    try:
        spilled, computed, out, after = asyncio.run(run())
    finally:
        engine.stop()
    assert spilled["host_prefix_spilled"] >= 10 and spilled["host_prefix_restored"] == 0
    assert after["host_prefix_restored"] == 10  # the first prompt's 10 full pages
    assert computed == len(second) - 10 * PAGE + len(out) - 1
    with torch.inference_mode():
        ref = model.generate(torch.tensor([second]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out == ref[0, len(second):].tolist()


# ---------------------------------------------------------------- the command line


def test_serve_options_have_help_and_bad_values_are_refused(capsys):
    from ktorch.cli import build_parser, main

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["serve"]
    for action in sub._actions:
        if action.dest != "help":
            assert action.help and len(action.help) > 10, action.option_strings
    for argv, message in [(["--port", "0"], "--port 0: out of range"), (["--page-size", "2"], "--page-size 2"),
                          (["--max-requests", "0"], "--max-requests 0"), (["--kv-cache-gib", "0"], "--kv-cache-gib"),
                          (["--host-prefix-cache-gib", "-1"], "--host-prefix-cache-gib"), (["--plain"], "--plain"),
                          (["--no-compile"], "--no-compile is for generate and chat")]:
        assert main(["serve", "--model", "builtin", *argv]) == 1
        assert message in capsys.readouterr().err


def test_token_ids_without_a_tokenizer(builtin):
    """A checkpoint without a tokenizer (GGUF benchmark files) serves completions over token ids."""
    from aiohttp.test_utils import TestClient, TestServer

    from ktorch.cli import TokenIdsTokenizer
    from ktorch.serve.app import OpenAIServer

    model, _ = builtin
    ids = [5, 300, 41, 2000, 17, 9]
    with torch.inference_mode():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, pad_token_id=0)[0, 6:].tolist()
    engine = ServeEngine(model, model.generation_config.eos_token_id, 0, EngineConfig(page_size=PAGE, num_blocks=64))
    server = OpenAIServer(engine, TokenIdsTokenizer(model.config.vocab_size), "bench")

    async def run():
        async with TestClient(TestServer(server.make_app(), host=HOST)) as client:
            r = await client.post("/v1/completions", json={"model": "bench", "prompt": ids, "max_tokens": 6,
                                                           "temperature": 0})
            text = (await r.json())["choices"][0]["text"]
            r2 = await client.post("/v1/completions", json={"model": "bench", "prompt": "ab", "max_tokens": 2})
            r3 = await client.post("/v1/chat/completions", json={"model": "bench", "max_tokens": 2,
                                                                 "messages": [{"role": "user", "content": "x"}]})
            return text, r2.status, (await r2.json())["usage"]["prompt_tokens"], r3.status, await r3.json()

    text, st2, prompt_tokens, st3, chat = asyncio.run(run())
    assert [int(t) for t in text.split()] == ref
    assert (st2, prompt_tokens) == (200, 2)  # "ab": its two bytes as ids
    assert st3 == 400 and chat["error"]["code"] == "no_chat_template"


def test_a_server_failure_is_a_counted_500_and_the_server_goes_on(builtin):
    """A failure inside the server (here: the engine's submit raising) answers 500 in OpenAI's shape, counts in
    /v1/stats' server_errors (what bench_serve's load reports), and the next request is served."""
    from aiohttp.test_utils import TestClient, TestServer

    from ktorch.serve.app import OpenAIServer

    model, tok = builtin
    engine = ServeEngine(model, model.generation_config.eos_token_id, 0, EngineConfig(page_size=PAGE, num_blocks=64))
    server = OpenAIServer(engine, tok, "builtin")
    submit = engine.submit

    async def broken(*args, **kwargs):
        raise RuntimeError("simulated failure")

    async def run():
        body = {"model": "builtin", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
        async with TestClient(TestServer(server.make_app(), host=HOST)) as client:
            engine.submit = broken
            r1 = await client.post("/v1/completions", json=body)
            failed = (r1.status, await r1.json(), (await (await client.get("/v1/stats")).json())["server_errors"])
            engine.submit = submit
            r2 = await client.post("/v1/completions", json=body)
            return failed, r2.status, (await r2.json())["choices"][0]["text"]

    (status, err, errors), status2, text = asyncio.run(run())
    assert status == 500 and err["error"]["type"] == "server_error" and "simulated failure" in err["error"]["message"]
    assert set(err["error"]) == {"message", "type", "param", "code"} and errors == 1
    assert status2 == 200 and text


def test_incremental_detokenizer_equals_full_decode(builtin):
    """The streamed text, built from a short window per token, equals decoding all tokens at once (random ids,
    special and byte tokens included)."""
    from ktorch.serve.app import IncrementalDetokenizer

    _, tok = builtin
    rng = random.Random(4)
    for _ in range(200):
        ids = [rng.randrange(0, tok.vocab_size) for _ in range(rng.randint(1, 50))]
        d = IncrementalDetokenizer(tok)
        for i in range(1, len(ids) + 1):
            d.update(ids[:i], final=i == len(ids))
        assert d.text == tok.decode(ids, skip_special_tokens=True), ids


def test_sse_chunks_equal_json_dumps():
    """A streamed text chunk rendered from its template is byte for byte json.dumps of the whole chunk (quotes,
    backslashes, control characters, non-ASCII text; completions and chat, with and without usage)."""
    from ktorch.serve.app import SSEChunks

    texts = ["a", " the", '"quoted"', "back\\slash", "line\nbreak\t", "\x00\x1f", "é中文", "\U0001f600 emoji", "</s>"]
    for chat in (False, True):
        for usage in (False, True):
            sse = SSEChunks("cmpl-0123", "chat.completion.chunk" if chat else "text_completion", 1700000000,
                            'my "model"', chat, usage)
            for text in texts:
                want = b"data: " + json.dumps(sse.payload(text, None)).encode() + b"\n\n"
                assert sse.event(text, None) == want
                assert json.loads(want[6:])["choices"][0]["delta" if chat else "text"] == ({"content": text} if chat
                                                                                           else text)


def _http_chunks(raw: bytes) -> list[bytes]:
    """The chunks of an HTTP/1.1 chunked body (``raw``: the bytes after the headers), the last one empty."""
    chunks, i = [], 0
    while True:
        j = raw.index(b"\r\n", i)
        size = int(raw[i:j], 16)
        chunks.append(raw[j + 2:j + 2 + size])
        i = j + 2 + size + 2
        if size == 0:
            return chunks


def test_a_stream_writes_once_per_token_and_ends_in_one_write(server):
    """Streamed over a raw socket: chat's role chunk arrives with the first text, and the last text, the usage and
    [DONE] arrive with the body's end (one HTTP chunk, then the terminating one, in one read: a client that stops at
    [DONE] has the whole response, so its connection can take its next request)."""
    for path, extra in (("/v1/completions", {"prompt": PROMPTS[1]}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[1]}]})):
        body = {"model": "builtin", "max_tokens": 6, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, **extra}
        payload = json.dumps(body).encode()
        with socket.create_connection((HOST, server.port), timeout=60) as sock:
            sock.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
            raw = b""
            while b"data: [DONE]" not in raw:
                part = sock.recv(65536)
                assert part, raw
                raw += part
            assert raw.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), raw[-200:]  # the end came with [DONE]
        head, body_raw = raw.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
        chunks = _http_chunks(body_raw)
        assert chunks[-1] == b"" and all(c.endswith(b"\n\n") for c in chunks[:-1])
        events = [[json.loads(e[6:]) if e != b"data: [DONE]" else "[DONE]" for e in c.split(b"\n\n") if e]
                  for c in chunks[:-1]]
        last = events[-1]
        assert last[-1] == "[DONE]" and last[-2]["choices"] == [] and 1 <= last[-2]["usage"]["completion_tokens"] <= 6
        assert last[-3]["choices"][0]["finish_reason"] in ("length", "stop")
        assert all(len(e) == 1 for e in events[1:-1])  # one event per write in between
        if path == "/v1/chat/completions":
            first = events[0]
            assert first[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert first[1]["choices"][0]["delta"]["content"]


def test_count_distinct_experts_equals_a_unique_per_layer():
    """The step statistics' distinct experts (one scatter over all layers) equal a unique per layer of the routing
    ids, padding rows (-1) left out, with each layer's bytes per expert; layers of different shapes too."""
    from ktorch.serve.engine import count_distinct_experts

    g = torch.Generator().manual_seed(3)
    for layers, tokens, k, experts in ((1, 1, 2, 8), (4, 7, 2, 16), (48, 33, 8, 128), (3, 64, 4, 60)):
        refs = []
        for layer in range(layers):
            ids = torch.randint(0, experts, (tokens, k), generator=g)
            ids[torch.rand(tokens, generator=g) < 0.3] = -1  # padding rows
            refs.append((ids.to(torch.int32 if layer % 2 else torch.int64), 1000 + layer, experts))
        want = [torch.unique(r[0][r[0] >= 0]).numel() for r in refs]
        assert count_distinct_experts(refs) == (sum(want), sum(u * r[1] for u, r in zip(want, refs)))
        mixed = refs + [(torch.tensor([[1, 5], [-1, -1], [5, 2]]), 7, experts)]
        assert count_distinct_experts(mixed) == (sum(want) + 3, sum(u * r[1] for u, r in zip(want, refs)) + 21)
    assert count_distinct_experts([]) == (0, 0)
    all_padding = [(torch.full((4, 2), -1), 10, 8)]
    assert count_distinct_experts(all_padding) == (0, 0)


def test_first_outputs_are_handled_before_the_next_step(builtin, monkeypatch):
    """A step that gives requests their first token waits until the server's loop has run those requests' handlers
    (up to their next wait) before the next step starts; later tokens do not wait. Two requests of 3 tokens and a
    third started after the first two's first tokens: every first output is handled (here: logged right after the
    handler takes it) before the step after it begins. The bound is lifted so that a loaded machine cannot time it
    out."""
    from transformers.generation.continuous_batching import model_runner

    import ktorch.serve.engine as engine_module

    monkeypatch.setattr(engine_module, "FIRST_OUTPUT_WAIT_S", 60.0)
    log: list = []
    compute = model_runner.ModelRunner.compute_batch

    def logged(self, model, batch_data):
        log.append(("step", time.perf_counter()))
        return compute(self, model, batch_data)

    monkeypatch.setattr(model_runner.ModelRunner, "compute_batch", logged)
    model, _ = builtin
    engine = ServeEngine(model, model.generation_config.eos_token_id, 0, EngineConfig(page_size=PAGE, num_blocks=64))

    async def one(ids):
        _, q = await engine.submit(ids, SamplingParams(3))
        n = 0
        while True:
            out = await q.get()  # as the server's handler waits (a wait_for would add a task between)
            n += 1
            if n == 1:
                log.append(("first", time.perf_counter()))
                time.sleep(0.02)  # a slow handler: the generation thread must still be waiting
                log.append(("first done", time.perf_counter()))
            if out.is_finished():
                return out.generated_tokens

    async def run():
        a, b = await asyncio.gather(one(list(range(5, 40))), one(list(range(7, 30))))
        c = await one(list(range(9, 50)))
        return a, b, c

    engine.start()
    try:
        outs = asyncio.run(asyncio.wait_for(run(), 120))
    finally:
        engine.stop()
    assert all(len(o) == 3 for o in outs)
    kinds = [k for k, _ in log]
    assert kinds.count("first") == 3 and kinds.count("first done") == 3
    times = [k for k, _ in sorted(log, key=lambda e: e[1])]
    for i, kind in enumerate(times):
        if kind == "first":  # no step began while the handler ran (its sleep releases the GIL)
            j = times.index("first done", i)
            assert "step" not in times[i:j], times
    assert times.count("step") >= 5  # the first two together (3 or more), the third's 3 (its prefill, 2 decode)


def test_kv_pool_reserve_counts_pages_masks_and_activations():
    """The pool ktorch serve reserves before resident experts (engine.kv_pool_for), by hand for a fake model of 4
    layers, 2 KV heads of 32 dims, hidden 256, vocabulary 1000, bf16: pages from --kv-pages, --kv-cache-gib or the
    default tokens; attention masks [M, pool + M] for sdpa and none for flash attention; the pool grows by whole pages
    paid for with their masks' share."""
    import types

    from ktorch.gpu_memory import ACTIVATION_BYTES_PER_TOKEN_HIDDEN
    from ktorch.serve.engine import DEFAULT_MAX_BATCH_TOKENS, KV_POOL_TOKENS, LOGIT_BYTES, LOGIT_ROWS, kv_pool_for

    fake = types.SimpleNamespace(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                                 hidden_size=256, vocab_size=1000, _attn_implementation="sdpa")
    kv = 2 * 4 * 2 * 32 * 2  # keys and values, all layers, bf16
    pool = kv_pool_for(fake, torch.bfloat16, EngineConfig(page_size=16, num_blocks=10, max_batch_tokens=64))
    assert (pool.num_blocks, pool.tokens, pool.kv_bytes_per_token, pool.mask_bytes_per_token) == (10, 160, kv, 64 * 2)
    activations = 64 * 64 * 2 + 64 * 256 * ACTIVATION_BYTES_PER_TOKEN_HIDDEN + 64 * 1000 * LOGIT_BYTES
    assert pool.activation_bytes == activations
    assert pool.nbytes == 160 * kv + 64 * (160 + 64) * 2 + activations - 64 * 64 * 2
    gib = kv_pool_for(fake, torch.bfloat16, EngineConfig(page_size=16, kv_cache_gib=0.5))
    assert gib.num_blocks == (1 << 29) // (16 * kv) and gib.max_batch_tokens == DEFAULT_MAX_BATCH_TOKENS
    default = kv_pool_for(fake, torch.bfloat16, EngineConfig(page_size=16))
    assert default.tokens == KV_POOL_TOKENS
    assert default.activation_bytes == (DEFAULT_MAX_BATCH_TOKENS ** 2 * 2 + DEFAULT_MAX_BATCH_TOKENS * 256
                                        * ACTIVATION_BYTES_PER_TOKEN_HIDDEN + LOGIT_ROWS * 1000 * LOGIT_BYTES)
    flash = kv_pool_for(types.SimpleNamespace(**{**vars(fake), "_attn_implementation": "flash_attention_2"}),
                        torch.bfloat16, EngineConfig(page_size=16, num_blocks=10, max_batch_tokens=64))
    assert flash.mask_bytes_per_token == 0 and flash.nbytes == pool.nbytes - 64 * (160 + 64) * 2
    per_page = 16 * (kv + 128)
    grown = pool.grown_by(3 * per_page + per_page - 1)
    assert grown.num_blocks == 13 and grown.nbytes - pool.nbytes == 3 * per_page
    assert pool.grown_by(-5).num_blocks == 10 and "KV pool 10 pages of 16 tokens" in pool.line()


def test_residents_follow_the_routing_and_stats_report_their_hit_rate():
    """With resident experts (a CPU stand-in budget here; on a GPU the default) the prompt chunks' routing swaps the
    most routed-to experts in (they start as each layer's first ones), and /v1/stats reports the hit rate since the
    start across those swaps: routed slots of real tokens on residents / all routed slots, the padding rows (forced
    on, as CUDA graphs do) counted in neither; the tokens equal a run with every expert on the CPU op. Without
    residents: no such keys."""
    from ktorch.gpu_memory import (dequantized_bytes_per_expert, device_bytes_held, reserve_bytes,
                                   reset_resident_hits, resident_bytes_per_expert)

    model, _ = ktorch.load("builtin", device="cpu", dtype=torch.float32, progress=False, tokenizer=False)
    experts = [m for m in model.modules() if getattr(m, "kt_w13", None) is not None]
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 4096) for _ in range(70 + 9 * i)] for i in range(3)]  # chunks >= MIN_TOKENS count

    def run():
        engine = ServeEngine(model, model.generation_config.eos_token_id, 0,
                             EngineConfig(page_size=PAGE, num_blocks=64, max_batch_tokens=128))
        create = engine.manager._create_batch_processor

        def create_padded():
            processor = create()
            processor.model_runner.pad_inputs = True  # what CUDA graphs switch on
            return processor

        engine.manager._create_batch_processor = create_padded
        slots = []  # per experts call: (real slots, real slots on residents), after the engine's padding mask
        hooks = [m.register_forward_pre_hook(lambda mod, args, kw: slots.append(
            (int((args[1] >= 0).sum()), int(((args[1] >= 0) & (mod.kt_gpu_slot_of[args[1].clamp(min=0)] >= 0)).sum())
             if getattr(mod, "kt_gpu_slot_of", None) is not None else 0)), with_kwargs=True) for m in experts]
        return run_engine(engine, prompts, 8, hooks), slots, engine

    plain, _, engine = run()
    assert "resident_hit_rate" not in engine.stats()
    per_resident = (resident_bytes_per_expert(experts[0]) * len(experts)
                    + dequantized_bytes_per_expert(experts[0], torch.float32))

    floor = device_bytes_held(model, torch.device("cpu")) + reserve_bytes(model, torch.float32)
    ktorch.set_stream_experts(model, "off", gpu_memory=floor + (model.config.num_experts // 2) * per_resident)
    resident = model.kt_gpu_memory.resident_per_layer
    assert 0 < resident < model.config.num_experts
    assert all(m.kt_gpu_expert_ids == list(range(resident)) for m in experts)
    reset_resident_hits(model)
    with_residents, slots, engine = run()
    stats = engine.stats()
    hits, rows = sum(h for _, h in slots), sum(r for r, _ in slots)
    assert stats["resident_experts_per_layer"] == resident and stats["resident_swaps"] == engine.resident_swaps > 0
    assert any(m.kt_gpu_expert_ids != list(range(resident)) for m in experts)
    assert (stats["resident_hits"], stats["resident_rows"]) == (hits, rows) and 0 < hits < rows
    assert stats["resident_hit_rate"] == pytest.approx(hits / rows, abs=1e-6)
    assert with_residents == plain


def test_an_address_it_cannot_listen_on_is_named_before_loading(monkeypatch, capsys):
    """`ktorch serve` on a port another server holds, or a host name that does not resolve: an error naming the
    address before the model loads (before: aiohttp's OSError traceback after the load)."""
    import ktorch.cli
    from ktorch.cli import main

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the address was checked")

    monkeypatch.setattr(ktorch.cli, "_load_and_describe", no_loading)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert main(["serve", "--model", "builtin", "--port", str(port)]) == 1
    assert (f"ktorch serve: error: --host 127.0.0.1 --port {port}: cannot listen there: Address already in use "
            "(another server?)") in capsys.readouterr().err
    assert main(["serve", "--model", "builtin", "--host", "no-such-host.invalid"]) == 1
    assert "ktorch serve: error: --host no-such-host.invalid: " in capsys.readouterr().err
