"""The HTTP front end: OpenAI-compatible completions and chat, vLLM's extra endpoints, health,
metrics.

Every error is OpenAI's error JSON (``{"error": {"message", "type", "param", "code"}}``): bad
input is a 4xx whose message names the field, the value and what is allowed, and the engine
keeps serving; an unexpected exception is a 500 in the same shape (a bug: the log has the
traceback). Every response is counted in ``atom_http_requests_total``. While draining
(SIGTERM/SIGINT) the server keeps accepting connections: new generation requests get 503,
/health answers 503 with ``"status": "draining"``, and in-flight requests finish.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from atom.serve.chat_template import render_chat
from atom.serve.edge import (
    HeadAsGet,
    _Edge,
    _next_delta,
    _wait_disconnect,
    error_response,
    validation_message,
)
from atom.serve.protocol import ChatCompletionRequest, CompletionRequest
from atom.serve.rendering import _Choice, _Output, _prompt_seqs, _Stopper, _usage
from atom.serve.routes import add_operation_routes, server_version, unknown_model
from atom.serve.state import ServerState

log = logging.getLogger("atom.serve")


def build_app(state: ServerState, on_shutdown: Callable[[], None] | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop.start(asyncio.get_running_loop())
        yield
        state.draining = True
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="atom", version=server_version(), lifespan=lifespan)
    app.add_middleware(_Edge, state=state)
    app.add_middleware(HeadAsGet)  # outermost: _Edge sees a GET

    def end_by_stop_string(rid: str) -> None:
        """A stop string matched: end the request, counted as finish_reason="stop"."""
        state.loop.abort(rid, reason="stop")

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"method {request.method} is not allowed on {request.url.path}" + (
                f"; allowed: {allowed}" if allowed else ""
            )
        elif exc.status_code == 400 and exc.__cause__ is not None:
            cause = exc.__cause__
            if isinstance(cause, RecursionError):
                message = "the request body is not usable JSON: it is nested too deeply"
            elif isinstance(cause, UnicodeDecodeError):
                message = (
                    f"the request body is not UTF-8 JSON ({cause.reason} at byte {cause.start})"
                )
            else:
                message = f"the request body is not usable JSON ({type(cause).__name__}: {cause})"
        return error_response(exc.status_code, message, headers=exc.headers)

    add_operation_routes(app, state)

    # ---- generation -----------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompts = [
            (state.tokenizer.encode(p), p) if isinstance(p, str) else (list(p), None)
            for p in body.prompts
        ]
        return await _serve(body, prompts, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        text = render_chat(body.messages)
        return await _serve(body, [(state.tokenizer.encode(text), text)], request, chat=True)

    def log_request(rid: str, ids: list[int], text: str | None, body) -> None:
        if not state.log_requests:
            return
        shown = text if text is not None else ids
        n = state.max_log_len
        if n is not None:
            shown = shown[:n]
        log.info(
            "request %s: %d prompt tokens %r | max_tokens=%s temperature=%g top_p=%g top_k=%d "
            "seed=%s stop=%r stream=%s n=%d logprobs=%s penalties=%g/%g/%g min_tokens=%d",
            rid,
            len(ids),
            shown,
            body.max_tokens,
            body.temperature,
            body.top_p,
            body.top_k,
            body.seed,
            body.stops,
            body.stream,
            body.n,
            body._logprobs()[0],
            body.presence_penalty,
            body.frequency_penalty,
            body.repetition_penalty,
            body.min_tokens,
        )

    def log_done(rid: str, reason: str | None, seq, n: int, t0: float) -> None:
        if not state.log_requests:
            return
        c = seq.counters if seq is not None else None
        log.info(
            "request %s finished: %s, %d completion tokens, %.2f s%s",
            rid,
            reason,
            n,
            time.monotonic() - t0,
            (
                f" | prompt hbm {c.hbm_hit_tokens} tier {c.tier_hit_tokens} "
                f"computed {c.computed_prompt_tokens}"
                if c is not None
                else ""
            ),
        )

    async def _serve(body, prompts: list[tuple[list[int], str | None]], request, chat: bool):
        """Serve a request of one or more prompts (token ids, text or None), ``n`` choices
        each: choice p * n + j is prompt p's j-th (one engine request per choice; a prompt's
        choices share it through the prefix cache)."""
        ids, text = prompts[0]
        if state.draining or not state.loop.alive:
            return error_response(503, "the server is shutting down; retry on another replica")
        if body.model != state.model_name:
            return unknown_model(state, body.model)
        try:
            params = [body.sampling_params(state.default_max_tokens, i) for i in range(body.n)]
        except ValidationError as exc:
            message, param = validation_message(exc.errors())
            return error_response(400, message, param)
        given = request.headers.get("x-request-id")
        rid = ("chatcmpl-" if chat else "cmpl-") + (given or uuid.uuid4().hex[:24])
        request.state.request_id = given or rid
        log_request(rid, ids, text, body)
        t0 = time.monotonic()
        gone = asyncio.ensure_future(_wait_disconnect(request))
        total = len(prompts) * body.n
        rids = [rid] if total == 1 else [f"{rid}-{i}" for i in range(total)]
        eos = state.tokenizer.eos_token_id
        choices = [
            _Choice(
                i,
                rids[i],
                state.loop.submit(rids[i], prompts[i // body.n][0], params[i % body.n], eos),
                _Stopper(state.tokenizer, body.stops),
                prompt=i // body.n,
            )
            for i in range(total)
        ]
        state.active_ids.update(rids)
        handed_over = False

        def abort_open() -> None:
            for c in choices:
                if c.delta is None or not c.delta.finished:
                    state.loop.abort(c.rid)

        try:
            for c in choices:
                first = await _next_delta(c.stream, gone)
                if first is None:
                    abort_open()
                    log_done(rid, "client disconnected", c.stream.seq, 0, t0)
                    return Response(status_code=499)
                c.delta = first
                if first.error:
                    abort_open()
                    if first.finish_reason == "error" and not state.loop.alive:
                        return error_response(500, first.error)
                    return error_response(400, first.error)
            out = _Output(state.tokenizer, body, chat, prompts)
            if body.stream:
                gone.cancel()
                gen = _sse(choices, out, body, rid, chat, request, t0)
                handed_over = True
                return StreamingResponse(gen, media_type="text/event-stream")
            results = []
            for c in choices:
                text_out, logprobs = "", []
                while True:
                    piece, lps = out.take(c, c.delta)
                    text_out += piece
                    logprobs += lps
                    if c.delta.finished or c.stopper.stopped:
                        break
                    c.delta = await _next_delta(c.stream, gone)
                    if c.delta is None:  # the client is gone: stop generating for it
                        abort_open()
                        n = sum(len(x.stopper.ids) for x in choices)
                        log_done(rid, "client disconnected", c.stream.seq, n, t0)
                        return Response(status_code=499)
                if c.stopper.stopped and not c.delta.finished:
                    end_by_stop_string(c.rid)
                c.reason = "stop" if c.stopper.stopped else c.delta.finish_reason
                if c.reason == "error":
                    abort_open()
                    return error_response(500, c.delta.error or "engine failure")
                results.append((c, text_out, logprobs))
            seq = choices[0].stream.seq or choices[0].delta.seq
            n_out = sum(out.completion_tokens(c) for c in choices)
            log_done(rid, choices[0].reason if total == 1 else "done", seq, n_out, t0)
            made = [out.final_choice(c, t, lps, chat) for c, t, lps in results]
            return {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": state.model_name,
                "choices": made,
                "usage": _usage(_prompt_seqs(choices, body.n), n_out),
            }
        finally:
            gone.cancel()
            if not handed_over:
                state.active_ids.difference_update(rids)

    async def _sse(
        choices: list[_Choice],
        out: _Output,
        body,
        rid: str,
        chat: bool,
        request: Request,
        t0: float,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        seq0 = choices[0].stream.seq or choices[0].delta.seq
        single = len(choices) == 1

        def usage() -> dict:
            n = sum(out.completion_tokens(c) for c in choices)
            return _usage(_prompt_seqs(choices, body.n), n)

        def chunk(
            c: _Choice, text: str | None, reason: str | None, lps=None, role: bool = False
        ) -> str:
            logprobs = None
            if chat:
                delta = {"role": "assistant", "content": ""} if role else {}
                if text:
                    delta["content"] = text
                if lps:
                    logprobs = out.chat_logprobs(lps)
                choice = {"index": c.index, "delta": delta, "logprobs": logprobs}
            else:
                if lps:
                    logprobs = out.completion_logprobs(c, lps)
                choice = {"index": c.index, "text": text or "", "logprobs": logprobs}
            choice["finish_reason"] = reason
            payload = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": state.model_name,
                "choices": [choice],
            }
            if body.usage_every_chunk:
                payload["usage"] = usage()
            return f"data: {json.dumps(payload)}\n\n"

        merged: asyncio.Queue = asyncio.Queue()

        async def pump(c: _Choice) -> None:
            while True:
                delta = await c.stream.queue.get()
                merged.put_nowait((c, delta))
                if delta.finished:
                    return

        for c in choices:
            merged.put_nowait((c, c.delta))
        pumps = [asyncio.ensure_future(pump(c)) for c in choices if not c.delta.finished]
        left, ended = len(choices), False
        try:
            for c in choices:
                if chat:
                    yield chunk(c, None, None, role=True)
                elif body.echo:
                    echo, echo_lps = out.echo(c)
                    yield chunk(c, echo, None, echo_lps)
            while left:
                c, delta = await merged.get()
                if c.reason is not None:
                    continue  # ended by a stop string; the engine's last word on it
                c.delta = delta
                text, lps = out.take(c, delta)
                if text or lps:
                    yield chunk(c, text, None, lps)
                if delta.finished or c.stopper.stopped:
                    if c.stopper.stopped and not delta.finished:
                        end_by_stop_string(c.rid)
                    c.reason = "stop" if c.stopper.stopped else delta.finish_reason
                    left -= 1
                    yield chunk(c, None, c.reason)
                    continue
                if await request.is_disconnected():
                    return
            ended = True
        finally:
            for p in pumps:
                p.cancel()
            state.active_ids.difference_update(c.rid for c in choices)
            if not ended:
                for c in choices:
                    if c.reason is None:
                        state.loop.abort(c.rid)
                n = sum(out.completion_tokens(c) for c in choices)
                log_done(rid, "client disconnected", seq0, n, t0)
        n = sum(out.completion_tokens(c) for c in choices)
        log_done(rid, choices[0].reason if single else "done", seq0, n, t0)
        if body.usage_at_end:
            payload = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": state.model_name,
                "choices": [],
                "usage": usage(),
            }
            yield f"data: {json.dumps(payload)}\n\n"
        yield "data: [DONE]\n\n"

    return app
