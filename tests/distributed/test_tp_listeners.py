"""Every socket atom listens on is on the loopback address by default: at TP=2 with an owned
LMCache server, the listeners of the engine's process tree (rank 0, rank 1, the LMCache
server) are listed from /proc and must all be 127.0.0.1 / ::1 (torch's rendezvous store once
listened on every interface)."""

from __future__ import annotations

import ipaddress
import os
import socket

import pytest

from atom import LLM, SamplingParams
from tests.distributed.test_tp_engine import KW

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc")


def process_tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in os.listdir(f"/proc/{p}/task"):
            try:
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
            except OSError:
                pass
    return out


def listening(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket in LISTEN the processes hold."""
    owner = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                owner[link[8:-1]] = pid
    out = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/net/{table}") as f:
            next(f)
            for line in f:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state != "0A" or inode not in owner:  # 0A: LISTEN
                    continue
                hexaddr, hexport = local.split(":")
                raw = bytes.fromhex(hexaddr)
                # /proc prints each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                out.append((owner[inode], socket.inet_ntop(family, raw), int(hexport, 16)))
    return out


def test_every_listener_of_a_tp2_engine_with_an_owned_server_is_on_loopback():
    llm = LLM("v41-tiny", tensor_parallel_size=2, offload="lmcache_mp", **KW)
    try:
        assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids
        pids = process_tree(os.getpid())
        found = listening(pids)
        ranks = {p.pid for p in llm.engine.runtime.processes}
        assert ranks and ranks <= {pid for pid, _, _ in found}, (ranks, found)
        outside = [(p, a, port) for p, a, port in found if not ipaddress.ip_address(a).is_loopback]
        assert not outside, f"listening beyond loopback: {outside}"
    finally:
        llm.shutdown()
