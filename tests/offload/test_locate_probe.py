"""The locate-capability probe never delays a lookup (real LMCache server without atom's locate
module, the documented lmcache_driven fallback).

lmcache 0.5.6 never answers a call of a method no module serves, so the probe learns "no
module" only from its deadline (``rpc_timeout_s``, 3 s). It runs beside the lookups: with
``lookup_timeout_s`` 1 s, the very first wave of a fresh engine is answered in time, so its
requests store (pass 1) and load (pass 2); /health says "probing" meanwhile, never
"engine_driven", then the real mode.

A probe whose reply does not come in time (held back on cue: a server just restarted on a busy
host) leaves the verdict unknown, not unsupported: hits load through the server until a retry
finds the module, then the engine copies them, without a restart.
"""

from __future__ import annotations

import threading

import pytest

from atom.tier.server.lmcache_server import LMCacheServer
from atom.tier.worker_side.locator import Locator

from .conftest import BLOCK
from .test_engine_driven import Watch, mapped
from .test_tier_faults import check, pump, same_tokens, settled, visible
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


class HeldReply:
    """A reply of the server's that the test holds back until ``cue`` is set."""

    def __init__(self, fut, cue):
        self.fut, self.cue = fut, cue

    def wait(self, timeout: float) -> bool:
        return self.cue.wait(timeout) and self.fut.wait(timeout)


def hold_probe_replies(monkeypatch, cls) -> threading.Event:
    """Until the returned cue is set, ``cls``'s probe gets no reply from the (real) server in
    time, which still answers a noop: a server just restarted on a busy host, on cue."""
    cue, ask = threading.Event(), cls._ask

    def held_ask(self, client, wait):
        return ask(self, client, lambda fut: wait(HeldReply(fut, cue)))

    monkeypatch.setattr(cls, "_ask", held_ask)
    return cue


def test_a_probe_unanswered_in_time_leaves_loads_unknown_then_engine_driven_without_a_restart(
    lmcache_server, make_llm, monkeypatch
):
    prompts = prompts_of(LENGTHS, seed=4311)
    reference = make_llm().generate(prompts, GREEDY)
    cue = hold_probe_replies(monkeypatch, Locator)
    llm = make_llm(**tier(lmcache_server, rpc_timeout_s=1.0))
    conn, locator = llm.engine.scheduler.connector, llm.engine.tier.locator
    mode = lambda: llm.engine.tier_health()["load_mode"]  # noqa: E731
    pump(llm, lambda: mode().startswith("lmcache_driven (unknown: "), "an unknown verdict")
    assert "answers a noop but not atom.locate within 1 s" in mode(), mode()
    # unknown: every hit loads through the server, as before the probe answered
    w = Watch(llm)
    same_tokens(llm.generate(prompts, GREEDY, on_step=check), reference)
    pump(llm, lambda: settled(llm) and visible(llm, prompts), "pass 1's stores, visible")
    llm.engine.reset_prefix_cache()
    out = llm.generate(prompts, GREEDY, on_step=check)
    same_tokens(out, reference)
    assert [o.tier_hit_tokens for o in out] == [ceiling(n) for n in LENGTHS]
    assert conn.tier_metrics.local_loads.get(outcome="copied") == 0
    assert [ld["local"] for ld in w.loads] == [False] * len(prompts)

    cue.set()  # the server answers from now on: the next retry finds the module
    pump(llm, lambda: mode() == "engine_driven", "the retry's verdict")
    mapped(llm, lmcache_server.l1_segment)
    # a retry found it, not the first probe (the retry may have been sent, and held, before
    # the cue: its answer then arrives with no further probe)
    assert locator.probe.probes > 1 and locator.combined
    llm.engine.reset_prefix_cache()
    out = llm.generate(prompts, GREEDY, on_step=check)
    pump(llm, lambda: settled(llm), "pass 3 to settle")
    same_tokens(out, reference)
    assert [o.tier_hit_tokens for o in out] == [ceiling(n) for n in LENGTHS]
    assert conn.tier_metrics.local_loads.get(outcome="copied") == len(prompts)
    assert [ld["local"] for ld in w.loads[len(prompts) :]] == [True] * len(prompts)
    w.check_loads_byte_exact()
