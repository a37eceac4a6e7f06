"""The LMCache server the engine starts runs with the flags the layout and the copy path need."""

from __future__ import annotations

from pathlib import Path


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
