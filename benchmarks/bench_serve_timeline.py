"""Where a `ktorch serve` request's time goes outside the model step: a timeline from the client's send to its
first streamed byte, and the host time around each decode step.

Two parts, one file. ``serve`` runs `ktorch serve` (the same arguments) with timestamps taken at each hand-off
(wrappers around the server's handler, transformers' continuous-batching manager and its batch processor; nothing
of ktorch or transformers is changed on disk) and one more route, ``GET /timeline``, which returns and clears
them. ``client`` drives it over HTTP: the shared-prefix TTFT pair of bench_serve.py (an unrelated prompt first, then
a prompt, then another with the same prefix) and a one-stream decode, and prints for the second request of each
pair the time of each phase, and for the decode the median of each per-step phase; timestamps of both processes
are ``time.perf_counter`` (CLOCK_MONOTONIC), so they compare across processes on one host.

    python benchmarks/bench_serve_timeline.py serve --model builtin --port 8000 &
    python benchmarks/bench_serve_timeline.py client --url http://127.0.0.1:8000 --prefix 2000 --suffix 8 --repeat 5

Benchmark variants of the server (options of ``serve`` taken out before the rest goes to `ktorch serve`; they select
earlier behaviour for A/B runs (RESULTS.md section 2, session 32) and are no user switches): ``--graph-kv-min N``, the
smallest cache-reads bucket of a graphed step (``ktorch.serve.engine.GRAPH_KV_MIN``; 4096: session 31's multiples
of 4096, and its warm-up); ``--eager-layers``, graphed steps captured with the decoder layers eager (session 31's
capture) instead of compiled regionally (``compiled_step_layers``).

Phases of the second request (the model step is compute + wait: the forward's launch, then the device's finish):
http (client send to the handler's start), parse (body, JSON, checks, tokens), submit (to the manager's queue,
until the generation thread takes it), schedule (prefix match, the batch), inputs (its tensors), compute,
wait (device sync), update (new tokens to the requests), hand-off (to the server's loop: call_soon_threadsafe and
the loop's turn), write (detokenize, the response's headers, the chunk's bytes), client (the chunk's send until the
client sees it).
A benchmark: prints, never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import threading
import time

EVENTS: list = []
_now = time.perf_counter


def _event(name: str) -> None:
    EVENTS.append((_now(), threading.current_thread() is threading.main_thread(), name))


def _wrap(cls, attr: str, tag: str) -> None:
    orig = getattr(cls, attr)

    def wrapped(*args, **kwargs):
        _event(tag + ">")
        try:
            return orig(*args, **kwargs)
        finally:
            _event(tag + "<")

    setattr(cls, attr, wrapped)


def _wrap_async(cls, attr: str, tag: str) -> None:
    orig = getattr(cls, attr)

    async def wrapped(*args, **kwargs):
        _event(tag + ">")
        try:
            return await orig(*args, **kwargs)
        finally:
            _event(tag + "<")

    setattr(cls, attr, wrapped)


def instrument() -> None:
    from aiohttp import web
    from transformers.generation.continuous_batching import continuous_api as ca
    from transformers.generation.continuous_batching import input_outputs as io
    from transformers.generation.continuous_batching import model_runner as mr

    import ktorch.serve.app as app

    _wrap_async(app.OpenAIServer, "completions", "handler")
    _wrap_async(app.OpenAIServer, "chat_completions", "handler")
    _wrap(ca.ContinuousBatchingManager, "add_request", "submit")
    _wrap(ca.ContinuousBatchProcessor, "_update_tp_group_state", "pickup")
    _wrap(ca.ContinuousBatchProcessor, "prepare_next_batch", "prepare")
    _wrap(io.ContinuousBatchingIOs, "prepare_batch_tensors", "inputs")
    _wrap(mr.ModelRunner, "compute_batch", "compute")
    _wrap(io.ContinuousBatchingIOs, "retrieve_device_outputs", "wait")
    _wrap(ca.ContinuousBatchProcessor, "update_batch", "update")
    _wrap(ca.OutputRouter, "deliver_batch", "deliver")
    _wrap_async(web.StreamResponse, "prepare", "headers")
    _wrap_async(web.StreamResponse, "write", "write")

    register = ca.ContinuousBatchingManager.register_result_handler

    def register_result_handler(self, request_id, callback):
        def on_loop(output):
            _event("on_loop")
            callback(output)

        return register(self, request_id, on_loop)

    ca.ContinuousBatchingManager.register_result_handler = register_result_handler

    make_app = app.OpenAIServer.make_app

    def make_app_with_timeline(self, *args, **kwargs):
        application = make_app(self, *args, **kwargs)

        async def timeline(request):
            out = list(EVENTS)
            EVENTS.clear()
            return web.json_response(out)

        application.router.add_get("/timeline", timeline)
        return application

    app.OpenAIServer.make_app = make_app_with_timeline


# ---------------------------------------------------------------- client


async def _complete(session, url: str, model: str, prompt: list, max_tokens: int) -> tuple:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0, first, times = _now(), None, []
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                now = _now()
                first = first or now
                times.append(now)
    return t0, first, times


def _first(events: list, name: str, after: float, main: bool | None = None) -> float | None:
    for t, on_main, n in events:
        if n == name and t >= after and (main is None or on_main == main):
            return t
    return None


def ttft_phases(t0: float, t_first: float, ev: list) -> dict | None:
    """The second request's phases (ms) from its events (times after the client's send)."""
    ev = [e for e in ev if e[0] >= t0]
    handler = _first(ev, "handler>", t0)
    submit = _first(ev, "submit>", t0)
    if None in (handler, submit):
        return None
    picked = _first(ev, "pickup<", submit, main=False)  # the generation thread drained the queue (after the put)
    compute = _first(ev, "compute>", picked or submit)
    computed = _first(ev, "compute<", compute or submit)
    waited = _first(ev, "wait<", computed or submit)
    update = _first(ev, "update>", waited or submit)
    deliver = _first(ev, "deliver>", update or submit)
    on_loop = _first(ev, "on_loop", deliver or submit)
    written = _first(ev, "write>", on_loop or submit, main=True)  # the chunk handed to the socket
    inputs = _first(ev, "inputs>", picked or submit)
    marks = [("http", t0, handler), ("parse", handler, submit), ("submit", submit, picked),
             ("schedule", picked, inputs), ("inputs", inputs, compute),
             ("compute", compute, computed), ("wait", computed, waited), ("update", waited, deliver),
             ("hand-off", deliver, on_loop), ("write", on_loop, written), ("client", written, t_first)]
    if any(a is None or b is None for _, a, b in marks):
        return None
    return {name: (b - a) * 1e3 for name, a, b in marks}


def decode_phases(ev: list, start: float) -> dict:
    """Median per decode step (ms): the step (compute + wait) and each host phase between two steps."""
    gen = [(t, n) for t, main, n in ev if t >= start and not main]
    steps = []  # (compute>, wait<, next compute>) with the events between
    opened = None
    for t, n in gen:
        if n == "compute>":
            if opened is not None:
                opened["next"] = t
                steps.append(opened)
            opened = {"compute>": t}
        elif opened is not None and n not in opened:
            opened[n] = t
    phases: dict = {}
    for s in steps:
        if not all(k in s for k in ("wait<", "update>", "update<", "inputs>", "next")):
            continue
        phases.setdefault("step (compute + wait)", []).append(s["wait<"] - s["compute>"])
        phases.setdefault("update + hand-off", []).append(s["update<"] - s["wait<"])
        phases.setdefault("schedule", []).append(s["inputs>"] - s["update<"])
        phases.setdefault("inputs", []).append(s["next"] - s["inputs>"])
        phases.setdefault("cycle", []).append(s["next"] - s["compute>"])
    return {k: statistics.median(v) * 1e3 for k, v in phases.items()} | {"steps": len(steps)}


async def client(args) -> None:
    import aiohttp

    rng = random.Random(args.seed)

    def prompt(n):
        return [rng.randrange(10, args.vocab) for _ in range(n)]

    url = args.url.rstrip("/")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        async with s.get(url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]

        async def timeline():
            async with s.get(url + "/timeline") as r:
                return await r.json()

        await _complete(s, url, model, prompt(args.prefix + args.suffix), 8)  # warm-up: the same length
        await _complete(s, url, model, prompt(32), 8)
        rows, ratios = [], []
        for _ in range(args.repeat):
            prefix = prompt(args.prefix)
            await timeline()
            t0, first, _ = await _complete(s, url, model, prefix + prompt(args.suffix), 8)
            t_first_request = first - t0
            await timeline()
            t0, first, _ = await _complete(s, url, model, prefix + prompt(args.suffix), 8)
            phases = ttft_phases(t0, first, await timeline())
            ratios.append((first - t0) / t_first_request)
            if phases is None:
                print("  (a timeline without every event: skipped)")
                continue
            phases["TTFT"] = (first - t0) * 1e3
            rows.append(phases)
        names = list(rows[0]) if rows else []
        print(f"\nsecond request's TTFT ({args.prefix}-token cached prefix + {args.suffix} new tokens), ms; median of "
              f"{len(rows)}; the ratio to the first request's TTFT median {statistics.median(ratios) * 100:.1f}%")
        for name in names:
            vals = [r[name] for r in rows]
            print(f"  {name:10s} {statistics.median(vals):9.2f}   (each: {' '.join(f'{v:.2f}' for v in vals)})")
        if rows:
            step = statistics.median(r["compute"] + r["wait"] for r in rows)
            print(f"  outside the step (compute + wait): {statistics.median(r['TTFT'] for r in rows) - step:.2f} ms "
                  f"(TTFT median minus step median)")
        await timeline()
        t0, first, times = await _complete(s, url, model, prompt(32), args.decode_tokens)
        ev = await timeline()
        d = decode_phases(ev, first)
        itl = statistics.median(b - a for a, b in zip(times, times[1:])) * 1e3
        print(f"\none-stream decode, {args.decode_tokens} tokens: client inter-token median {itl:.2f} ms; "
              f"{d.pop('steps')} steps, per step (median, ms):")
        for k, v in d.items():
            print(f"  {k:24s} {v:9.3f}")


def serve_variant(argv: list) -> list:
    """Applies the benchmark variants named in ``argv`` (``--graph-kv-min N``, ``--eager-layers``) to the serving
    engine's module and returns the other arguments, for `ktorch serve`."""
    import contextlib

    from ktorch.serve import engine

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--graph-kv-min", type=int, default=None)
    p.add_argument("--eager-layers", action="store_true")
    known, rest = p.parse_known_args(argv)
    if known.graph_kv_min is not None:
        if known.graph_kv_min < 1 or known.graph_kv_min & (known.graph_kv_min - 1) or \
                known.graph_kv_min > engine.GRAPH_KV_INTERVAL:
            raise SystemExit(f"--graph-kv-min {known.graph_kv_min}: a power of two up to {engine.GRAPH_KV_INTERVAL}")
        engine.GRAPH_KV_MIN = known.graph_kv_min
    if known.eager_layers:
        engine.compiled_step_layers = lambda model, cache: contextlib.nullcontext()
    print(f"[bench_serve_timeline] variant: cache-reads buckets from {engine.GRAPH_KV_MIN}, graphed steps' layers "
          f"{'eager' if known.eager_layers else 'compiled'}", file=sys.stderr, flush=True)
    return rest


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        rest = serve_variant(sys.argv[2:])
        instrument()
        from ktorch.cli import main as cli_main

        sys.exit(cli_main(["serve", *rest]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("role", choices=["client"], help="client (the server: 'serve' followed by ktorch serve's arguments)")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--prefix", type=int, default=2000)
    p.add_argument("--suffix", type=int, default=8)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    asyncio.run(client(p.parse_args()))


if __name__ == "__main__":
    main()
