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
    python benchmarks/bench_serve.py --url http://127.0.0.1:8000 --load 1000 --concurrency 32 --server-log serve.log

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
    def __init__(self, session: aiohttp.ClientSession, url: str, model: str, label: str = ""):
        self.s, self.url, self.model, self.label = session, url.rstrip("/"), model, label

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
                     show_steps: bool, bandwidth: Optional[float], one_stream: Optional[float] = None,
                     prompts: Optional[list] = None, label: str = "", outside: Optional[list] = None) -> float:
    """One row: ``streams`` concurrent greedy completions; returns the aggregate decode tok/s (``one_stream``: the
    1-stream figure the row is compared with; ``prompts``: these instead of new random ones; ``label``: printed
    before the row; ``outside``: gets the row's decode-step time outside the step, s, with ``show_steps``)."""
    prompts = prompts or [random_prompt(rng, prompt_len, vocab) for _ in range(streams)]
    before = await c.get("/v1/stats")
    outs = await asyncio.gather(*[c.complete(p, max_tokens) for p in prompts])
    after = await c.get("/v1/stats")
    bad = [o for o in outs if o["status"] != 200 or o["error"]]
    good = [o for o in outs if o not in bad]
    if not good:
        print(f"{label}{streams:>7} | all {len(outs)} requests failed: {bad[0]['status']} {bad[0]['error']}")
        return float("nan")
    # decode phase: from the last stream's first token (every prompt prefilled) to the last token
    t_lo = max(o["t_first"] for o in good)
    t_hi = max(o["times"][-1] for o in good)
    in_window = sum(sum(1 for t in o["times"] if t_lo < t <= t_hi) for o in good)
    agg = in_window / (t_hi - t_lo) if t_hi > t_lo else float("nan")
    total = sum(o["tokens"] for o in good)
    wall = max(o["times"][-1] for o in good) - min(o["t0"] for o in good)
    itl = [b - a for o in good for a, b in zip(o["times"], o["times"][1:])]
    ttft = [o["t_first"] - o["t0"] for o in good]
    ratio = f"{agg / one_stream:.2f}x" if one_stream else "-"
    steps_run = after.get("forwards", 0) - before.get("forwards", 0)
    replays = after.get("graph_replays", 0) - before.get("graph_replays", 0)
    per_step = f"{replays / steps_run:.2f}" if steps_run else "-"
    print(f"{label}{streams:>7} | {agg:>12.1f} | {ratio:>8} | {total / wall:>10.1f} | "
          f"{statistics.median(itl) * 1e3 if itl else 0:>12.2f} | {statistics.median(ttft):>9.3f} | {len(bad):>6} | "
          f"{per_step:>9} ({replays} of {steps_run} steps)")
    steps = after.get("steps", [])[len(before.get("steps", [])):] if show_steps else []
    decode_steps = [s for s in steps if s[0] == streams]
    if show_steps and decode_steps:
        secs = [s[1] for s in decode_steps]
        bytes_ = [s[3] for s in decode_steps]
        floor = [b / (bandwidth * 1e9) for b in bytes_] if bandwidth else [float("nan")] * len(bytes_)
        med_s, med_f = statistics.median(secs), statistics.median(floor)
        modes = {m: sum(1 for s in decode_steps if s[4:5] == [m]) for m in ("replay", "capture", "eager")}
        print(f"        steps of {streams} tokens: {len(decode_steps)} ({modes['replay']} graph replays, "
              f"{modes['capture']} captures, {modes['eager']} eager); median {med_s * 1e3:.2f} ms, floor median "
              f"{med_f * 1e3:.2f} ms ({med_f / med_s * 100:.0f}% of the step; floor tok/s {streams / med_f:.1f}); "
              f"distinct experts median {statistics.median(s[2] for s in decode_steps):.0f} over all MoE layers, "
              f"{statistics.median(bytes_) / 1e9:.2f} GB read")
        # a decode step every streams/agg seconds; what the step itself does not take is the server's host work
        cycle = streams / agg
        if outside is not None:
            outside.append(cycle - med_s)
        print(f"        a step every {cycle * 1e3:.2f} ms at {agg:.1f} tok/s: {(cycle - med_s) * 1e3:.2f} ms of it "
              f"outside the step (scheduling, inputs, output delivery, HTTP)")
        for s, f in list(zip(decode_steps, floor))[:: max(1, len(decode_steps) // 6)]:
            print(f"          step: {s[1] * 1e3:8.2f} ms   floor {f * 1e3:8.2f} ms   experts {s[2]:5d}   "
                  f"{s[3] / 1e6:8.1f} MB")
    return agg


def steps_to_first_token(steps: list, tokens_computed: int, completion_tokens: int) -> Optional[float]:
    """Seconds of a lone request's steps up to its first token: its prefill steps, which compute all its tokens but
    the ``completion_tokens - 1`` decode ones (``steps``: /v1/stats records over the request alone)."""
    prefill = tokens_computed - max(completion_tokens - 1, 0)
    total, seconds = 0, 0.0
    for st in steps:
        if total >= prefill:
            break
        total += st[0]
        seconds += st[1]
    return seconds if steps and total >= prefill else None


async def ttft_prefix(clients: list, prefix_len: int, suffix_len: int, vocab: int, rng: random.Random,
                      bandwidth: Optional[float] = None, repeat: int = 1) -> None:
    """Time to first token of a prompt, then of a second prompt sharing its first ``prefix_len`` tokens (its prefix
    pages cached). An unrelated prompt of the same length runs first, so that neither timed request pays the
    one-time costs of a new prompt length (staging buffers, first kernel loads). With a ``--step-stats`` server
    (``bandwidth`` given) each timed request's steps are printed beside their floor: the suffix's one step reads the
    experts its tokens route to, which bounds the second request's TTFT from below; and the second request's time
    outside its steps (TTFT minus the steps before its first token: HTTP, parsing, hand-offs, scheduling, output
    delivery, the client). ``repeat``: that many pairs, each with a new prefix; the medians are printed last.
    Several ``clients`` (servers, ``--compare``): each pair runs on each in turn, with the same prompts."""
    print(f"\nTTFT, {prefix_len}-token shared prefix + {suffix_len} new tokens:")
    warm_prompt = random_prompt(rng, prefix_len + suffix_len, vocab)
    for c in clients:
        warm = await c.complete(warm_prompt, 8)
        if warm["error"]:
            print(f"TTFT request failed: {warm['status']} {warm['error']}")
            return
        print(f"  {c.label}unrelated prompt, same length (warm-up): {(warm['t_first'] - warm['t0']) * 1e3:9.1f} ms")
    pairs: dict = {c.label: [] for c in clients}
    for _ in range(repeat):
        prefix = random_prompt(rng, prefix_len, vocab)
        prompts = [prefix + random_prompt(rng, suffix_len, vocab) for _ in range(2)]
        for c in clients:
            timed, records = [], []
            for prompt in prompts:
                before = await c.get("/v1/stats")
                timed.append(await c.complete(prompt, 8))
                after = await c.get("/v1/stats")
                records.append((after.get("steps", [])[len(before.get("steps", [])):], after.get("tokens_computed", 0)
                                - before.get("tokens_computed", 0)))
            if ttft_pair(timed, records, bandwidth, pairs[c.label], c.label):
                return
    if repeat > 1:
        med = statistics.median
        for c in clients:
            ps = pairs[c.label]
            line = (f"  {c.label}median of {repeat}: first {med(p[0] for p in ps) * 1e3:.1f} ms, second "
                    f"{med(p[1] for p in ps) * 1e3:.1f} ms, ratio {med(p[1] / p[0] for p in ps) * 100:.1f}%")
            if all(p[2] is not None for p in ps):
                line += (f"; second's steps {med(p[2] for p in ps) * 1e3:.1f} ms, outside them "
                         f"{med(p[1] - p[2] for p in ps) * 1e3:.1f} ms")
            print(line)


def ttft_pair(timed: list, records: list, bandwidth: Optional[float], pairs: list, label: str = "") -> bool:
    """Prints one TTFT pair and appends (first s, second s, second's steps s or None) to ``pairs``; True on failure."""
    first, shared = timed
    for o in (first, shared):
        if o["error"]:
            print(f"TTFT request failed: {o['status']} {o['error']}")
            return True
    t1, t2 = (o["t_first"] - o["t0"] for o in (first, shared))
    steps2 = steps_to_first_token(records[1][0], records[1][1], shared["tokens"]) if bandwidth else None
    pairs.append((t1, t2, steps2))
    print(f"  {label}first request:                           {t1 * 1e3:9.1f} ms  ({records[0][1]} tokens computed)")
    print(f"  {label}second, same prefix (cached):            {t2 * 1e3:9.1f} ms  = {t2 / t1 * 100:.1f}% of the first "
          f"({records[1][1]} tokens computed)")
    if steps2 is not None:
        print(f"    {label}second: its steps before the first token {steps2 * 1e3:.2f} ms, outside them "
              f"{(t2 - steps2) * 1e3:.2f} ms")
    if bandwidth:
        for name, (steps, _) in zip(("first", "second"), records):
            prefill = [st for st in steps if st[0] > 1][:8]
            for st in prefill:
                print(f"    {name}: prefill step of {st[0]:5d} tokens {st[1] * 1e3:8.2f} ms, floor "
                      f"{st[3] / (bandwidth * 1e9) * 1e3:8.2f} ms ({st[2]} experts, {st[3] / 1e9:.2f} GB"
                      f"{', ' + st[4] if len(st) > 4 else ''})")
    return False


LOAD_KINDS = ("plain", "plain", "stream", "stream", "stream", "stream-disconnect", "plain-disconnect", "seeded")


async def load(c: Client, n: int, concurrency: int, vocab: int, rng: random.Random, long_len: int,
               token_choices: tuple[int, ...] = (8, 32), n_short: int = 24, n_long: int = 8,
               server_log: Optional[str] = None, print_fn=print) -> dict:
    """A mixed load of ``n`` requests, ``concurrency`` at a time, over a pool of ``n_short`` short prompts (8-64
    random tokens) and ``n_long`` long ones (``long_len`` + 0-64 tokens), each with one of ``token_choices``
    max_tokens. Request k is of kind ``LOAD_KINDS[k % 8]``: non-streamed, streamed, streamed and disconnecting after 2
    chunks, non-streamed and disconnecting after 0-0.5 s, or streamed seeded sampling (temperature 0.8, the pool
    index as seed). The reference of every (prompt, max_tokens, greedy or seeded) is that request run alone, first,
    one at a time; each completed response is compared with it (text, finish reason, completion tokens).

    Server errors: 5xx answers, error events in streams, the server's own count (/v1/stats ``server_errors``) and,
    with ``server_log``, lines of that file from the load's start with a traceback or an ERROR. Memory: the server's
    /v1/stats at idle (after the references), its peak while loaded (sampled every 0.25 s) and once idle again.
    Returns the counts and the three stats; prints them (never asserts)."""
    pool = [random_prompt(rng, rng.randint(8, 64), vocab) for _ in range(n_short)]
    pool += [random_prompt(rng, long_len + rng.randint(0, 64), vocab) for _ in range(n_long)]
    print_fn(f"\nload: {n} requests, {concurrency} at a time, over {n_short} short prompts (8-64 tokens) and {n_long} "
             f"long ({long_len}-{long_len + 64}), max_tokens {'/'.join(map(str, token_choices))}; kinds "
             f"{', '.join(sorted(set(LOAD_KINDS)))}")
    t_ref = time.perf_counter()
    alone = {}
    for i, p in enumerate(pool):
        for m in token_choices:
            for seeded in (False, True):
                extra = dict(temperature=0.8, seed=i + 1) if seeded else {}
                o = await c.complete(p, m, stream=False, **extra)
                alone[(i, m, seeded)] = (o["text"], o["finish"], o["tokens"]) if o["status"] == 200 else None
    print_fn(f"  references: {len(alone)} requests alone in {time.perf_counter() - t_ref:.1f} s"
             f"{'' if all(alone.values()) else ' (some FAILED: those requests count as mismatches)'}")
    log_offset = os.path.getsize(server_log) if server_log and os.path.exists(server_log) else 0
    idle = await c.get("/v1/stats")
    sampled = ("rss_bytes", "cuda_memory_allocated", "kv_bytes_in_use", "kv_bytes_prefix_cached", "requests_in_flight",
               "queued_prompt_tokens")
    peak = {k: idle[k] for k in sampled if k in idle}
    sem = asyncio.Semaphore(concurrency)
    counts = {k: 0 for k in ("ok", "mismatch", "disconnected", "rate_limited", "http_4xx", "http_5xx",
                             "stream_error")}
    examples: list = []
    kind_ok: dict[str, int] = {}

    async def one(k: int):
        i, m = rng.randrange(len(pool)), rng.choice(token_choices)
        kind = LOAD_KINDS[k % len(LOAD_KINDS)]
        seeded = kind == "seeded"
        extra = dict(temperature=0.8, seed=i + 1) if seeded else {}
        async with sem:
            if kind == "plain-disconnect":
                try:  # the client gives up (its connection closes); a request done sooner is checked below
                    o = await asyncio.wait_for(c.complete(pool[i], m, stream=False), rng.uniform(0.0, 0.5))
                except asyncio.TimeoutError:
                    counts["disconnected"] += 1
                    return
            else:
                o = await c.complete(pool[i], m, stream=kind != "plain", stop_after=2 if kind == "stream-disconnect"
                                     else None, **extra)
        if o["status"] == 429:
            counts["rate_limited"] += 1
        elif o["status"] >= 500:
            counts["http_5xx"] += 1
            examples.append(("http", o["status"], o["error"]))
        elif o["status"] != 200:
            counts["http_4xx"] += 1
            examples.append(("http", o["status"], o["error"]))
        elif o["error"]:
            counts["stream_error"] += 1
            examples.append(("stream", o["error"]))
        elif o["finish"] == "disconnected":
            counts["disconnected"] += 1
        elif (o["text"], o["finish"], o["tokens"]) != alone[(i, m, seeded)]:
            counts["mismatch"] += 1
            examples.append(("mismatch", kind, i, m, (o["text"], o["finish"], o["tokens"]), alone[(i, m, seeded)]))
        else:
            counts["ok"] += 1
            kind_ok[kind] = kind_ok.get(kind, 0) + 1

    done = asyncio.Event()

    async def sample_peak():
        while not done.is_set():
            s = await c.get("/v1/stats")
            for key in sampled:
                if key in s:
                    peak[key] = max(peak.get(key, 0), s[key])
            try:
                await asyncio.wait_for(done.wait(), 0.25)
            except asyncio.TimeoutError:
                pass

    sampler = asyncio.create_task(sample_peak())
    t0 = time.perf_counter()
    await asyncio.gather(*[one(k) for k in range(n)])
    wall = time.perf_counter() - t0
    done.set()
    await sampler
    after = idle
    for _ in range(300):  # wait (bounded: 30 s) for cancelled requests' pages to go back
        after = await c.get("/v1/stats")
        if after["requests_in_flight"] == 0 and after["kv_bytes_in_use"] == 0:
            break
        await asyncio.sleep(0.1)
    log_errors = 0
    if server_log and os.path.exists(server_log):
        with open(server_log, errors="replace") as f:
            f.seek(log_offset)
            log_errors = sum(1 for line in f if "Traceback" in line or " ERROR " in line or "ERROR:" in line)
    server_errors = after.get("server_errors", 0) - idle.get("server_errors", 0)
    # the server answers the next request, correctly
    o = await c.complete(pool[0], token_choices[0], stream=False)
    next_ok = o["status"] == 200 and (o["text"], o["finish"], o["tokens"]) == alone[(0, token_choices[0], False)]
    health = await c.get("/health")
    print_fn(f"  {wall:.1f} s ({n / wall:.1f} requests/s): " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    print_fn(f"  correct by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(kind_ok.items())))
    print_fn(f"  server errors: {server_errors} (its /v1/stats count), "
             f"{log_errors if server_log else 'not read'} (log lines{f' of {server_log}' if server_log else ''})")
    for e in examples[:5]:
        print_fn(f"  e.g. {e}")
    print_fn(f"  {'':28s} {'idle':>14} {'peak':>14} {'after':>14}")
    for key in ("requests_in_flight", "queued_prompt_tokens", "requests_done", "requests_cancelled", "kv_bytes_in_use",
                "kv_bytes_prefix_cached", "rss_bytes", "cuda_memory_allocated"):
        if key in idle or key in after:
            print_fn(f"  {key:28s} {idle.get(key)!s:>14} {peak.get(key, '')!s:>14} {after.get(key)!s:>14}")
    print_fn(f"  next request after the load: {'correct' if next_ok else 'WRONG'}; /health: {health}")
    return dict(counts=counts, kind_ok=kind_ok, server_errors=server_errors, log_errors=log_errors, wall=wall,
                idle=idle, peak=peak, after=after, next_ok=next_ok, health=health)


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
        clients = [c]
        if args.compare:
            c.label = "A "
            clients.append(Client(s, args.compare, model, "B "))
            print(f"A: {args.url}, B: {args.compare} (the same requests on each in turn)")
        if args.streams and not args.load:
            for cl in clients:
                await cl.complete(random_prompt(rng, args.prompt_len, vocab), 4)  # warm-up (graph capture, ...)
            print(f"\ndecode throughput: prompts of {args.prompt_len} random tokens, max_tokens {args.max_tokens}, greedy")
            print(f"{'':{len(c.label)}}{'streams':>7} | {'decode tok/s':>12} | {'vs 1':>8} | {'all tok/s':>10} | "
                  f"{'med ITL ms':>12} | {'med TTFT':>9} | {'errors':>6} | graph replays per step")
            one: dict = {}
            rates: dict = {cl.label: {} for cl in clients}
            outside: dict = {cl.label: {} for cl in clients}
            for n in args.streams:
                prompts = [random_prompt(rng, args.prompt_len, vocab) for _ in range(n)]
                for cl in clients:
                    agg = await throughput(cl, n, args.prompt_len, args.max_tokens, vocab, rng, args.steps, bandwidth,
                                           one_stream=one.get(cl.label) if n != 1 else None, prompts=prompts,
                                           label=cl.label, outside=outside[cl.label].setdefault(n, []))
                    rates[cl.label].setdefault(n, []).append(agg)
                    if n == 1:
                        one[cl.label] = agg
            if args.compare:
                for n in sorted(set(args.streams)):
                    for cl in clients:
                        out = outside[cl.label][n]
                        rate = statistics.median(rates[cl.label][n])
                        print(f"  {cl.label}{n} streams: decode tok/s median {rate:.1f} over {len(rates[cl.label][n])} "
                              f"rows" + (f", outside the step median {statistics.median(out) * 1e3:.2f} ms" if out else ""))
        if args.ttft_prefix:
            for suffix in args.ttft_suffix:
                await ttft_prefix(clients, args.ttft_prefix, suffix, vocab, rng, bandwidth, args.ttft_repeat)
        if args.load:
            await load(c, args.load, args.concurrency, vocab, rng, args.long_prompt, tuple(args.load_tokens),
                       server_log=args.server_log)


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
    p.add_argument("--ttft-suffix", type=int, nargs="+", default=[50],
                   help="new tokens after the shared prefix; several: one TTFT pair each (default: 50)")
    p.add_argument("--compare", default=None, metavar="URL",
                   help="a second server of the same model: the decode rows and TTFT pairs run on each in turn "
                        "(A: --url, B: this), with the same prompts, and the medians of each are printed")
    p.add_argument("--ttft-repeat", type=int, default=1,
                   help="TTFT pairs per suffix length, each with a new prefix; more than 1 prints their medians")
    p.add_argument("--load", type=int, default=0, help="run a mixed load of this many requests instead")
    p.add_argument("--long-prompt", type=int, default=1024, help="length of the load's long prompts")
    p.add_argument("--load-tokens", type=int, nargs="+", default=[8, 32], help="the load's max_tokens choices")
    p.add_argument("--concurrency", type=int, default=32, help="the load's requests in flight at once")
    p.add_argument("--server-log", default=None,
                   help="the server's stderr file: the load counts its traceback / ERROR lines as server errors")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600)
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
