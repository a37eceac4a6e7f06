"""The HTTP front end: OpenAI-compatible completions and chat, health, metrics.

Bad input is answered with HTTP 400 and an OpenAI-style error body; the engine keeps serving.
While draining (SIGTERM/SIGINT) new requests get 503 and in-flight ones finish.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from atom.serve.engine_loop import Delta, EngineLoop, RequestStream
from atom.serve.protocol import ChatCompletionRequest, CompletionRequest, render_chat
from atom.tokenizer import Tokenizer

log = logging.getLogger("atom.serve")


@dataclass
class ServerState:
    loop: EngineLoop
    tokenizer: Tokenizer
    model_name: str
    default_max_tokens: int = 256
    tier_health: Callable[[], dict] = lambda: {"attached": False}
    draining: bool = False
    started: float = field(default_factory=time.time)
    http_requests: dict[tuple[str, int], int] = field(default_factory=dict)


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status == 400 else "server_error"
    if status == 503:
        kind = "service_unavailable"
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


class _Stopper:
    """Applies stop strings to the decoded text, holding back what could start one."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str]):
        self.tok, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0
        self.stopped = False

    def feed(self, ids: list[int], final: bool) -> str:
        self.ids.extend(ids)
        text = self.tok.decode(self.ids)
        for s in self.stops:
            at = text.find(s)
            if at >= 0:
                text, final, self.stopped = text[:at], True, True
        limit = len(text) if final else max(self.sent, len(text) - self.hold)
        if not final:
            while limit > self.sent and text[limit - 1] == "\ufffd":  # an unfinished utf-8
                limit -= 1
        out, self.sent = text[self.sent : limit], max(self.sent, limit)
        return out


def build_app(state: ServerState, on_shutdown: Callable[[], None] | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        import asyncio

        state.loop.start(asyncio.get_running_loop())
        yield
        state.draining = True
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="atom", lifespan=lifespan)

    @app.middleware("http")
    async def count(request: Request, call_next):
        response = await call_next(request)
        key = (request.url.path, response.status_code)
        state.http_requests[key] = state.http_requests.get(key, 0) + 1
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        msgs = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"] if p != "body")
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = "unknown field"
            if err["type"] == "json_invalid":
                msg = f"malformed JSON: {err.get('ctx', {}).get('error', msg)}"
            msgs.append(f"{loc}: {msg}" if loc else msg)
        return error_response(400, "; ".join(msgs) or "invalid request")

    @app.get("/health")
    async def health():
        body = {
            "status": "ok" if state.loop.alive and not state.draining else "unavailable",
            "model": state.model_name,
            "draining": state.draining,
            "uptime_s": round(time.time() - state.started, 1),
            "engine": state.loop.engine.stats() if state.loop.alive else None,
            "tier": state.tier_health(),
        }
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.get("/metrics")
    async def metrics():
        lines = [state.loop.engine.metrics.render()]
        lines.append("# HELP atom_http_requests_total HTTP requests by path and status.")
        lines.append("# TYPE atom_http_requests_total counter")
        for (path, status), n in sorted(state.http_requests.items()):
            lines.append(f'atom_http_requests_total{{path="{path}",status="{status}"}} {n}')
        tier = state.tier_health()
        lines.append("# HELP atom_tier_healthy 1 when the LMCache tier is attached and healthy.")
        lines.append("# TYPE atom_tier_healthy gauge")
        lines.append(f"atom_tier_healthy {1 if tier.get('healthy') else 0}")
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": int(state.started),
                    "owned_by": "atom",
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompt = body.prompt
        ids = state.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return await _serve(body, ids, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        ids = state.tokenizer.encode(render_chat(body.messages))
        return await _serve(body, ids, request, chat=True)

    async def _serve(body, ids: list[int], request: Request, chat: bool):
        if state.draining or not state.loop.alive:
            return error_response(503, "the server is shutting down; retry on another replica")
        if body.model != state.model_name:
            return error_response(
                400,
                f"model {body.model!r} is not served here; this server serves "
                f"{state.model_name!r}",
                "model",
            )
        params = body.sampling_params(state.default_max_tokens)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        stream = state.loop.submit(rid, ids, params, state.tokenizer.eos_token_id)
        first = await stream.queue.get()
        if first.error:
            return error_response(400, first.error)
        stopper = _Stopper(state.tokenizer, body.stops)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            gen = _sse(stream, first, stopper, body, rid, chat, request, include_usage)
            return StreamingResponse(gen, media_type="text/event-stream")
        text, delta = "", first
        while True:
            text += stopper.feed(delta.token_ids, delta.finished)
            if delta.finished or stopper.stopped:
                break
            delta = await stream.queue.get()
        if stopper.stopped and not delta.finished:
            state.loop.abort(rid)
        reason = "stop" if stopper.stopped else delta.finish_reason
        if reason == "error":
            return error_response(500, delta.error or "engine failure")
        seq = stream.seq or delta.seq
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
            if chat
            else {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        )
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": state.model_name,
            "choices": [choice],
            "usage": _usage(seq, len(stopper.ids)),
        }

    async def _sse(
        stream: RequestStream,
        first: Delta,
        stopper: _Stopper,
        body,
        rid: str,
        chat: bool,
        request: Request,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, reason: str | None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else {}
                if text:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
            payload = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": state.model_name,
                "choices": [choice],
            }
            return f"data: {json.dumps(payload)}\n\n"

        if chat:
            yield chunk(None, None, role=True)
        delta = first
        try:
            while True:
                text = stopper.feed(delta.token_ids, delta.finished)
                done = delta.finished or stopper.stopped
                if text:
                    yield chunk(text, None)
                if done:
                    break
                if await request.is_disconnected():
                    state.loop.abort(rid)
                    return
                delta = await stream.queue.get()
        finally:
            if not delta.finished:
                state.loop.abort(rid)
        reason = "stop" if stopper.stopped else delta.finish_reason
        yield chunk(None, reason)
        if include_usage:
            payload = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": state.model_name,
                "choices": [],
                "usage": _usage(stream.seq or delta.seq, len(stopper.ids)),
            }
            yield f"data: {json.dumps(payload)}\n\n"
        yield "data: [DONE]\n\n"

    return app


def _usage(seq, completion_tokens: int) -> dict:
    c = seq.counters
    return {
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": c.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": c.hbm_hit_tokens + c.tier_hit_tokens,
            "hbm_tokens": c.hbm_hit_tokens,
            "tier_tokens": c.tier_hit_tokens,
            "computed_tokens": c.computed_prompt_tokens,
        },
    }
