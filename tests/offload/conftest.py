"""Fixtures for tier tests: real LMCache MP servers, engines that are checked for hygiene."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from atom import LLM
from atom.tier.server.lmcache_server import LMCacheServer

BLOCK = 16
ENGINE_KW = dict(
    block_size=BLOCK,
    num_blocks=300,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    dtype="float32",
    kv_dtype="fp32",
    index_dtype="fp32",
    device="cpu",
)


def shm_segments() -> list[str]:
    """This process's LMCache shared-memory segments."""
    prefix = f"lmcache_kv_{os.getpid()}_"
    return sorted(p.name for p in Path("/dev/shm").glob(f"{prefix}*"))


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op thread: tiny forwards gain nothing from more, and on a shared 2-core host
    spinning OpenMP workers slow every step by orders of magnitude."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def lmcache_server():
    """One real LMCache MP server for the session (chunk = the tests' block size)."""
    server = LMCacheServer(chunk_size=BLOCK, l1_size_gb=0.5, shared_l1=True)
    server.start(wait=True)
    yield server
    server.stop()


@pytest.fixture()
def own_server():
    """A server of this test's own, for tests that kill, stop or restart it."""
    server = LMCacheServer(chunk_size=BLOCK, l1_size_gb=0.25, shared_l1=True)
    yield server
    server.stop()


def assert_clean(llm: LLM) -> None:
    """After shutdown: no leases, no pinned images, no open sessions, integrity holds."""
    eng = llm.engine
    eng.check_integrity()
    conn = eng.scheduler.connector
    if conn is not None:
        assert conn.leases() == {}, "transfer leases left behind"
        assert not conn._requests, "tier requests (sessions) left open"
        assert not conn.quarantined
    assert eng.store.counts()["pinned"] == 0 and not eng.store.limbo
    owned = sum(1 for b in range(eng.pool.num_blocks) if eng.pool.ref[b])
    assert owned == eng.store.counts()["units"], "blocks owned by something other than images"


@pytest.fixture()
def make_llm():
    """Build engines (offload or not) that are shut down and checked after the test."""
    made: list[LLM] = []
    before = shm_segments()

    def make(model: str = "v41-tiny", **kw) -> LLM:
        llm = LLM(model, **{**ENGINE_KW, **kw})
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()
        assert_clean(llm)
    made.clear()
    gc.collect()
    assert shm_segments() == before, "shared-memory segments left in /dev/shm"


@pytest.fixture()
def make():
    """Build engines over the fake tier (``fakes.make_harness``); any the test did not shut
    down is shut down (unchecked) afterwards."""
    from .fakes import make_harness  # (fakes imports this module's constants)

    made = []

    def build(**kw):
        h = make_harness(**kw)
        made.append(h)
        return h

    yield build
    for h in made:
        if not h.closed:
            h.shutdown(check=False)
