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
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from atom.serve.engine_loop import Delta, EngineLoop, RequestStream
from atom.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    render_chat,
)
from atom.tokenizer import ByteTokenizer, Tokenizer

log = logging.getLogger("atom.serve")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
OPEN_PATHS = ("/health", "/ping", "/metrics", "/version")  # reachable without --api-key
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    501: "not_implemented_error",
    503: "service_unavailable",
}


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("atom")
    except Exception:
        return "unknown"


@dataclass
class ServerState:
    loop: EngineLoop
    tokenizer: Tokenizer
    model_name: str
    default_max_tokens: int | None = None  # None: what fits max_model_len and the pool
    tier_health: Callable[[], dict] = lambda: {"attached": False}
    draining: bool = False
    started: float = field(default_factory=time.time)
    http_requests: dict[tuple[str, int], int] = field(default_factory=dict)
    api_key: str | None = None
    max_log_len: int | None = 200  # characters of the prompt in the request log; None: all
    log_requests: bool = True
    max_model_len: int | None = None
    active_http: int = 0  # generation requests whose response is not finished
    active_ids: set[str] = field(default_factory=set)  # their engine request ids


def error_response(
    status: int, message: str, param: str | None = None, headers: dict | None = None
) -> JSONResponse:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """pydantic's errors as one message naming each field, its value and what is allowed."""
    msgs, param = [], None
    for err in errors:
        loc = ".".join(str(p) for p in err["loc"] if p != "body")
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = f"unknown field (value {_short(err.get('input'))}); unknown fields are refused"
        elif err["type"] == "json_invalid":
            at = f" at position {loc}" if loc else ""
            msg, loc = f"malformed JSON{at}: {err.get('ctx', {}).get('error', msg)}", ""
        elif err["type"] == "missing":
            msg = "field required"
        elif err["type"] != "value_error" and "input" in err:
            msg = f"{msg} (got {_short(err['input'])})"
        if param is None:
            named = re.match(r"([A-Za-z_][\w.]*):", msg)  # a model-level check names its field
            param = loc or (named.group(1) if named else None)
        msgs.append(f"{loc}: {msg}" if loc and not msg.startswith(f"{loc}:") else msg)
    return "; ".join(msgs) or "invalid request", param


class _Edge:
    """Pure ASGI middleware (BaseHTTPMiddleware would hide client disconnects): the API key,
    ``X-Request-Id``, a JSON 500 for any exception, and the HTTP metrics for every response."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state, path = self.state, scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        given = headers.get("x-request-id")
        slots = scope.setdefault("state", {})
        status: int | None = None

        async def send_out(msg):
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
                rid = given or slots.get("request_id")
                if rid:
                    extra = [(b"x-request-id", rid.encode("latin-1", "replace"))]
                    msg = {**msg, "headers": [*msg.get("headers", []), *extra]}
            await send(msg)

        generation = path in GENERATION_PATHS
        if generation:
            state.active_http += 1
        try:
            if given is not None and not (0 < len(given) <= 256 and given.isprintable()):
                response = error_response(
                    400, "X-Request-Id: must be 1-256 printable characters", "X-Request-Id"
                )
                given = None
            elif state.api_key and path not in OPEN_PATHS and not _authorized(state, headers):
                response = error_response(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>' with the key "
                    "this server was started with (--api-key)",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            else:
                response = None
            if response is not None:
                await response(scope, receive, send_out)
            else:
                await self.app(scope, receive, send_out)
        except Exception as exc:
            log.exception("unhandled error in %s %s", scope.get("method"), path)
            if status is None:
                msg = f"internal error ({type(exc).__name__}); this is a bug, the log has details"
                await error_response(500, msg)(scope, receive, send_out)
        finally:
            if generation:
                state.active_http -= 1
            route = scope.get("route")
            label = getattr(route, "path", None) or "(unmatched)"
            key = (label, status or 500)
            state.http_requests[key] = state.http_requests.get(key, 0) + 1


def _authorized(state: ServerState, headers: dict[str, str]) -> bool:
    import hmac

    auth = headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip(), state.api_key)


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


LOGPROB_FLOOR = -9999.0  # what JSON carries for -inf (as vLLM)


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


@dataclass(eq=False)
class _Choice:
    """One of a request's ``n`` choices: its engine request and what was sent of it."""

    index: int
    rid: str
    stream: RequestStream
    stopper: _Stopper
    delta: Delta | None = None  # the last delta read
    reason: str | None = None  # the finish reason, once it ended
    offset: int = 0  # completions' text_offset of the next token reported


class _Output:
    """A request's text and logprobs as OpenAI's shapes: the echoed prompt, each generated
    token's logprob and alternatives (the engine records them before the token is visible,
    so ``seq.logprobs`` covers every token a delta carries)."""

    def __init__(self, tokenizer: Tokenizer, body, chat: bool, ids: list[int], text: str | None):
        self.tok = tokenizer
        self.k, _ = body._logprobs()
        self.want = self.k is not None
        self.echo_only = body.echo_only
        self.ids = ids
        echo = not chat and body.echo
        self.echo_text = (text if text is not None else tokenizer.decode(ids)) if echo else ""
        self._strs: dict[int, str] = {}

    def token_str(self, t: int) -> str:
        s = self._strs.get(t)
        if s is None:
            s = self._strs[t] = self.tok.decode([t])
        return s

    def token_bytes(self, t: int) -> list[int]:
        if isinstance(self.tok, ByteTokenizer):
            return [t] if 0 <= t < 256 else []
        return list(self.token_str(t).encode("utf-8"))

    def take(self, c: _Choice, delta: Delta) -> tuple[str, list]:
        """A delta's new text (after stop strings) and its tokens' (id, TokenLogprob)."""
        if self.echo_only:
            return "", []  # the one token sampled is not returned
        done = len(c.stopper.ids)
        text = c.stopper.feed(delta.token_ids, delta.finished)
        if not (self.want and delta.token_ids):
            return text, []
        seq = delta.seq or c.stream.seq
        return text, [(r.token_id, r) for r in seq.logprobs[done : done + len(delta.token_ids)]]

    def completion_tokens(self, c: _Choice) -> int:
        return 0 if self.echo_only else len(c.stopper.ids)

    def echo(self, c: _Choice) -> tuple[str, list]:
        """The echoed prompt and, with logprobs, its tokens' (id, TokenLogprob | None)."""
        if not self.want or not self.echo_text:
            return self.echo_text, []
        seq = c.stream.seq or c.delta.seq
        recs = [None, *seq.prompt_logprobs]
        return self.echo_text, list(zip(self.ids, recs))

    def completion_logprobs(self, c: _Choice, entries: list) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        for tid, rec in entries:
            s = self.token_str(tid)
            tokens.append(s)
            offsets.append(c.offset)
            c.offset += len(s)
            if rec is None:  # the first prompt token: nothing predicts it
                values.append(None)
                tops.append(None)
                continue
            values.append(_lp(rec.logprob))
            top = {self.token_str(t): _lp(v) for t, v in rec.top}
            top.setdefault(s, _lp(rec.logprob))  # the chosen token is always there
            tops.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def chat_logprobs(self, entries: list) -> dict:
        def item(t: int, v: float) -> dict:
            return {"token": self.token_str(t), "logprob": _lp(v), "bytes": self.token_bytes(t)}

        content = []
        for tid, rec in entries:
            entry = item(tid, rec.logprob)
            entry["top_logprobs"] = [item(t, v) for t, v in rec.top]
            content.append(entry)
        return {"content": content}


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client has gone (the body is read: the next message is the end)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _next_delta(stream: RequestStream, gone: asyncio.Task) -> Delta | None:
    """The next delta, or None if the client disconnected first."""
    if not stream.queue.empty():
        return stream.queue.get_nowait()
    get = asyncio.ensure_future(stream.queue.get())
    done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
    if get in done:
        return get.result()
    get.cancel()
    return None


def build_app(state: ServerState, on_shutdown: Callable[[], None] | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop.start(asyncio.get_running_loop())
        yield
        state.draining = True
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="atom", version=_version(), lifespan=lifespan)
    app.add_middleware(_Edge, state=state)

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

    # ---- operations -----------------------------------------------------------------------

    @app.get("/health")
    async def health():
        alive = state.loop.alive
        status = "draining" if state.draining else ("ok" if alive else "unavailable")
        body = {
            "status": status,
            "model": state.model_name,
            "draining": state.draining,
            "uptime_s": round(time.time() - state.started, 1),
            "engine": state.loop.engine.stats() if alive else None,
            "tier": state.tier_health(),
        }
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        if state.draining or not state.loop.alive:
            return error_response(503, "the server is draining or its engine has stopped")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": _version()}

    @app.get("/metrics")
    async def metrics():
        lines = [state.loop.engine.metrics.render()]
        lines.append("# HELP atom_http_requests_total HTTP responses by route and status.")
        lines.append("# TYPE atom_http_requests_total counter")
        for (path, status), n in sorted(state.http_requests.items()):
            lines.append(f'atom_http_requests_total{{path="{path}",status="{status}"}} {n}')
        tier = state.tier_health()
        lines.append("# HELP atom_tier_healthy 1 when the LMCache tier is attached and healthy.")
        lines.append("# TYPE atom_tier_healthy gauge")
        lines.append(f"atom_tier_healthy {1 if tier.get('healthy') else 0}")
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(tier: bool = False):
        engine = state.loop.engine
        if tier and not engine.tier_health().get("attached"):
            return error_response(400, "tier=true: no tier is attached (--offload)", "tier")
        try:
            await asyncio.wrap_future(state.loop.call(lambda: engine.reset_prefix_cache(tier)))
        except RuntimeError as exc:
            return error_response(409, f"{exc}; retry when no request is running")
        except Exception as exc:  # the tier did not answer the clear
            log.warning("reset_prefix_cache(tier=True) failed: %r", exc)
            return error_response(503, f"the tier could not be cleared: {exc!r}", "tier")
        return {"status": "ok", "reset": ["hbm", "tier"] if tier else ["hbm"]}

    # ---- models and tokens ----------------------------------------------------------------

    def model_card() -> dict:
        return {
            "id": state.model_name,
            "object": "model",
            "created": int(state.started),
            "owned_by": "atom",
            "root": state.model_name,
            "parent": None,
            "max_model_len": state.max_model_len,
        }

    def unknown_model(name) -> JSONResponse:
        return error_response(
            404,
            f"model {name!r} does not exist here; this server serves {state.model_name!r}",
            "model",
        )

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return model_card() if model_id == state.model_name else unknown_model(model_id)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if body.model is not None and body.model != state.model_name:
            return unknown_model(body.model)
        ids = state.tokenizer.encode(body.text())
        strs = [state.tokenizer.decode([t]) for t in ids] if body.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": state.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if body.model is not None and body.model != state.model_name:
            return unknown_model(body.model)
        return {"prompt": state.tokenizer.decode(body.tokens)}

    # ---- generation -----------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompt = body.prompt
        if isinstance(prompt, str):
            ids, text = state.tokenizer.encode(prompt), prompt
        else:
            ids, text = list(prompt), None
        return await _serve(body, ids, text, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        text = render_chat(body.messages)
        return await _serve(body, state.tokenizer.encode(text), text, request, chat=True)

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

    async def _serve(body, ids: list[int], text: str | None, request: Request, chat: bool):
        if state.draining or not state.loop.alive:
            return error_response(503, "the server is shutting down; retry on another replica")
        if body.model != state.model_name:
            return unknown_model(body.model)
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
        # n > 1: one engine request per choice (the prompt is shared through the prefix cache)
        rids = [rid] if body.n == 1 else [f"{rid}-{i}" for i in range(body.n)]
        eos = state.tokenizer.eos_token_id
        choices = [
            _Choice(i, r, state.loop.submit(r, ids, p, eos), _Stopper(state.tokenizer, body.stops))
            for i, (r, p) in enumerate(zip(rids, params))
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
            out = _Output(state.tokenizer, body, chat, ids, text)
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
            log_done(rid, choices[0].reason if body.n == 1 else "done", seq, n_out, t0)
            made = []
            for c, text_out, logprobs in results:
                if chat:
                    message = {"role": "assistant", "content": text_out}
                    made.append(
                        {
                            "index": c.index,
                            "message": message,
                            "logprobs": out.chat_logprobs(logprobs) if out.want else None,
                            "finish_reason": c.reason,
                        }
                    )
                else:
                    echo, echo_lps = out.echo(c)
                    made.append(
                        {
                            "index": c.index,
                            "text": echo + text_out,
                            "logprobs": (
                                out.completion_logprobs(c, echo_lps + logprobs)
                                if out.want
                                else None
                            ),
                            "finish_reason": c.reason,
                        }
                    )
            return {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": state.model_name,
                "choices": made,
                "usage": _usage(seq, n_out),
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

        def usage() -> dict:
            return _usage(seq0, sum(out.completion_tokens(c) for c in choices))

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
        log_done(rid, choices[0].reason if body.n == 1 else "done", seq0, n, t0)
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
