"""What the serve tests share: prompts run through an in-process ``ServeEngine`` (tests/test_serve.py,
tests/test_serve_cuda.py)."""

from __future__ import annotations

import asyncio

from ktorch.serve import SamplingParams


async def collect(engine, prompts, max_tokens: int, timeout: float = 60.0) -> list:
    """Submits every prompt (token ids) at once to a started ``engine`` and returns each one's generated tokens, in
    prompt order; a request that sends nothing for ``timeout`` seconds fails the test (asyncio.TimeoutError)."""
    async def one(ids):
        _, q = await engine.submit(ids, SamplingParams(max_tokens))
        while not (out := await asyncio.wait_for(q.get(), timeout)).is_finished():
            pass
        return out.generated_tokens

    return await asyncio.gather(*[one(p) for p in prompts])
