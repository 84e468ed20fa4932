"""The OpenAI-compatible HTTP face of ``ktorch serve`` (aiohttp).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streamed as server-sent events with
``"stream": true``: ``data: {chunk}`` lines, then ``data: [DONE]``), ``GET /v1/models``, ``GET /v1/models/{id}``,
``GET /health`` and ``GET /v1/stats`` (ktorch's counters: requests in flight, tokens computed, KV pool use, recent
step times). Parameters: ``max_tokens`` (chat: also ``max_completion_tokens``), ``temperature`` (0: greedy),
``top_p``, ``stop`` (a string or up to 4), ``seed``, ``stream``, ``stream_options.include_usage``; ``n`` must be 1.
Every error is OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status for bad input
(400 malformed JSON, bad values, prompt past the context; 404 unknown model or route; 429 the engine is full) and
500 for a failure of the server itself. A streamed request gets its status and headers as soon as the engine
admits it (while its first token is computed); a failure after that is an error event in the stream. A client that
disconnects stops its request, whose KV pages go back to the pool at the next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from aiohttp import web

from ktorch.serve.engine import AdmissionError, SamplingParams, ServeEngine

log = logging.getLogger("ktorch.serve")

MAX_STOP_STRINGS = 4
WATCH_SECONDS = 0.5  # how often waiting requests are checked for a client gone (or a stopped generation loop)
_WAKE = object()  # put on a request's output queue by _watch: check the client, then wait on
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> web.Response:
        return error_response(self.status, self.message, self.type, self.param, self.code)


def error_response(status: int, message: str, type_: str, param: Optional[str] = None,
                   code: Optional[str] = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": type_, "param": param, "code": code}},
                             status=status)


class ClientGone(Exception):
    pass


SERVER_ERRORS = web.AppKey("server_errors", list)  # [count] of 5xx answers and error events (GET /v1/stats)


def _count_server_error(request: web.Request) -> None:
    counter = request.app.get(SERVER_ERRORS)
    if counter is not None:
        counter[0] += 1


@web.middleware
async def errors_as_json(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as e:
        if e.status >= 500:
            _count_server_error(request)
        return e.response()
    except web.HTTPException as e:  # unknown route, wrong method, body too large: OpenAI's shape too
        if e.status < 400:
            raise
        return error_response(e.status, f"{request.method} {request.path}: {e.reason}",
                              "invalid_request_error" if e.status < 500 else "server_error",
                              code={404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status))
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as e:  # a bug or a failed generation loop: the server goes on with the next request
        log.exception("ktorch serve: %s %s failed", request.method, request.path)
        _count_server_error(request)
        return error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error")


# ---------------------------------------------------------------- parameter checks


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise APIError(400, f"'{name}' must be a number, got {v!r}", param=name, code="invalid_type")
    if v < lo or v > hi or (lo_open and v == lo):
        raise APIError(400, f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", param=name,
                       code="invalid_value")
    return float(v)


def _integer(body: dict, name: str, lo: Optional[int] = None) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise APIError(400, f"'{name}' must be an integer, got {v!r}", param=name, code="invalid_type")
    if lo is not None and v < lo:
        raise APIError(400, f"'{name}' must be >= {lo}, got {v}", param=name, code="invalid_value")
    return v


def _stops(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v) or len(v) > MAX_STOP_STRINGS:
        raise APIError(400, f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings, got {v!r}",
                       param="stop", code="invalid_value")
    if any(s == "" for s in v):
        raise APIError(400, "'stop' strings must not be empty", param="stop", code="invalid_value")
    return v


def _bool(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise APIError(400, f"'{name}' must be true or false, got {v!r}", param=name, code="invalid_type")
    return v


class IncrementalDetokenizer:
    """The text of a growing list of generated tokens, decoding a short window per new token instead of the whole
    list (which would cost O(length) per token, on the event loop, beside the generation thread): the text of
    tokens[prefix:] minus that of tokens[prefix:read], the two windows starting on the same token so that a
    tokenizer's handling of a leading space cancels out; tokens that end in an incomplete UTF-8 sequence wait for
    the next one."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0

    def update(self, tokens: list[int], final: bool = False) -> str:
        decode = self.tokenizer.decode
        prefix_text = decode(tokens[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        new_text = decode(tokens[self.prefix_offset:], skip_special_tokens=True)
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            self.text += new_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(tokens)
        return self.text


class SSEChunks:
    """The server-sent events of one streamed completion, as bytes (``data: {json}`` and a blank line).

    A chunk that carries only new text (every chunk but chat's first and the last) is rendered from a template made
    once per response: the JSON before and after the text, so that per token only the text is JSON-encoded. The bytes
    equal ``json.dumps`` of the whole chunk (tests/test_serve.py checks)."""

    _MARK = "\x00ktorch-text\x00"  # cannot occur in the id or the model name

    def __init__(self, rid: str, obj: str, created: int, model: str, chat: bool, include_usage: bool):
        self.rid, self.obj, self.created, self.model, self.chat = rid, obj, created, model, chat
        self.include_usage = include_usage
        parts = json.dumps(self.payload(self._MARK, None)).split(json.dumps(self._MARK))
        if len(parts) != 2:
            raise ValueError(f"SSEChunks: the text marker appears {len(parts) - 1} times in a chunk")
        self.head, self.tail = b"data: " + parts[0].encode(), parts[1].encode() + b"\n\n"

    def payload(self, text: Optional[str], reason: Optional[str], first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        payload = self._envelope([choice])
        if self.include_usage:
            payload["usage"] = None
        return payload

    def event(self, text: Optional[str], reason: Optional[str], first: bool = False) -> bytes:
        if text and reason is None and not first:
            return self.head + json.dumps(text).encode() + self.tail
        return b"data: " + json.dumps(self.payload(text, reason, first)).encode() + b"\n\n"

    def usage(self, usage: dict) -> bytes:
        return b"data: " + json.dumps({**self._envelope([]), "usage": usage}).encode() + b"\n\n"

    def _envelope(self, choices: list) -> dict:
        return {"id": self.rid, "object": self.obj, "created": self.created, "model": self.model, "choices": choices}


# ---------------------------------------------------------------- the server


class OpenAIServer:
    def __init__(self, engine: ServeEngine, tokenizer, model_name: str):
        self._waiting: dict[str, tuple[asyncio.Queue, web.Request]] = {}  # request id -> its outputs, its request
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.created = int(time.time())
        eos = engine.manager.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None, -1}

    def make_app(self, client_max_size: int = 16 << 20) -> web.Application:
        app = web.Application(middlewares=[errors_as_json], client_max_size=client_max_size)
        app[SERVER_ERRORS] = [0]
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id:.+}", self.model_info)
        app.router.add_get("/v1/stats", self.stats)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self.engine.start()
        self._janitor = asyncio.get_running_loop().create_task(self._watch())

    async def _on_cleanup(self, app: web.Application) -> None:
        self._janitor.cancel()
        await asyncio.get_running_loop().run_in_executor(None, self.engine.stop)

    async def _watch(self) -> None:
        """Every ``WATCH_SECONDS``: wakes each waiting request whose client is gone (or whose generation loop
        stopped), so that its handler stops it, and drops outputs of requests already forgotten. One timer for all
        requests instead of a timeout per awaited output."""
        while True:
            await asyncio.sleep(WATCH_SECONDS)
            healthy = self.engine.healthy()
            for q, request in list(self._waiting.values()):
                transport = request.transport
                if not healthy or transport is None or transport.is_closing():
                    q.put_nowait(_WAKE)
            self.engine.drain_orphan_outputs()

    # ------------------------------------------------------------ simple routes

    async def health(self, request: web.Request) -> web.Response:
        if not self.engine.healthy():
            err = self.engine.manager.background_thread_status.fatal_error
            return error_response(503, f"the generation loop is not running{f': {err}' if err else ''}",
                                  "server_error")
        return web.json_response({"status": "ok", "model": self.model_name})

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "ktorch",
                "max_model_len": self.engine.context_length}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model_info(self, request: web.Request) -> web.Response:
        model_id = request.match_info["model_id"]
        if model_id != self.model_name:
            raise APIError(404, f"The model '{model_id}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        return web.json_response(self._model_card())

    async def stats(self, request: web.Request) -> web.Response:
        stats = self.engine.stats()
        stats["server_errors"] = request.app[SERVER_ERRORS][0]
        stats["steps"] = [[s.tokens, round(s.seconds, 6), s.distinct_experts, s.expert_bytes, s.mode]
                          for s in list(self.engine.steps)]
        return web.json_response(stats)

    # ------------------------------------------------------------ request parsing

    async def _body(self, request: web.Request) -> dict:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}",
                           code="invalid_json")
        model = body.get("model")
        if not isinstance(model, str):
            raise APIError(400, "'model' is required (a string)", param="model", code="missing_model")
        if model != self.model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        n = _integer(body, "n", lo=1)
        if n not in (None, 1):
            raise APIError(400, f"'n' must be 1 (one choice per request), got {n}", param="n", code="invalid_value")
        return body

    def _sampling(self, body: dict, prompt_len: int, default_max: Optional[int], max_name: str) -> SamplingParams:
        ctx = self.engine.context_length
        if prompt_len == 0:
            raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
        if ctx and prompt_len >= ctx:
            raise APIError(400, f"the prompt has {prompt_len} tokens; this model's context is {ctx} tokens",
                           param="messages" if max_name == "max_completion_tokens" else "prompt",
                           code="context_length_exceeded")
        max_tokens = _integer(body, max_name, lo=1) if body.get(max_name) is not None else _integer(body, "max_tokens", lo=1)
        if max_tokens is None:
            max_tokens = default_max if default_max is not None else (ctx - prompt_len if ctx else 256)
            if ctx:
                max_tokens = min(max_tokens, ctx - prompt_len)
        elif ctx and prompt_len + max_tokens > ctx:
            raise APIError(400, f"the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds this model's "
                           f"context of {ctx} tokens", param="max_tokens", code="context_length_exceeded")
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
        seed = _integer(body, "seed")
        return SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)

    def _completion_prompt(self, body: dict) -> list[int]:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # one prompt in a list
        if isinstance(p, str):
            return self._encode(p)
        if isinstance(p, list) and p and set(map(type, p)) == {int}:  # JSON integers (true/false are bool)
            vocab = self.engine.model.config.get_text_config().vocab_size
            if min(p) < 0 or max(p) >= vocab:
                bad = [t for t in p if t < 0 or t >= vocab]
                raise APIError(400, f"prompt token ids must be in [0, {vocab}), got {bad[:4]}", param="prompt",
                               code="invalid_value")
            return list(p)
        raise APIError(400, "'prompt' must be a string, a list of token ids, or a list holding one of those "
                       "(several prompts per request are not supported)", param="prompt", code="invalid_value")

    def _encode(self, text: str) -> list[int]:
        ids = self.tokenizer(text).input_ids
        if hasattr(ids, "tolist"):  # a tokenizer stand-in (GGUF files without one) gives a [1, P] tensor
            ids = ids.tolist()
        return list(ids[0] if ids and isinstance(ids[0], list) else ids)

    def _chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' must be a non-empty list", param="messages", code="invalid_value")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
                raise APIError(400, f"messages[{i}] must be an object with a role system|developer|user|assistant|tool",
                               param=f"messages[{i}]", code="invalid_value")
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                           for c in content):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported",
                                   param=f"messages[{i}].content", code="invalid_value")
                content = "".join(c["text"] for c in content)
            if not isinstance(content, str):
                raise APIError(400, f"messages[{i}].content must be a string or a list of text parts",
                               param=f"messages[{i}].content", code="invalid_value")
            clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions",
                           param="messages", code="no_chat_template")
        try:
            enc = self.tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=True, return_dict=True)
        except Exception as e:  # the template's own checks (role order, ...)
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages",
                           code="invalid_value") from None
        return list(enc["input_ids"])

    # ------------------------------------------------------------ generation

    async def _next_output(self, q: asyncio.Queue, request: web.Request):
        """The request's next output. The connection is checked at every output and whenever ``_watch`` wakes the
        request (every ``WATCH_SECONDS`` while its client is gone or the generation loop stopped): a non-streamed
        request writes nothing until it ends, so only this check sees its client go."""
        while True:
            out = await q.get()
            transport = request.transport
            if transport is None or transport.is_closing():
                raise ClientGone() from None
            if out is not _WAKE:
                return out
            if not self.engine.healthy():
                raise APIError(500, "the generation loop stopped", "server_error") from None

    async def _generate(self, request: web.Request, prompt_ids: list[int], params: SamplingParams,
                        stops: list[str], info: dict,
                        on_admitted: Optional[Callable[[], Awaitable[None]]] = None
                        ) -> AsyncIterator[tuple[str, Optional[str]]]:
        """Yields (new text, None) pieces, then ("", finish_reason) or (last text, finish_reason).
        ``info["completion_tokens"]`` counts the tokens generated; ``on_admitted`` is awaited once the engine took
        the request (a stream sends its headers then, while the first token is computed)."""
        try:
            request_id, q = await self.engine.submit(prompt_ids, params)
        except AdmissionError as e:
            raise APIError(429, str(e), "rate_limit_error", code="rate_limit_exceeded") from None
        self._waiting[request_id] = (q, request)
        done = False
        detok = IncrementalDetokenizer(self.tokenizer)
        emitted = 0
        holdback = max((len(s) for s in stops), default=1) - 1
        try:
            if on_admitted is not None:
                await on_admitted()
            while True:
                out = await self._next_output(q, request)
                if out.error is not None:
                    raise APIError(500, f"generation failed: {out.error}", "server_error")
                tokens = out.generated_tokens
                info["completion_tokens"] = len(tokens)
                text = detok.update(tokens, final=out.is_finished())
                cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
                if cut >= 0:
                    done = True
                    self.engine.cancel(request_id)
                    yield text[emitted:cut] if cut > emitted else "", "stop"
                    return
                if out.is_finished():
                    done = True
                    reason = "stop" if tokens and tokens[-1] in self.eos_ids else "length"
                    yield text[emitted:], reason
                    return
                safe = len(text) - holdback
                while safe > emitted and text[safe - 1] == "\ufffd":  # an incomplete UTF-8 sequence: wait
                    safe -= 1
                if safe > emitted:
                    yield text[emitted:safe], None
                    emitted = safe
        finally:
            self._waiting.pop(request_id, None)
            if not done:
                self.engine.cancel(request_id)

    def _usage(self, prompt_len: int, info: dict) -> dict:
        c = info.get("completion_tokens", 0)
        return {"prompt_tokens": prompt_len, "completion_tokens": c, "total_tokens": prompt_len + c}

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        prompt_ids = self._completion_prompt(body)
        return await self._respond(request, body, prompt_ids, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        prompt_ids = self._chat_prompt(body)
        return await self._respond(request, body, prompt_ids, chat=True)

    async def _respond(self, request: web.Request, body: dict, prompt_ids: list[int], chat: bool) -> web.StreamResponse:
        params = self._sampling(body, len(prompt_ids), None if chat else DEFAULT_COMPLETION_TOKENS,
                                "max_completion_tokens" if chat else "max_tokens")
        stops = _stops(body)
        stream = _bool(body, "stream")
        opts = body.get("stream_options")
        if opts is not None and (not isinstance(opts, dict) or not stream):
            raise APIError(400, "'stream_options' must be an object and needs 'stream': true",
                           param="stream_options", code="invalid_value")
        include_usage = bool((opts or {}).get("include_usage", False))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        info: dict[str, Any] = {}

        if not stream:
            gen = self._generate(request, prompt_ids, params, stops, info)
            pieces, reason = [], None
            try:
                async for text, reason in gen:
                    pieces.append(text)
            except ClientGone:
                return web.Response(status=499)
            text = "".join(pieces)
            usage = self._usage(len(prompt_ids), info)
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                          "finish_reason": reason}
                return web.json_response({"id": rid, "object": "chat.completion", "created": created,
                                          "model": self.model_name, "choices": [choice], "usage": usage})
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            return web.json_response({"id": rid, "object": "text_completion", "created": created,
                                      "model": self.model_name, "choices": [choice], "usage": usage})

        sse = SSEChunks(rid, "chat.completion.chunk" if chat else "text_completion", created, self.model_name, chat,
                        include_usage)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})

        async def start_stream() -> None:  # admitted (no 429): the status and headers go out during the first step
            await resp.prepare(request)

        gen = self._generate(request, prompt_ids, params, stops, info, on_admitted=start_stream)
        # one write per output: chat's role chunk goes with the first text, and the last text, the usage and [DONE]
        # go with the end of the body (so that a client that stops reading at [DONE] has the whole response, and
        # its connection can serve its next request)
        pending = sse.event(None, None, first=True) if chat else b""
        try:
            async for text, reason in gen:
                if text or reason:
                    pending += sse.event(text, reason)
                if reason is not None:
                    break
                if pending:
                    await resp.write(pending)
                    pending = b""
            if include_usage:
                pending += sse.usage(self._usage(len(prompt_ids), info))
            pending += b"data: [DONE]\n\n"
        except (ClientGone, ConnectionResetError):
            await gen.aclose()
            return resp if resp.prepared else web.Response(status=499)
        except APIError as e:
            await gen.aclose()
            if not resp.prepared:  # refused before the stream began (429): a JSON error
                raise
            if e.status >= 500:  # after the headers: an error event, as OpenAI streams do
                _count_server_error(request)
            err = {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}
            try:
                await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
            except ConnectionResetError:
                pass
            return resp
        finally:
            await gen.aclose()
        await resp.write_eof(pending)
        return resp
