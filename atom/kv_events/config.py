"""KVEventsConfig: where and how atom publishes its KV cache events (vLLM's KVEventsConfig).

Endpoints follow vLLM's convention: a PUB endpoint with ``*`` (``tcp://*:5557``), ``::``,
``ipc://`` or ``inproc://`` is bound; a ``tcp://HOST:PORT`` naming a host is connected to (the
consumer binds). The replay endpoint is always bound.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

_TCP = re.compile(r"^tcp://(\*|\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.\-:]+):(\d{1,5})$")


def check_endpoint(v: str) -> str:
    """``v`` if it is a ZMQ endpoint atom can use, else a ValueError naming the forms."""
    if v.startswith(("ipc://", "inproc://")) and len(v.split("://", 1)[1]) > 0:
        return v
    m = _TCP.match(v)
    if m and 0 < int(m.group(2)) < 65536:
        return v
    raise ValueError(
        f"{v!r} is not a ZMQ endpoint: use tcp://*:PORT (bind on every interface), "
        "tcp://HOST:PORT (bind that address for the replay socket; connect for the PUB "
        "socket, as vLLM does), ipc://PATH or inproc://NAME"
    )


def binds(endpoint: str) -> bool:
    """vLLM's rule for the PUB socket: bind a wildcard, ipc or inproc endpoint, else connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventsConfig(BaseModel):
    """``endpoint``: the PUB socket; ``replay_endpoint``: the ROUTER socket that answers a start
    sequence number with the buffered batches from there (None: no replay); ``topic``: the
    first frame of every message; ``buffer_steps``: batches kept for replay; ``max_queue_size``:
    events the step thread may queue for the publisher thread before it drops (counted);
    ``hwm``: the PUB socket's high-water mark; ``encoding``: ``array`` (positional events, the
    layout vLLM used before its map encoding and that Dynamo and llm-d decode) or ``map``
    (events as maps tagged by ``type``, vLLM's newer layout; the batch stays positional);
    ``medium``: what the engine's own pool is called in its events."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    max_queue_size: int = 100_000
    hwm: int = 100_000
    encoding: Literal["array", "map"] = "map"
    medium: str = "GPU"

    @model_validator(mode="before")
    @classmethod
    def _needs_endpoint(cls, data):
        if isinstance(data, dict) and not data.get("endpoint"):
            raise ValueError(
                "KV events need an endpoint: add --kv-events-endpoint tcp://*:5557 (or "
                "kv_events.endpoint in the YAML)"
            )
        return data

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        return check_endpoint(v)

    @field_validator("replay_endpoint")
    @classmethod
    def _replay(cls, v: str | None) -> str | None:
        return None if v is None else check_endpoint(v)

    @field_validator("buffer_steps", "max_queue_size", "hwm")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"must be >= 1, got {v}")
        return v
