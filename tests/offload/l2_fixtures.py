"""Fixtures for the L2 tests: a real redis-server on a free port, LMCache servers with an L2
adapter, and a raw client that stores and loads through lmcache's own ATOM adapter.

redis-server comes from Debian's package (.ci/run installs it). Without it the Redis tests
skip locally and fail in CI (``CI=true``), where a skip would hide a missing dependency.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch

from atom.tier.server.lmcache_server import LMCacheServer, free_port

from .conftest import BLOCK

REDIS = shutil.which("redis-server")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def need_redis() -> None:
    if REDIS is None:
        if IN_CI:
            pytest.fail("redis-server is not installed (.ci/run installs it: apt-get)")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")


def poll(cond, timeout_s: float, what: str, every_s: float = 0.05):
    """Wait until ``cond()`` is truthy; returns its value, fails the test after the bound."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)  # allowed: a poll interval, bounded by the deadline above


class RedisServer:
    """One redis-server with no persistence, in a temporary directory, on a free port."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="atom-redis-"))
        self.proc: subprocess.Popen | None = None

    @property
    def adapter(self) -> dict:
        return {"type": "resp", "host": "127.0.0.1", "port": self.port, "num_workers": 2}

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [
                REDIS, "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.dir),
                "--protected-mode", "no", "--loglevel", "warning",
            ],
            stdout=open(self.dir / "redis.log", "ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        poll(lambda: self.ping(), 20, f"redis-server on port {self.port}")
        return self

    def cli(self, *args: str) -> str:
        out = subprocess.run(
            ["redis-cli", "-p", str(self.port), *args], capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip()

    def ping(self) -> bool:
        try:
            return self.cli("ping") == "PONG"
        except (OSError, subprocess.TimeoutExpired):
            return False

    def keys(self, pattern: str = "*") -> list[str]:
        out = self.cli("--scan", "--pattern", pattern)
        return [k for k in out.splitlines() if k]

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        self.kill()
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture()
def redis():
    need_redis()
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture()
def fs_dir(tmp_path):
    d = tmp_path / "l2"
    d.mkdir()
    return d


def l2_server(adapter: dict, l1_size_gb: float = 0.25, **kw) -> LMCacheServer:
    """An LMCache server (not started) whose L2 is ``adapter``."""
    return LMCacheServer(chunk_size=BLOCK, l1_size_gb=l1_size_gb, l2_adapters=[adapter], **kw)


@pytest.fixture()
def servers():
    """Make LMCache servers that are stopped (SIGKILL if needed) after the test."""
    made: list[LMCacheServer] = []

    def make(adapter: dict, **kw) -> LMCacheServer:
        s = l2_server(adapter, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop(timeout_s=5.0)


def fs_objects(path: Path) -> dict[int, int]:
    """Objects an fs L2 holds, by object group (the group id is the third '@' field)."""
    groups: dict[int, int] = {}
    for f in Path(path).rglob("*"):
        parts = f.name.split("@")
        if f.is_file() and len(parts) >= 4:
            g = int(parts[2], 16)
            groups[g] = groups.get(g, 0) + 1
    return groups


def redis_objects(redis: RedisServer) -> dict[int, int]:
    groups: dict[int, int] = {}
    for k in redis.keys():
        parts = k.split("@")
        if len(parts) >= 4:
            g = int(parts[2], 16)
            groups[g] = groups.get(g, 0) + 1
    return groups


class RawClient:
    """lmcache's ATOM worker and scheduler adapters on a pool laid out as the engine lays it
    out (pages + image ordinals), for byte-level checks without an engine."""

    def __init__(self, url: str, namespace: str, units: int = 2, num_blocks: int = 96):
        import zmq
        from lmcache.integration.atom import (
            AtomMPParallelConfig,
            AtomMPSchedulerAdapter,
            AtomMPWorkerAdapter,
        )

        from atom.tier.worker_side.layout import group_infos, kv_caches, share_pool

        self.units, self.num_blocks = units, num_blocks
        self.pool = torch.zeros((num_blocks, BLOCK, 64), dtype=torch.int32)
        self.segment = share_pool(self.pool)
        self.ctx = zmq.Context()
        self.ctx.linger = 0
        par = AtomMPParallelConfig(world_size=1, worker_id=0, tp_size=1)
        self.worker = AtomMPWorkerAdapter(
            url, self.ctx, namespace, BLOCK, par, mq_timeout=10, heartbeat_interval=1.0,
            transfer_mode="lmcache_driven",
        )  # fmt: skip
        self.worker.register_kv_caches(
            kv_caches(self.pool, units), engine_group_infos=group_infos(BLOCK, BLOCK, units)
        )
        self.sched = AtomMPSchedulerAdapter(url, self.ctx, namespace, BLOCK, par, mq_timeout=10)

    @property
    def bytes(self) -> torch.Tensor:
        return self.pool.view(torch.uint8).view(self.num_blocks, -1)

    def _spec(self, tokens, n, pages, units):
        from lmcache.integration.atom import AtomMPTransferSpec

        block_ids = [list(pages)] + [[-1] * (n - 1) + [u] for u in units]
        return AtomMPTransferSpec(
            token_ids=list(tokens[: n * BLOCK]), block_ids=block_ids, start=0, end=n * BLOCK
        )

    def _wait(self, fut, timeout_s: float = 30.0) -> bool:
        poll(fut.query, timeout_s, "a transfer", every_s=0.002)
        return bool(fut.result())

    def store(self, rid, tokens, n, pages, units) -> bool:
        from atom.tier.worker_side.events import CpuEvent

        fut = self.worker.submit_store_request(rid, self._spec(tokens, n, pages, units), CpuEvent())
        return fut is not None and self._wait(fut)

    def lookup(self, rid, tokens, timeout_s: float = 30.0) -> int:
        self.sched.maybe_submit_lookup_request(rid, list(tokens))
        hit = poll(
            lambda: (lambda r: None if r is None else (r,))(self.sched.check_lookup_result(rid)),
            timeout_s,
            "a lookup answer",
            every_s=0.002,
        )[0]
        self.sched.cleanup_lookup_result(rid)
        return hit

    def load(self, rid, tokens, n, pages, units) -> bool:
        from atom.tier.worker_side.events import CpuEvent

        fut = self.worker.submit_retrieve_request(
            rid, self._spec(tokens, n, pages, units), CpuEvent()
        )
        return fut is not None and self._wait(fut)

    def end(self, rid) -> None:
        self.sched.end_session(rid)

    def close(self) -> None:
        from atom.tier.worker_side.layout import unlink_segment

        try:
            self.worker.shutdown()
        except Exception:
            pass
        self.sched.shutdown()
        self.ctx.term()
        unlink_segment(self.segment)
