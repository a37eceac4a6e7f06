"""One round-trip per tier lookup (issue 39 item 2), against real LMCache servers.

With engine-driven loads a lookup is one ``atom.lookup_locate`` call: the server module runs
LMCache's own lookup (the same prefix match, the same read locks for the same request id) and
locates the hit. Checked here: a two-pass run costs one lookup-path call per lookup, its loads
are byte-exact and its outputs those of an engine without a tier; the read locks the combined
call takes are held while each load starts and released after it; a server whose module lacks
the call, or declines it, serves the same hits through LMCache's lookup and ``atom.locate``
(three calls a hit); a combined lookup answered after the step thread gave up on it, or not
answered in time, leaves no lock behind; with an L2 the lookup's prefetch is polled through
the same call.
"""

from __future__ import annotations

import threading

import pytest

from atom.tier.server.lmcache_server import L1_MODULE, LMCacheServer
from atom.tier.worker_side.locator import Locator

from .conftest import BLOCK
from .l2_fixtures import fs_dir  # noqa: F401  (fixture)
from .test_engine_driven import (
    LENGTHS,
    LockProbe,
    Watch,
    double_frees,
    loads_hold_their_locks,
    mapped,
    no_l1_left_behind,  # noqa: F401  (autouse fixture)
    two_pass,
    wait_for,
)
from .test_l2 import drained
from .test_tier_faults import FAST, check, pump, same_tokens, settled, visible
from .test_two_pass import GREEDY, ceiling, prompts_of, tier

OLD_MODULE = '{"module_path": "atom.tier.server.l1_module", "config": {"lookup_locate": false}}'


class OldModuleServer(LMCacheServer):
    """An owned server whose module serves ``atom.locate`` only (as before issue 39)."""

    def command(self) -> list[str]:
        return [OLD_MODULE if arg == L1_MODULE else arg for arg in super().command()]


@pytest.fixture()
def old_module_server():
    server = OldModuleServer(chunk_size=BLOCK, l1_size_gb=0.25, shared_l1=True)
    server.start()
    yield server
    server.stop()


def released(probe, prompts) -> list:
    """The prompts' objects still read-locked once the frees sent so far have reached the
    server: they go on the lookup thread's connection and the probe asks on its own, so a
    probe can overtake the last of them (polled for at most 3 s, as test_engine_driven's)."""
    return wait_for(lambda: probe.locked(prompts), 3.0)


def check_engine_driven_pass(llm, w, prompts, out, reference) -> None:
    """Pass 2 of ``two_pass``: the tier's hits, copied locally, byte-exact, outputs right."""
    conn = llm.engine.scheduler.connector
    same_tokens(out, reference)
    assert [o.tier_hit_tokens for o in out] == [ceiling(len(p)) for p in prompts]
    assert conn.tier_metrics.local_loads.get(outcome="copied") == len(prompts)
    assert [ld["local"] for ld in w.loads] == [True] * len(prompts)
    assert w.located_answers == len(prompts)
    w.check_loads_byte_exact()
    w.check_locks_freed_once()


# ---- (a), (b): one call per lookup; the locks it takes are LMCache's ---------------------------


def test_a_two_pass_run_costs_one_server_call_per_lookup_and_releases_its_locks(
    lmcache_server, make_llm
):
    prompts = prompts_of(LENGTHS, seed=3901)
    reference = make_llm().generate(prompts, GREEDY)
    freed_twice = double_frees(lmcache_server)
    out1, out2, llm, w1, w = two_pass(lmcache_server, make_llm, prompts, "engine_driven")
    same_tokens(out1, reference)
    check_engine_driven_pass(llm, w, prompts, out2, reference)
    assert w1.conn.lookups.calls == {"lookup_locate": len(prompts)}  # pass 1's misses: one each
    lt = llm.engine.tier.lookups
    assert lt.calls == {"lookup_locate": len(prompts)}, lt.calls
    assert lt.server_calls == len(prompts)  # one round-trip per hit: lookup and locate
    assert llm.engine.tier.locator.locates == 0
    text = llm.engine.metrics.render()
    assert f'atom_tier_lookup_server_calls_total{{kind="lookup_locate"}} {len(prompts)}' in text

    # (b) pass 3 on the same engine, prefix cache emptied: as each load starts, the combined
    # lookup's read locks hold every object it reads; after the loads none is left
    with LockProbe(lmcache_server.url, llm.engine.tier.namespace) as probe:
        assert released(probe, prompts) == [], "read locks left on the server after pass 2"
        same_tokens(loads_hold_their_locks(llm, probe, prompts, LENGTHS), reference)
        assert released(probe, prompts) == [], "read locks left on the server after pass 3"
    assert lt.calls == {"lookup_locate": 2 * len(prompts)}, lt.calls
    w.check_locks_freed_once()
    assert double_frees(lmcache_server) == freed_twice, "a read lock was released twice"


# ---- (c): a server without the combined call, or one that declines it ---------------------------


def test_a_server_whose_module_lacks_the_call_hits_through_two_calls(old_module_server, make_llm):
    prompts = prompts_of(LENGTHS, seed=3902)
    reference = make_llm().generate(prompts, GREEDY)
    out1, out2, llm, w1, w = two_pass(old_module_server, make_llm, prompts, "engine_driven")
    same_tokens(out1, reference)
    check_engine_driven_pass(llm, w, prompts, out2, reference)
    locator = llm.engine.tier.locator
    assert locator.lookup_locate == 0 and not locator.combined
    assert llm.engine.tier_health()["load_mode"] == "engine_driven"
    n = len(prompts)
    # LMCache's lookup and one status query (served from L1 as it runs), then atom.locate
    assert w1.conn.lookups.calls == {"lookup": n, "query": n}
    assert llm.engine.tier.lookups.calls == {"lookup": n, "query": n, "locate": n}
    with LockProbe(old_module_server.url, llm.engine.tier.namespace) as probe:
        assert released(probe, prompts) == []
    assert double_frees(old_module_server) == 0


def test_a_server_that_declines_the_call_is_asked_the_two_call_way(
    lmcache_server, make_llm, monkeypatch
):
    """A module that answers "not handled" (here: a version it does not speak) has looked up
    nothing: the lookup goes again as LMCache's, and the combined call is not sent again."""
    prompts = prompts_of(LENGTHS, seed=3903)
    reference = make_llm().generate(prompts, GREEDY)
    cfg = tier(lmcache_server)
    first = make_llm(**cfg)
    mapped(first)
    w1 = Watch(first)
    same_tokens(first.generate(prompts, GREEDY, on_step=check), reference)
    first.shutdown()

    request = Locator.lookup_request
    monkeypatch.setattr(Locator, "lookup_request", lambda *a: {**request(*a), "v": 99})
    second = make_llm(**cfg)
    mapped(second)
    w = Watch(second)
    out = second.generate(prompts, GREEDY, on_step=check)
    pump(second, lambda: settled(second), "pass 2 to settle")
    w.saved_pages, w.saved_images = w1.saved_pages, w1.saved_images
    check_engine_driven_pass(second, w, prompts, out, reference)
    locator = second.engine.tier.locator
    assert "version 99" in locator.declined and not locator.combined
    calls, n = second.engine.tier.lookups.calls, len(prompts)
    # the lookups sent before the first decline came back were declined too, each sent again
    assert 1 <= calls["lookup_locate"] <= n and calls["lookup_poll"] == 0
    assert (calls["lookup"], calls["query"], calls["locate"]) == (n, n, n)
    with LockProbe(lmcache_server.url, second.engine.tier.namespace) as probe:
        assert released(probe, prompts) == []


# ---- (d): a combined lookup answered late, or not in time, leaves no lock ---------------------


def held_replies(llm):
    """Hold the lookup thread's view of every combined call's reply (the server answers; the
    thread does not see it) until the returned event is set. Also returns the ops looked up
    and the calls read."""
    lt = llm.engine.tier.lookups
    gate, ops, calls = threading.Event(), [], []
    read, lookup = lt.locator.read_lookup, lt.lookup

    def held(call):
        if call not in calls:
            calls.append(call)
        return read(call) if gate.is_set() else None

    lt.locator.read_lookup = held
    lt.lookup = lambda op: (ops.append(op), lookup(op))[1]
    return gate, ops, calls


def stored(llm, prompts, reference):
    mapped(llm)
    same_tokens(llm.generate(prompts, GREEDY, on_step=check), reference)
    pump(llm, lambda: settled(llm) and visible(llm, prompts), "pass 1's stores, visible")
    llm.engine.reset_prefix_cache()


def late_pass(llm, prompts, reference, probe):
    """Pass 2 with every combined reply held: each lookup goes late, its request computes and
    finishes, its session's end waits for the lookup; meanwhile the server holds each hit's
    objects read-locked (the combined call ran LMCache's lookup)."""
    conn, lt, n = llm.engine.scheduler.connector, llm.engine.tier.lookups, len(prompts)
    out = llm.generate(prompts, GREEDY, on_step=check)
    same_tokens(out, reference)
    assert [o.tier_hit_tokens for o in out] == [0] * n
    assert conn.tier_metrics.lookups.get(outcome="late") == n
    pump(llm, lambda: not conn._requests, "the requests' session ends to be sent")
    assert lt.sessions_ended == n  # pass 1's: pass 2's wait for their lookups
    locked = set(probe.locked(prompts))
    for i, k in enumerate(LENGTHS):  # each prompt's pages and the image at its hit
        end = ceiling(k)
        want = {(i, b, "pages") for b in range(BLOCK, end + 1, BLOCK)} | {(i, end, "image")}
        assert want <= locked, sorted(want - locked)


def test_a_combined_lookup_answered_after_its_deadline_frees_its_locks(lmcache_server, make_llm):
    prompts = prompts_of(LENGTHS, seed=3904)
    reference = make_llm().generate(prompts, GREEDY)
    llm = make_llm(**tier(lmcache_server, **FAST, rpc_timeout_s=60.0))
    stored(llm, prompts, reference)
    lt, n = llm.engine.tier.lookups, len(prompts)
    freed_twice = double_frees(lmcache_server)
    gate, ops, _ = held_replies(llm)
    with LockProbe(lmcache_server.url, llm.engine.tier.namespace) as probe:
        try:
            late_pass(llm, prompts, reference, probe)
        finally:
            gate.set()  # the replies come in: each late hit's locks are freed, then its end
        pump(llm, lambda: settled(llm) and lt.sessions_ended == 2 * n, "sessions to end")
        assert [op.hit for op in ops] == [ceiling(k) for k in LENGTHS]  # answered, late
        assert released(probe, prompts) == [], "a late combined lookup left read locks"
    assert lt.calls == {"lookup_locate": 2 * n}
    assert double_frees(lmcache_server) == freed_twice, "a read lock was released twice"


def test_a_combined_lookup_not_answered_in_time_frees_its_locks(lmcache_server, make_llm):
    """The calls' replies never reach the lookup thread; their deadline (``rpc_timeout_s``
    after each was sent) is brought forward once the sessions' ends wait for them. Each is
    then given up: its locks freed by id on the same connection, then its session ended. A
    server that answers otherwise but not the call (as one without the module would: lmcache
    never replies to a method no module serves) is asked the two-call way from then on."""
    prompts = prompts_of(LENGTHS, seed=3905)
    reference = make_llm().generate(prompts, GREEDY)
    llm = make_llm(**tier(lmcache_server, **FAST, rpc_timeout_s=60.0))
    stored(llm, prompts, reference)
    lt, n = llm.engine.tier.lookups, len(prompts)
    freed_twice = double_frees(lmcache_server)
    gate, ops, calls = held_replies(llm)
    with LockProbe(lmcache_server.url, llm.engine.tier.namespace) as probe:
        try:
            late_pass(llm, prompts, reference, probe)
            assert len(calls) == n
            for call in calls:
                call.give_up_at = 0.0  # as if rpc_timeout_s had passed
            pump(llm, lambda: all(op.terminal for op in ops), "the calls to be given up")
        finally:
            gate.set()
        assert [op.error for op in ops] == ["lookup not answered in time"] * n
        assert "answers but not atom.lookup_locate" in llm.engine.tier.locator.declined
        pump(llm, lambda: settled(llm) and lt.sessions_ended == 2 * n, "sessions to end")
        assert released(probe, prompts) == [], "an unanswered combined lookup left read locks"
    assert double_frees(lmcache_server) == freed_twice, "a read lock was released twice"


# ---- with an L2: the lookup's prefetch is polled through the same call -------------------------


def test_with_an_l2_a_replica_hits_through_combined_calls_and_polls(fs_dir, make_llm):  # noqa: F811
    prompts = prompts_of(LENGTHS, seed=3906)
    reference = make_llm().generate(prompts, GREEDY)
    cfg = dict(
        offload="lmcache_mp",
        lmcache={"l1_size_gb": 0.25, "l2_adapters": [{"type": "fs", "base_path": str(fs_dir)}]},
    )
    a = make_llm(**cfg)
    same_tokens(a.generate(prompts, GREEDY, on_step=check), reference)
    drained(a)
    a.shutdown()  # its server stops: only the directory is shared
    # (B's lookups find nothing in its own L1: LMCache's prefetch loads them from L2)
    b = make_llm(**cfg)
    mapped(b)
    out = b.generate(prompts, GREEDY, on_step=check)
    pump(b, lambda: settled(b), "B to settle")
    same_tokens(out, reference)
    hits = [o.tier_hit_tokens for o in out]
    assert sum(hits) > 0
    conn, lt, n = b.engine.scheduler.connector, b.engine.tier.lookups, len(prompts)
    assert set(lt.calls) <= {"lookup_locate", "lookup_poll"}, lt.calls
    assert lt.calls["lookup_locate"] == n and lt.calls["lookup_poll"] >= 1  # L2: polled
    assert conn.tier_metrics.local_loads.get(outcome="copied") == sum(1 for h in hits if h)
    with LockProbe(b.engine.tier.url, b.engine.tier.namespace) as probe:
        assert released(probe, prompts) == []
