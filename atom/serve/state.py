"""The HTTP server's state: the engine loop, the tokenizer and what the routes count and read.

One ``ServerState`` per server, made by ``server.py`` and read by the routes (``app.py``,
``routes.py``) and the middleware (``edge.py``); only the event loop's thread writes it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from atom.serve.engine_loop import EngineLoop
from atom.tokenizer import Tokenizer


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
    tokenizer_info_endpoint: bool = False  # serve GET /tokenizer_info (vLLM's opt-in)
    active_http: int = 0  # generation requests whose response is not finished
    active_ids: set[str] = field(default_factory=set)  # their engine request ids
