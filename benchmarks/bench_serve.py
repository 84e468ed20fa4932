"""Load generator for a running ``ktorch serve``: decode throughput per concurrency, time to first token with and
without a shared prefix, per-step times beside their floor, and a mixed load with correctness checks.

Talks to the server over HTTP only (aiohttp client, OpenAI's wire format), as any client would. Prompts are random
token ids (``"prompt": [ids]``), so it works with any tokenizer and no two streams share a prefix unless asked to.

    # on the device: the 48-layer Qwen3-30B-A3B-shaped model, experts in host memory
    ktorch serve --model /models/qwen3-30b-a3b-shaped --port 8000 &
    python benchmarks/bench_serve.py --url http://127.0.0.1:8000 --streams 1 16 64 --ttft-prefix 2000

    # per-step times beside their floor need a server run with --step-stats (eager steps, device synced each step)
    ktorch serve --model ... --port 8001 --step-stats &
    python benchmarks/bench_serve.py --url http://127.0.0.1:8001 --streams 1 16 64 --steps

    # the load test: 1,000 mixed requests, every completed greedy response compared with the same request alone
    python benchmarks/bench_serve.py --url http://127.0.0.1:8000 --load 1000 --streams 32

Prints tables and the machine; never asserts (mismatches and errors are counted and printed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import time
from typing import Optional

import aiohttp


class Client:
    def __init__(self, session: aiohttp.ClientSession, url: str, model: str):
        self.s, self.url, self.model = session, url.rstrip("/"), model

    async def get(self, path: str) -> dict:
        async with self.s.get(self.url + path) as r:
            return await r.json()

    async def complete(self, prompt: list[int], max_tokens: int, stream: bool = True, stop_after: Optional[int] = None,
                       **extra) -> dict:
        """One completion. Returns {"text", "tokens", "t0", "t_first", "times" (per streamed chunk), "status",
        "finish", "error"}; ``stop_after`` chunks: the client disconnects mid-stream."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
                **extra}
        if stream:
            body["stream_options"] = {"include_usage": True}
        out = {"text": "", "tokens": 0, "t0": time.perf_counter(), "t_first": None, "times": [], "status": None,
               "finish": None, "error": None}
        async with self.s.post(self.url + "/v1/completions", json=body) as r:
            out["status"] = r.status
            if r.status != 200:
                out["error"] = await r.text()
                return out
            if not stream:
                data = await r.json()
                out["t_first"] = time.perf_counter()
                out["text"] = data["choices"][0]["text"]
                out["finish"] = data["choices"][0]["finish_reason"]
                out["tokens"] = data["usage"]["completion_tokens"]
                return out
            chunks = 0
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    break
                data = json.loads(payload)
                if "error" in data:
                    out["error"] = data["error"]
                    break
                now = time.perf_counter()
                if data.get("usage"):
                    out["tokens"] = data["usage"]["completion_tokens"]
                for ch in data["choices"]:
                    out["t_first"] = out["t_first"] or now
                    out["times"].append(now)
                    out["text"] += ch["text"]
                    out["finish"] = ch["finish_reason"] or out["finish"]
                chunks += 1
                if stop_after is not None and chunks >= stop_after:
                    out["finish"] = "disconnected"
                    r.close()
                    break
        return out


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def read_bandwidth_gbs(gib: float = 2.0) -> float:
    """This machine's DRAM read bandwidth as torch's multi-threaded sum sees it (best of 3), GB/s."""
    import torch

    x = torch.ones(int(gib * (1 << 30)) // 8, dtype=torch.int64)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.nbytes / best / 1e9


async def throughput(c: Client, streams: int, prompt_len: int, max_tokens: int, vocab: int, rng: random.Random,
                     show_steps: bool, bandwidth: Optional[float]) -> None:
    prompts = [random_prompt(rng, prompt_len, vocab) for _ in range(streams)]
    before = await c.get("/v1/stats")
    outs = await asyncio.gather(*[c.complete(p, max_tokens) for p in prompts])
    after = await c.get("/v1/stats")
    bad = [o for o in outs if o["status"] != 200 or o["error"]]
    good = [o for o in outs if o not in bad]
    if not good:
        print(f"{streams:>7} | all {len(outs)} requests failed: {bad[0]['status']} {bad[0]['error']}")
        return
    # decode phase: from the last stream's first token (every prompt prefilled) to the last token
    t_lo = max(o["t_first"] for o in good)
    t_hi = max(o["times"][-1] for o in good)
    in_window = sum(sum(1 for t in o["times"] if t_lo < t <= t_hi) for o in good)
    agg = in_window / (t_hi - t_lo) if t_hi > t_lo else float("nan")
    total = sum(o["tokens"] for o in good)
    wall = max(o["times"][-1] for o in good) - min(o["t0"] for o in good)
    itl = [b - a for o in good for a, b in zip(o["times"], o["times"][1:])]
    ttft = [o["t_first"] - o["t0"] for o in good]
    print(f"{streams:>7} | {agg:>12.1f} | {total / wall:>10.1f} | {statistics.median(itl) * 1e3 if itl else 0:>12.2f} | "
          f"{statistics.median(ttft):>9.3f} | {len(bad):>6}")
    steps = after.get("steps", [])[len(before.get("steps", [])):] if show_steps else []
    decode_steps = [s for s in steps if s[0] == streams]
    if show_steps and decode_steps:
        secs = [s[1] for s in decode_steps]
        bytes_ = [s[3] for s in decode_steps]
        floor = [b / (bandwidth * 1e9) for b in bytes_] if bandwidth else [float("nan")] * len(bytes_)
        print(f"        steps of {streams} tokens: {len(decode_steps)}; median {statistics.median(secs) * 1e3:.2f} ms, "
              f"floor median {statistics.median(floor) * 1e3:.2f} ms (distinct experts median "
              f"{statistics.median(s[2] for s in decode_steps):.0f}, {statistics.median(bytes_) / 1e6:.1f} MB read)")
        for s, f in list(zip(decode_steps, floor))[:: max(1, len(decode_steps) // 8)]:
            print(f"          step: {s[1] * 1e3:8.2f} ms   floor {f * 1e3:8.2f} ms   experts {s[2]:5d}   "
                  f"{s[3] / 1e6:8.1f} MB")


async def ttft_prefix(c: Client, prefix_len: int, suffix_len: int, vocab: int, rng: random.Random) -> None:
    prefix = random_prompt(rng, prefix_len, vocab)
    first = await c.complete(prefix + random_prompt(rng, suffix_len, vocab), 8)
    shared = await c.complete(prefix + random_prompt(rng, suffix_len, vocab), 8)
    cold = await c.complete(random_prompt(rng, prefix_len + suffix_len, vocab), 8)
    for o in (first, shared, cold):
        if o["error"]:
            print(f"TTFT request failed: {o['status']} {o['error']}")
            return
    t1, t2, t3 = (o["t_first"] - o["t0"] for o in (first, shared, cold))
    print(f"\nTTFT, {prefix_len}-token shared prefix + {suffix_len} new tokens:")
    print(f"  first request (cold):           {t1 * 1e3:9.1f} ms")
    print(f"  second, same prefix (cached):   {t2 * 1e3:9.1f} ms  = {t2 / t1 * 100:.1f}% of the first")
    print(f"  unrelated prompt, same length:  {t3 * 1e3:9.1f} ms")


async def load(c: Client, n: int, concurrency: int, vocab: int, rng: random.Random, long_len: int) -> None:
    pool = [random_prompt(rng, rng.randint(8, 64), vocab) for _ in range(24)]
    pool += [random_prompt(rng, long_len + rng.randint(0, 64), vocab) for _ in range(8)]
    lengths = (8, 32)
    print(f"\nload: {n} requests, {concurrency} at a time; references: each (prompt, max_tokens) alone first ...")
    alone = {}
    for i, p in enumerate(pool):
        for m in lengths:
            alone[(i, m)] = (await c.complete(p, m, stream=False))["text"]
    idle = await c.get("/v1/stats")
    sem = asyncio.Semaphore(concurrency)
    counts = {"ok": 0, "mismatch": 0, "disconnected": 0, "http_error": 0, "stream_error": 0}
    examples = []

    async def one(k: int):
        i, m = rng.randrange(len(pool)), rng.choice(lengths)
        kind = k % 4  # 0: non-streamed, 1-2: streamed, 3: disconnects after 2 chunks
        async with sem:
            o = await c.complete(pool[i], m, stream=kind != 0, stop_after=2 if kind == 3 else None)
        if o["status"] != 200:
            counts["http_error"] += 1
            examples.append(("http", o["status"], o["error"]))
        elif o["error"]:
            counts["stream_error"] += 1
            examples.append(("stream", o["error"]))
        elif o["finish"] == "disconnected":
            counts["disconnected"] += 1
        elif o["text"] != alone[(i, m)]:
            counts["mismatch"] += 1
            examples.append(("mismatch", i, m))
        else:
            counts["ok"] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*[one(k) for k in range(n)])
    wall = time.perf_counter() - t0
    after = idle
    for _ in range(100):  # wait (bounded) for cancelled requests' pages to go back
        after = await c.get("/v1/stats")
        if after["requests_in_flight"] == 0 and after["kv_bytes_in_use"] == 0:
            break
        await asyncio.sleep(0.1)
    print(f"  {wall:.1f} s: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    for e in examples[:5]:
        print(f"  e.g. {e}")
    for key in ("requests_in_flight", "queued_prompt_tokens", "kv_bytes_in_use", "kv_bytes_prefix_cached", "rss_bytes"):
        print(f"  {key:24s} idle {idle.get(key)!s:>14}  after {after.get(key)!s:>14}")
    health = await c.get("/health")
    print(f"  /health after: {health}")


async def main_async(args) -> None:
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as s:
        model = args.model
        if model is None:
            model = (await Client(s, args.url, "").get("/v1/models"))["data"][0]["id"]
        c = Client(s, args.url, model)
        info = (await c.get("/v1/models"))["data"][0]
        rng = random.Random(args.seed)
        vocab = args.vocab
        print(f"server {args.url}: model {model} (context {info.get('max_model_len')}); client machine: "
              f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, python {platform.python_version()}")
        bandwidth = None
        if args.steps:
            bandwidth = args.read_gbs or read_bandwidth_gbs()
            print(f"read bandwidth for the floor: {bandwidth:.1f} GB/s "
                  f"({'given' if args.read_gbs else 'measured here: torch int64 sum over 2 GiB, best of 3'})")
        if args.streams and not args.load:
            await c.complete(random_prompt(rng, args.prompt_len, vocab), 4)  # warm-up (graph capture, ...)
            print(f"\ndecode throughput: prompts of {args.prompt_len} random tokens, max_tokens {args.max_tokens}, greedy")
            print(f"{'streams':>7} | {'decode tok/s':>12} | {'all tok/s':>10} | {'med ITL ms':>12} | {'med TTFT':>9} | "
                  f"{'errors':>6}")
            for n in args.streams:
                await throughput(c, n, args.prompt_len, args.max_tokens, vocab, rng, args.steps, bandwidth)
        if args.ttft_prefix:
            await ttft_prefix(c, args.ttft_prefix, args.ttft_suffix, vocab, rng)
        if args.load:
            await load(c, args.load, max(args.streams or [32]), vocab, rng, args.long_prompt)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (loopback or the project's hosts)")
    p.add_argument("--model", default=None, help="model id (default: the server's first)")
    p.add_argument("--vocab", type=int, default=4096, help="random prompt ids are drawn below this (default: %(default)s)")
    p.add_argument("--streams", type=int, nargs="*", default=[1, 16, 64], help="concurrent streams per row")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--steps", action="store_true", help="print per-step times beside their floor (server: --step-stats)")
    p.add_argument("--read-gbs", type=float, default=None, help="read bandwidth for the floor (default: measure here)")
    p.add_argument("--ttft-prefix", type=int, default=0, help="shared prefix length for the TTFT check (0: skip)")
    p.add_argument("--ttft-suffix", type=int, default=50)
    p.add_argument("--load", type=int, default=0, help="run a mixed load of this many requests instead")
    p.add_argument("--long-prompt", type=int, default=1024, help="length of the load's long prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600)
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
