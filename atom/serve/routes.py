"""The server's operation endpoints: health, ping, version, metrics, prefix-cache reset, models,
tokenize, detokenize and (with --enable-tokenizer-info-endpoint) tokenizer_info (vLLM's
shapes)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from atom.serve.chat_template import CHAT_TEMPLATE
from atom.serve.edge import error_response
from atom.serve.protocol import (
    DetokenizeRequest,
    TokenizeRequest,
)

if TYPE_CHECKING:
    from atom.serve.state import ServerState
    from atom.tokenizer import Tokenizer

log = logging.getLogger("atom.serve")


def server_version() -> str:
    try:
        from importlib.metadata import version

        return version("atom")
    except Exception:
        return "unknown"


def unknown_model(state: ServerState, name) -> JSONResponse:
    return error_response(
        404,
        f"model {name!r} does not exist here; this server serves {state.model_name!r}",
        "model",
    )


def _added_tokens_as_content(value):
    """vLLM's serialization of a tokenizer config: an added token (here its JSON form, a dict
    with "content") becomes its string."""
    if isinstance(value, dict):
        if isinstance(value.get("content"), str):
            return value["content"]
        return {k: _added_tokens_as_content(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_added_tokens_as_content(v) for v in value]
    return value


def tokenizer_info(tokenizer: Tokenizer, max_model_len: int | None) -> dict:
    """vLLM's GET /tokenizer_info: the tokenizer's tokenizer_config.json with added tokens as
    their strings (``added_tokens_decoder`` maps id -> string), ``tokenizer_class`` always
    there, ``chat_template`` the one this server applies (for every model: atom renders chat
    with its own template), ``model_max_length`` the served max_model_len when known."""
    info = _added_tokens_as_content(tokenizer.config())
    info.pop("vocab_file", None)
    info.pop("merges_file", None)
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    info["chat_template"] = CHAT_TEMPLATE
    if max_model_len is not None:
        info["model_max_length"] = max_model_len
    return info


def add_operation_routes(app: FastAPI, state: ServerState) -> None:

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
        return {"version": server_version()}

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

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return model_card() if model_id == state.model_name else unknown_model(state, model_id)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if body.model is not None and body.model != state.model_name:
            return unknown_model(state, body.model)
        ids = state.tokenizer.encode(body.text())
        strs = [state.tokenizer.decode([t]) for t in ids] if body.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": state.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    if state.tokenizer_info_endpoint:  # off by default, as in vLLM

        @app.get("/tokenizer_info")
        async def get_tokenizer_info():
            return tokenizer_info(state.tokenizer, state.max_model_len)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if body.model is not None and body.model != state.model_name:
            return unknown_model(state, body.model)
        return {"prompt": state.tokenizer.decode(body.tokens)}
