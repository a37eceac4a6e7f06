"""The LMCache server the engine starts runs with the flags the layout and the copy path need."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from atom.tier.server.lmcache_server import (
    LMCacheServer,
    LMCacheServerError,
    ephemeral_ports,
    free_port,
)


def test_the_running_server_has_the_flags_the_image_layout_and_copy_order_need(lmcache_server):
    argv = Path(f"/proc/{lmcache_server.proc.pid}/cmdline").read_bytes().decode().split("\0")
    flags = dict(zip(argv, argv[1:]))
    assert flags["--null-block-id"] == "-1"  # image ordinals are -1 before the endpoint chunk
    assert "--separate-object-groups" in argv  # pages and images in separate object groups
    assert flags["--supported-transfer-mode"] == "lmcache_driven"
    # Eager L1: with the lazy allocator the server's host copies are unordered with its
    # gathers on CUDA and a store could copy another request's bytes (docs/LMCACHE_API.md §9.15).
    assert "--no-l1-use-lazy" in argv and "--l1-use-lazy" not in argv
    assert lmcache_server.running


def test_chosen_ports_avoid_the_ephemeral_range_and_are_never_handed_out_twice():
    # A port from the ephemeral range can become an outgoing connection's source port before
    # the server binds it (a CI run lost a start to "Address already in use" that way).
    lo, hi = ephemeral_ports()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    if lo >= 1024 + 1024:  # room below the range
        assert all(1024 <= p < lo for p in ports), (lo, hi, ports)


def test_a_first_start_whose_chosen_port_was_taken_moves_to_a_free_one():
    server = LMCacheServer(chunk_size=256, l1_size_gb=0.05)
    taken = server.port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        try:
            server.start(timeout_s=60)
            assert server.port != taken and server.healthy()
            assert server.url.endswith(f":{server.port}")
        finally:
            server.stop()


def test_a_port_given_by_the_user_is_never_changed():
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        server = LMCacheServer(chunk_size=256, l1_size_gb=0.05, port=port)
        try:
            with pytest.raises(LMCacheServerError, match="already in use"):
                server.start(timeout_s=60)
            assert server.port == port
        finally:
            server.stop()
