"""What the serve tests share: prompts run through an in-process ``ServeEngine`` (tests/test_serve.py,
tests/test_serve_cuda.py)."""

from __future__ import annotations

import asyncio

from ktorch.serve import SamplingParams


async def generated(engine, ids, max_tokens: int, timeout: float = 60.0) -> list:
    """One request to a started ``engine``: its generated tokens; sending nothing for ``timeout`` seconds fails the
    test (asyncio.TimeoutError)."""
    _, q = await engine.submit(ids, SamplingParams(max_tokens))
    while not (out := await asyncio.wait_for(q.get(), timeout)).is_finished():
        pass
    return out.generated_tokens


async def collect(engine, prompts, max_tokens: int, timeout: float = 60.0) -> list:
    """Every prompt (token ids) submitted at once; each one's generated tokens, in prompt order."""
    return await asyncio.gather(*[generated(engine, p, max_tokens, timeout) for p in prompts])


def run_engine(engine, prompts, max_tokens: int, hooks=(), timeout: float = 60.0) -> list:
    """Starts ``engine``, runs ``collect``, then stops it and removes ``hooks`` (forward hooks the caller set to
    watch the run), whatever happened."""
    engine.start()
    try:
        return asyncio.run(collect(engine, prompts, max_tokens, timeout))
    finally:
        engine.stop()
        for h in hooks:
            h.remove()
