"""The locate-capability probe never delays a lookup (real LMCache server without atom's locate
module, the documented lmcache_driven fallback).

lmcache 0.5.6 never answers a call of a method no module serves, so the probe learns "no
module" only from its deadline (``rpc_timeout_s``, 3 s). It runs beside the lookups: with
``lookup_timeout_s`` 1 s, the very first wave of a fresh engine is answered in time, so its
requests store (pass 1) and load (pass 2); /health says "probing" meanwhile, never
"engine_driven", then the real mode.
"""

from __future__ import annotations

import pytest

from atom.tier.server.lmcache_server import LMCacheServer

from .conftest import BLOCK
from .test_tier_faults import pump
from .test_two_pass import GREEDY, ceiling, prompts_of, tier

LENGTHS = [40, 77, 64, 100]


@pytest.fixture(scope="module")
def plain_server():
    """A server without the locate module and without a shared-memory L1."""
    server = LMCacheServer(chunk_size=BLOCK, l1_size_gb=0.25)
    server.start(wait=True)
    yield server
    server.stop()


def first_wave(make_llm, server, prompts):
    """A fresh engine (engine_driven asked) runs ``prompts`` as its first wave."""
    llm = make_llm(**tier(server, lookup_timeout_s=1.0))
    mode = llm.engine.tier_health()["load_mode"]
    assert mode.startswith("probing"), mode  # honest from the start: not engine_driven
    out = llm.generate(prompts, GREEDY, on_step=lambda e: e.check_integrity())
    lookups = llm.engine.scheduler.connector.tier_metrics.lookups
    assert lookups.get(outcome="late") == 0 and lookups.get(outcome="failed") == 0
    return llm, out


def test_first_wave_against_a_server_without_the_module_stores_and_loads(plain_server, make_llm):
    prompts = prompts_of(LENGTHS, seed=4301)
    one, out1 = first_wave(make_llm, plain_server, prompts)
    conn = one.engine.scheduler.connector
    assert conn.tier_metrics.lookups.get(outcome="miss") == len(prompts)
    one.shutdown()  # its stores drain before it returns
    assert (
        conn.tier_metrics.saves.get(outcome="done") >= sum(ceiling(n) // BLOCK for n in LENGTHS) > 0
    )

    two, out2 = first_wave(make_llm, plain_server, prompts)
    assert [o.tier_hit_tokens for o in out2] == [ceiling(n) for n in LENGTHS]
    assert [o.token_ids for o in out2] == [o.token_ids for o in out1]
    conn = two.engine.scheduler.connector
    assert conn.tier_metrics.loads.get(outcome="done") == len(prompts)
    assert conn.tier_metrics.local_loads.get(outcome="copied") == 0  # nowhere to copy from
    mode = lambda: two.engine.tier_health()["load_mode"]  # noqa: E731
    pump(two, lambda: not mode().startswith("probing"), "the probe to end")
    assert mode().startswith("lmcache_driven (") and "--server-module" in mode(), mode()
