"""The server's edge: OpenAI-shaped errors, pydantic errors as one message naming the field, and
the ASGI middleware that checks the API key, echoes ``X-Request-Id``, answers any exception with
a JSON 500 and counts every response."""

from __future__ import annotations

import asyncio
import logging
import re
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse

from atom.config_errors import field_errors
from atom.serve.engine_loop import Delta, RequestStream

if TYPE_CHECKING:
    from atom.serve.state import ServerState

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
    for e in field_errors(errors, skip=("body",)):
        loc, msg = e.loc, e.msg
        if e.kind == "extra_forbidden":
            msg = f"unknown field (value {_short(e.value)}); unknown fields are refused"
        elif e.kind == "json_invalid":
            at = f" at position {loc}" if loc else ""
            msg, loc = f"malformed JSON{at}: {e.ctx.get('error', msg)}", ""
        elif e.kind == "missing":
            msg = "field required"
        elif e.kind != "value_error" and e.given:
            msg = f"{msg} (got {_short(e.value)})"
        if param is None:
            named = re.match(r"([A-Za-z_][\w.]*):", msg)  # a model-level check names its field
            param = loc or (named.group(1) if named else None)
        msgs.append(f"{loc}: {msg}" if loc and not msg.startswith(f"{loc}:") else msg)
    return "; ".join(msgs) or "invalid request", param


class HeadAsGet:
    """Pure ASGI middleware: HEAD on a route answers as GET does, headers only (HTTP's HEAD;
    load balancers and benchmark clients probe /health and /v1/models that way). The GET runs,
    its body is dropped."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        async def headers_only(msg):
            if msg["type"] == "http.response.body":
                if msg.get("more_body", False):
                    return
                msg = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(msg)

        return await self.app({**scope, "method": "GET"}, receive, headers_only)


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
