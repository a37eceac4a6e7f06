"""Operator actions on an LMCache MP server beyond the adapters' own calls."""

from __future__ import annotations


def clear_server(url: str, zmq_context, timeout_s: float) -> None:
    """Drop every unlocked object from the server's L1 (its ``clear`` request; L2 adapters
    keep theirs). It clears the whole server: every model and engine that shares it. Raises
    on an unreachable server or a timeout."""
    from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

    client = RequestClientFactory.create(url, context=zmq_context)
    try:
        client.clear(False).result(timeout_s)
    finally:
        client.close()
