"""Engine-driven saves against real LMCache servers (issue 39).

The server module (``atom.reserve``, ``atom.commit``, ``atom.abort``): reserved objects are
LMCache staging objects that lookups do not see until committed; an abort discards them; a
reservation never committed is released when its lease ends.

The engine (``lmcache.save_mode: engine_driven``): it copies a save's objects into the space
the module reserved and commits them. Checked: two passes whose second loads exactly the bytes
the first computed (and no store of the server's), a reserve the server refuses and a server
without the methods (the server's store instead), an engine SIGKILLed between reserve and
commit (nothing half-written is visible, the reservation blocks nobody and is released), and
the server SIGKILLed mid-save (the engine keeps serving, and saves engine-driven again to the
restarted server). Whether the server serves the methods: a probe whose reply is held back
(a server just restarted on a busy host, on cue) leaves it unknown, and a retry turns saves
engine-driven without a restart; an owned server that says no (no L1 in shared memory),
killed and restarted by the engine's supervisor as one that says yes, gets engine-driven saves
and loads, byte-exact.

What the server holds is observed through its own account: the module's counters
(``SavesProbe``: an ``atom.reserve`` with no items answers them), LMCache's gauge of staging
bytes and its store counter (Prometheus), LMCache's own lookups, and what fresh engines hit
and load."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgspec
import pytest
import zmq

import atom
from atom.tier.server.l1_saves import RESERVE_METHOD, SAVES_VERSION
from atom.tier.server.lmcache_server import L1_MODULE, LMCacheServer, remove_dead_leftovers
from atom.tier.worker_side import local_save
from atom.tier.worker_side.local_save import EngineSaves

from .conftest import BLOCK, ENGINE_KW
from .server_view import ServerView
from .test_engine_driven import Watch, mapped
from .test_locate_probe import hold_probe_replies
from .test_tier_faults import FAST, check, healthy, pump, same_tokens, settled, stores_then_hits
from .test_two_pass import GREEDY, ceiling, prompts_of, tier

LENGTHS = [40, 77, 100, 129, 200]
MARKER_SEEDS = itertools.count(43_000)  # a fresh prompt per marker: always a miss


class SavesProbe:
    """Asks the server module for its saves counters (an ``atom.reserve`` of nothing)."""

    def __init__(self, url: str):
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        self.ctx = zmq.Context()
        self.ctx.linger = 0
        self.client = RequestClientFactory.create(url, context=self.ctx)

    def call(self, method: str, payload: dict) -> dict:
        from lmcache.v1.multiprocess.protocols.server_module import ServerModuleCallRequest

        req = ServerModuleCallRequest(method, msgspec.msgpack.encode(payload))
        fut = self.client.server_module_call(req)
        assert fut.wait(5.0), f"the server did not answer {method} in 5 s"
        resp = fut.result()
        assert resp.success, resp.error
        return msgspec.msgpack.decode(resp.payload)

    def status(self) -> dict:
        return self.call(RESERVE_METHOD, {"v": SAVES_VERSION, "items": []})["status"]

    def close(self) -> None:
        self.client.close()
        self.ctx.destroy(linger=0)

    def __enter__(self) -> SavesProbe:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def staging_bytes(server) -> float:
    """LMCache's gauge of bytes held by staging objects (reserved, never admitted)."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    found = re.findall(r"^lmcache_mp_l1_staging_bytes(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE)
    assert found, "LMCache exports no lmcache_mp_l1_staging_bytes"
    return sum(float(v) for v in found)


def wait_until(cond, what: str, timeout_s: float = 60.0):
    """Poll ``cond()`` (another process's state) until it is truthy; its value."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.1)  # allowed: a bounded poll round of another process's state


# ---- the module (atom.reserve, atom.commit, atom.abort): staging, visibility, lease -----------


def reserve_payload(ns: str, items: list[tuple[str, list[int], int]], ttl_s: float = 30.0):
    from atom.tier.server.l1_saves import own_identity

    return {
        "v": SAVES_VERSION, "model_name": ns, "world_size": 1, "worker_id": 0, "ttl_s": ttl_s,
        "owner": own_identity(),
        "items": [{"request_id": rid, "token_ids": toks[:end], "start": 0, "end": end,
                   "groups": [[0, -1], [1, 1]]} for rid, toks, end in items],
    }  # fmt: skip


def lookup_hit(url: str, ns: str, tokens: list[int], request_id: str) -> int:
    """LMCache's own lookup of ``tokens`` (its scheduler adapter), locks freed after."""
    from lmcache.integration.atom import AtomMPParallelConfig, AtomMPSchedulerAdapter

    ctx = zmq.Context()
    ctx.linger = 0
    adapter = AtomMPSchedulerAdapter(url, ctx, ns, BLOCK, AtomMPParallelConfig(1, 0, 1))
    hit = 0
    try:
        adapter.maybe_submit_lookup_request(request_id, tokens)
        answered = wait_until(
            lambda: (h := adapter.check_lookup_result(request_id)) is not None and [h],
            "a lookup's answer",
            10.0,
        )
        hit = answered[0]
        if hit:
            adapter.free_lookup_locks(tokens, 0, hit, request_id)
    finally:
        adapter.cleanup_lookup_result(request_id)
        adapter.end_session(request_id)
        adapter.shutdown()
        ctx.destroy(linger=0)
    return hit


def test_reserved_objects_are_invisible_until_committed_and_an_abort_discards_them(
    own_server, make_llm
):
    own_server.start()
    llm = make_llm(**tier(own_server))  # registers the namespace's layout
    ns = llm.engine.tier.namespace
    a, b = prompts_of([48, 48], seed=561)
    with SavesProbe(own_server.url) as probe:
        answer = probe.call(RESERVE_METHOD, reserve_payload(ns, [("t-a", a, 48), ("t-b", b, 32)]))
        assert answer["shm_name"] == own_server.l1_segment and answer["ttl_s"] == 30.0
        ia, ib = answer["items"]
        assert ia["ok"] and ib["ok"] and ia["rid"] != ib["rid"], answer
        # one span per chunk's pages, one for the image at the end; all in the segment
        assert [len(g) for g in ia["objects"]] == [3, 1] and [len(g) for g in ib["objects"]] == [
            2,
            1,
        ]
        spans = [tuple(x) for it in (ia, ib) for g in it["objects"] for x in g]
        assert all(0 <= o and o + n <= answer["shm_size"] for o, n in spans)
        assert len({o for o, _ in spans}) == len(spans)  # disjoint starts
        assert staging_bytes(own_server) == sum(n for _, n in spans)
        # staged, not admitted: LMCache's own lookup does not see them
        assert lookup_hit(own_server.url, ns, a + [1], "t-look-1") == 0
        assert lookup_hit(own_server.url, ns, b + [1], "t-look-2") == 0
        done = probe.call("atom.commit", {"v": SAVES_VERSION, "rids": [ia["rid"]]})
        assert done["results"] == [[ia["rid"], True, ""]]
        gone = probe.call("atom.abort", {"v": SAVES_VERSION, "rids": [ib["rid"]]})
        assert gone["results"] == [[ib["rid"], True, ""]]
        assert lookup_hit(own_server.url, ns, a + [1], "t-look-3") == 48
        assert lookup_hit(own_server.url, ns, b + [1], "t-look-4") == 0
        assert staging_bytes(own_server) == 0.0
        # what is resident is not reserved again (nil spans; nothing to write: rid 0)
        again = probe.call(RESERVE_METHOD, reserve_payload(ns, [("t-a2", a, 48)]))["items"][0]
        assert again == {"ok": True, "error": "", "rid": 0, "objects": [[None] * 3, [None]]}
        st = probe.status()
    assert (st["reserved"], st["committed"], st["aborted"], st["open"]) == (2, 1, 1, 0), st


def test_an_item_lmcache_cannot_name_fails_alone_in_its_reserve_call(lmcache_server, make_llm):
    """One item's range ends past the tokens it sends (LMCache cannot hash its last chunk):
    that item is refused with the reason, the call's other item is reserved as usual."""
    llm = make_llm(**tier(lmcache_server))  # registers the namespace's layout
    ns = llm.engine.tier.namespace
    good, bad = prompts_of([48, 48], seed=39_510)
    payload = reserve_payload(ns, [("t-good", good, 48), ("t-bad", bad, 48)])
    payload["items"][1]["token_ids"] = bad[:40]
    with SavesProbe(lmcache_server.url) as probe:
        before = probe.status()
        ok, refused = probe.call(RESERVE_METHOD, payload)["items"]
        assert ok["ok"] and ok["rid"] > 0 and [len(g) for g in ok["objects"]] == [3, 1], ok
        assert not refused["ok"] and refused["rid"] == 0 and "cannot be named" in refused["error"]
        probe.call("atom.abort", {"v": SAVES_VERSION, "rids": [ok["rid"]]})
        st = probe.status()
    assert st["refused"] - before["refused"] == 1 and st["open"] == before["open"], st


def test_a_reservation_past_its_lease_is_released_and_cannot_be_committed(lmcache_server, make_llm):
    """A reservation whose owner never commits it is released at the end of its lease even
    while the owner lives (here: this test process, a lease of 1 s), and a late commit of it
    is refused: a lookup never sees it."""
    llm = make_llm(**tier(lmcache_server))  # registers the namespace's layout
    ns = llm.engine.tier.namespace
    tokens = prompts_of([48], seed=551)[0]
    with SavesProbe(lmcache_server.url) as probe:
        before = probe.status()
        answer = probe.call(RESERVE_METHOD, reserve_payload(ns, [("t-lease", tokens, 48)], 1.0))
        assert answer["ttl_s"] == 1.0
        item = answer["items"][0]
        assert item["ok"] and item["rid"] > 0 and len(item["objects"][0]) == 3, item
        st = wait_until(
            lambda: (s := probe.status())["reaped"] > before["reaped"] and s, "the lease's end"
        )
        assert st["open"] == before["open"]
        late = probe.call("atom.commit", {"v": SAVES_VERSION, "rids": [item["rid"]]})
        assert late["results"] == [[item["rid"], False, "no such reservation (reaped or done)"]]
    out = make_llm(**tier(lmcache_server)).generate([tokens + [1]], GREEDY)[0]
    assert out.tier_hit_tokens == 0


# ---- the engine (lmcache.save_mode: engine_driven) ----------------------------------------


def saves_tier(server, **extra):
    return tier(server, save_mode="engine_driven", **extra)


def saves_ready(llm, name: str | None = None):
    """Step the idle engine until engine-driven saves run (the probe found the module) and
    the server's segment (``name``'s, if given) is mapped for them; returns the mapping."""
    saves = llm.engine.tier.saves

    def ok() -> bool:
        cur = saves.mappings.current
        return saves.mode == "engine_driven" and cur is not None and name in (None, cur.ident.name)

    pump(llm, ok, "engine-driven saves to be ready")
    return saves.mappings.current


def saves_of(llm):
    """The engine's ``EngineSaves`` (read its counters after shutdown through this: a shut
    down engine has no tier)."""
    return llm.engine.tier.saves


@pytest.fixture()
def view(lmcache_server, make_llm):
    """The session server's view (its own store counter), with a marker that settles a
    reading: an engine whose saves are the server's stores (lmcache_driven)."""
    v = ServerView(lmcache_server)

    def mark() -> tuple[float, float]:
        llm = make_llm(**tier(lmcache_server))
        llm.generate(prompts_of([40], seed=next(MARKER_SEEDS)), GREEDY)
        llm.shutdown()  # its stores drain before it returns
        m = llm.engine.scheduler.connector.tier_metrics
        return m.saves.get(outcome="done"), m.lookups.total()

    v.mark = mark
    return v


# ---- 1. two passes: pass 2 loads exactly the bytes pass 1 computed -------------------------


@pytest.mark.parametrize("load_mode", ["engine_driven", "lmcache_driven"])
def test_two_pass_with_engine_driven_saves_is_exact(lmcache_server, make_llm, view, load_mode):
    prompts = prompts_of(LENGTHS, seed=501 if load_mode == "engine_driven" else 502)
    reference = make_llm().generate(prompts, GREEDY)
    before = view.read()
    with SavesProbe(lmcache_server.url) as probe:
        committed = probe.status()["committed"]
    cfg = saves_tier(lmcache_server, load_mode=load_mode)
    first = make_llm(**cfg)
    saves_ready(first, lmcache_server.l1_segment)
    assert first.engine.tier_health()["save_mode"] == "engine_driven"
    saves, w1 = saves_of(first), Watch(first)
    same_tokens(first.generate(prompts, GREEDY, on_step=check), reference)
    first.shutdown()  # its saves drain before it returns
    done = first.engine.scheduler.connector.tier_metrics.saves.get(outcome="done")
    got = saves.counts
    assert done > 0 and got["copied"] == done, got  # every save copied by the engine
    assert got["via_server"] == got["failed"] == got["aborted"] == 0, got
    assert saves.bytes > 0 and saves.mappings.current is None  # unmapped at shutdown
    # every save was reserved before the forward that made it, and claimed that reservation
    assert saves.ahead["claimed"] == done and saves.ahead["unclaimed"] == 0, saves.ahead
    assert saves.calls["reserve"] <= done  # never a second reserve at submission (and batched)
    # every copied save reported where its latency went: two round-trips and the copy
    phases = first.engine.scheduler.connector.tier_metrics.save_phases
    for phase in ("queued", "reserve", "copy", "to_commit", "commit"):
        assert phases.count(phase=phase) == done, phase
    assert all(v > 0 for p in ("reserve", "copy", "commit") for v in phases.samples(phase=p))
    with SavesProbe(lmcache_server.url) as probe:
        st = probe.status()
    assert st["committed"] - committed == done and st["open"] == 0, st
    # the server stored nothing itself: its store counter moved by the marker's stores only
    assert view.settled(before, view.mark).stores == 0

    second = make_llm(**tier(lmcache_server, load_mode=load_mode))
    w2 = Watch(second)
    out = second.generate(prompts, GREEDY, on_step=check)
    pump(second, lambda: settled(second), "pass 2 to settle")
    same_tokens(out, reference)  # tokens equal to an engine without a tier
    assert [o.tier_hit_tokens for o in out] == [ceiling(n) for n in LENGTHS]
    for p, o in zip(prompts, out):
        assert o.hbm_hit_tokens == 0 and o.tier_hit_tokens + o.computed_prompt_tokens == len(p)
    # byte-exact: each load put in the pool exactly what pass 1's engine copied for that prefix
    w2.saved_pages, w2.saved_images = w1.saved_pages, w1.saved_images
    w2.check_loads_byte_exact()
    assert [ld["local"] for ld in w2.loads] == [load_mode == "engine_driven"] * len(prompts)
    assert staging_bytes(lmcache_server) == 0.0


def test_a_saves_sources_are_released_when_its_copy_completed_before_its_commit(
    lmcache_server, make_llm
):
    """The commits are held back (not sent) until every save has copied: by then every
    save's blocks and image are released while the saves are still live, and each hold
    ended before any save's end; sent, the commits store every save."""
    prompts = prompts_of([129, 200], seed=39_520)
    llm = make_llm(**saves_tier(lmcache_server))
    saves_ready(llm)
    saves, conn = saves_of(llm), llm.engine.scheduler.connector
    held: list = []
    commit_later = saves.commit_later
    saves.commit_later = held.append
    with SavesProbe(lmcache_server.url) as probe:
        committed = probe.status()["committed"]
    llm.generate(prompts, GREEDY, on_step=check)

    def copied_and_released() -> bool:
        return bool(held) and conn.live_ops == len(held) and not conn.leases()

    pump(llm, copied_and_released, "every save copied and its sources released")
    assert conn.busy() and not conn.quarantined
    m = conn.tier_metrics
    assert m.saves.total() == 0 and len(m.save_hold.samples()) == len(held)
    saves.commit_later = commit_later
    for save in held:
        commit_later(save)
    pump(llm, lambda: settled(llm), "the commits")
    assert m.saves.get(outcome="done") == len(held) == saves.counts["copied"]
    assert max(m.save_hold.samples()) < min(m.latency.samples(op="save"))
    with SavesProbe(lmcache_server.url) as probe:
        assert probe.status()["committed"] - committed == len(held)


def test_a_reservation_made_ahead_that_no_save_claims_is_given_back(lmcache_server, make_llm):
    """The planner's reservations ahead get an extra one per step that no save will claim
    (a span that would end one chunk further): each is given back after the step's saves,
    nothing stays staged on the server, and the real saves are unaffected."""
    prompts = prompts_of([77, 129], seed=39_530)
    reference = make_llm().generate(prompts, GREEDY)
    llm = make_llm(**saves_tier(lmcache_server))
    saves_ready(llm)
    saves, transfers = saves_of(llm), llm.engine.tier.transfers
    inner, extra = transfers.reserve_ahead, []

    def reserve_ahead(aheads):
        bogus = [dataclasses.replace(a, end=a.end + BLOCK) for a in aheads]
        extra.extend(bogus)
        return inner(list(aheads) + bogus)

    transfers.reserve_ahead = reserve_ahead
    with SavesProbe(lmcache_server.url) as probe:
        before = probe.status()
    same_tokens(llm.generate(prompts, GREEDY, on_step=check), reference)
    pump(llm, lambda: settled(llm), "the saves")
    llm.shutdown()
    done = llm.engine.scheduler.connector.tier_metrics.saves.get(outcome="done")
    assert extra and saves.ahead["unclaimed"] == len(extra), (saves.ahead, len(extra))
    assert saves.ahead["claimed"] == done == saves.counts["copied"], (saves.counts, saves.ahead)
    with SavesProbe(lmcache_server.url) as probe:
        st = probe.status()
    assert st["open"] == 0 and st["committed"] - before["committed"] == done, st
    assert staging_bytes(lmcache_server) == 0.0


# ---- 2./3. fallbacks to the server's store -------------------------------------------------


def test_a_refused_reserve_falls_back_to_the_servers_store(lmcache_server, make_llm, view):
    """Every other save asks the server for an object group it does not have: the server
    refuses that reserve (as it refuses one it has no L1 room for), and the save is the
    server's store instead. Nothing is lost: pass 2 loads every prompt, byte-exact."""
    prompts = prompts_of(LENGTHS, seed=511)
    reference = make_llm().generate(prompts, GREEDY)
    with SavesProbe(lmcache_server.url) as probe:
        refused_before = probe.status()["refused"]
    first = make_llm(**saves_tier(lmcache_server))
    saves_ready(first)
    saves = saves_of(first)
    inner, bad = saves._reserve_request, []

    def reserve_request(ops):
        req = inner(ops)
        for item in req["items"]:
            if len(bad) % 2 == 0:
                item["groups"] = [[0, -1], [7, 1]]  # no object group 7: refused
            bad.append(item["groups"][1][0] == 7)
        return req

    saves._reserve_request = reserve_request
    w1 = Watch(first)
    before = view.read()
    same_tokens(first.generate(prompts, GREEDY, on_step=check), reference)
    first.shutdown()
    got, done = saves.counts, first.engine.scheduler.connector.tier_metrics.saves
    refused = sum(bad)
    assert refused > 0 and got["via_server"] == refused, (got, bad)
    assert got["copied"] == len(bad) - refused and got["failed"] == 0, got
    assert done.get(outcome="done") == len(bad) and done.get(outcome="failed") == 0
    with SavesProbe(lmcache_server.url) as probe:
        st = probe.status()
    assert st["refused"] - refused_before == refused and st["open"] == 0, st
    assert view.settled(before, view.mark).stores == refused  # the server stored those

    second = make_llm(**tier(lmcache_server))
    w2 = Watch(second)
    out = second.generate(prompts, GREEDY, on_step=check)
    same_tokens(out, reference)
    assert [o.tier_hit_tokens for o in out] == [ceiling(n) for n in LENGTHS]
    w2.saved_pages, w2.saved_images = w1.saved_pages, w1.saved_images
    w2.check_loads_byte_exact()


class NoSavesServer(LMCacheServer):
    """A server whose module serves loads only (``"saves": false``: as a module from before
    engine-driven saves)."""

    def command(self) -> list[str]:
        old = json.dumps({"module_path": "atom.tier.server.l1_module", "config": {"saves": False}})
        return [old if arg == L1_MODULE else arg for arg in super().command()]


@pytest.mark.parametrize("server_kind", ["no_module", "module_without_saves"])
def test_a_server_without_the_saves_methods_gets_the_servers_stores(make_llm, server_kind):
    if server_kind == "no_module":
        server = LMCacheServer(chunk_size=BLOCK, l1_size_gb=0.25)  # no --server-module
    else:
        server = NoSavesServer(chunk_size=BLOCK, l1_size_gb=0.25, shared_l1=True)
    server.start()
    try:
        prompts = prompts_of(LENGTHS, seed=521 if server_kind == "no_module" else 522)
        reference = make_llm().generate(prompts, GREEDY)
        first = make_llm(**saves_tier(server))
        saves = saves_of(first)
        mode = lambda: first.engine.tier_health()["save_mode"]  # noqa: E731
        assert mode() != "engine_driven", mode()  # probing, never a wrong mode
        pump(first, lambda: mode().startswith("lmcache_driven"), "the probe to find no method")
        assert "atom.reserve" in mode() and "--server-module" in mode(), mode()
        same_tokens(first.generate(prompts, GREEDY, on_step=check), reference)
        first.shutdown()
        assert saves.counts["copied"] == saves.counts["via_server"] == 0, saves.counts
        assert saves.calls["reserve"] == 0  # never reserved at all: the server's stores
        assert first.engine.scheduler.connector.tier_metrics.saves.get(outcome="done") > 0

        second = make_llm(**tier(server))
        out = second.generate(prompts, GREEDY, on_step=check)
        same_tokens(out, reference)
        assert [o.tier_hit_tokens for o in out] == [ceiling(n) for n in LENGTHS]
        second.shutdown()
    finally:
        server.stop()


# ---- 4. the engine SIGKILLed between reserve and commit --------------------------------------

# An engine whose first engine-driven copy writes the first run of its plan only, says so (a
# file, with its pid), and holds its transfer thread until it is killed: a save reserved,
# half-written, never committed.
CHILD = r"""
import json, os, sys, threading, time
import torch
torch.set_num_threads(1)
from atom import LLM, SamplingParams
from atom.tier.worker_side import local_save

url, marker = sys.argv[1], sys.argv[2]
prompts, kw = json.loads(sys.argv[3]), json.loads(sys.argv[4])

def copy(self, op, plan, mapping):
    d, s, n = plan[0]
    mapping.data[d : d + n * self.bb].copy_(self.blocks[s : s + n].view(-1))
    with open(marker + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "written": n * self.bb, "runs": len(plan)}, f)
    os.replace(marker + ".tmp", marker)
    threading.Event().wait()

local_save.EngineSaves.copy = copy
tier = {"url": url, "save_mode": "engine_driven"}
llm = LLM("v41-tiny", **kw, offload="lmcache_mp", lmcache=tier)
saves = llm.engine.tier.saves
deadline = time.monotonic() + 120
while saves.mode != "engine_driven" or saves.mappings.current is None:
    assert time.monotonic() < deadline, saves.mode
    time.sleep(0.05)  # allowed: the child engine's own bounded poll of its probe (no hook)
llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
threading.Event().wait()
"""


def test_an_engine_killed_between_reserve_and_commit_leaves_the_server_consistent(
    own_server, make_llm, tmp_path
):
    own_server.start()
    prompts = prompts_of(LENGTHS, seed=531)
    reference = make_llm().generate(prompts, GREEDY)
    marker, log = tmp_path / "held", tmp_path / "child.log"
    env = dict(os.environ, PYTHONPATH=str(Path(atom.__file__).parents[1]))
    with open(log, "wb") as out:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, own_server.url, str(marker), json.dumps(prompts),
             json.dumps(ENGINE_KW)],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_until(lambda: marker.exists() or child.poll() is not None, "the child's copy", 240)
        assert child.poll() is None, log.read_text(errors="replace")[-3000:]
        held = json.loads(marker.read_text())
        assert held["pid"] == child.pid and held["runs"] >= 1
        with SavesProbe(own_server.url) as probe:
            st = probe.status()
        assert st["reserved"] >= 1 and st["open"] == st["reserved"] and st["committed"] == 0, st
        assert staging_bytes(own_server) > 0  # the child's reservations, invisible to readers

        # while the child lives (its reservations held): another engine's lookups do not see
        # them, and it stores the same prompts itself, every object written by it
        other = make_llm(**saves_tier(own_server))
        saves_ready(other, own_server.l1_segment)
        w_other, saves = Watch(other), saves_of(other)
        out = other.generate(prompts, GREEDY, on_step=check)
        same_tokens(out, reference)
        assert [o.tier_hit_tokens for o in out] == [0] * len(prompts)
        other.shutdown()
        got = saves.counts
        assert got["copied"] > 0 and got["resident"] == got["via_server"] == 0, got
        assert got["failed"] == got["aborted"] == 0, got
        with SavesProbe(own_server.url) as probe:
            st = probe.status()
        assert st["committed"] == got["copied"] and st["open"] == st["reserved"] - got["copied"]
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
    # the child is gone: the server releases what it reserved (its owner's process is gone)
    with SavesProbe(own_server.url) as probe:
        st = wait_until(
            lambda: (s := probe.status())["open"] == 0 and s, "the child's reservations' release"
        )
    assert st["reaped"] >= 1 and st["committed"] == got["copied"] and st["aborted"] == 0, st
    assert staging_bytes(own_server) == 0.0
    remove_dead_leftovers()  # the child's pool segment (a SIGKILLed client leaves it)
    assert not list(Path("/dev/shm").glob(f"lmcache_kv_{child.pid}_*"))

    # a third engine loads what the second stored, byte for byte; the reaping took nothing
    third = make_llm(**tier(own_server))
    w = Watch(third)
    out = third.generate(prompts, GREEDY, on_step=check)
    same_tokens(out, reference)
    assert [o.tier_hit_tokens for o in out] == [ceiling(n) for n in LENGTHS]
    w.saved_pages, w.saved_images = w_other.saved_pages, w_other.saved_images
    w.check_loads_byte_exact()


# ---- 5. the server SIGKILLed mid-save ------------------------------------------------------


def test_the_server_killed_mid_save_leaves_the_engine_serving(own_server, make_llm):
    own_server.start()
    prompts = prompts_of(LENGTHS, seed=541)
    reference = make_llm().generate(prompts, GREEDY)
    llm = make_llm(**saves_tier(own_server, **FAST))
    eng, conn, saves = llm.engine, llm.engine.scheduler.connector, llm.engine.tier.saves
    old = saves_ready(llm, own_server.l1_segment)
    inner, killed = saves.flush, []

    def flush():  # the transfer thread, before it sends a round's commits
        if not killed and saves._commits:
            own_server.signal(signal.SIGKILL)  # copied, reserved, never committed
            killed.append(len(saves._commits))
        inner()

    saves.flush = flush
    out = llm.generate(prompts, GREEDY, on_step=check)
    assert killed and not own_server.running
    same_tokens(out, reference)  # the engine kept serving, and every token is right
    # the saves whose commits went to the dead server are of unknown fate: held
    pump(llm, lambda: conn.quarantined_blocks > 0 and not healthy(llm), "a quarantine")
    assert conn.tier_metrics.saves.get(outcome="late") >= 1
    eng.reset_prefix_cache()
    same_tokens(llm.generate(prompts, GREEDY, on_step=check), reference)  # serving, no tier
    saves.flush = inner

    own_server.start()  # the same port, a new segment, an empty L1
    pump(llm, lambda: healthy(llm) and settled(llm), "re-registration and the quarantine's end")
    assert conn.quarantined_blocks == 0
    new = saves_ready(llm, own_server.l1_segment)
    assert new is not old and new.ident.server_id != old.ident.server_id
    before = saves.counts["copied"]
    stores_then_hits(llm, prompts, reference)  # misses and stores, then every prompt hits
    assert saves.counts["copied"] > before  # engine-driven again, into the new segment
    eng.step()
    with SavesProbe(own_server.url) as probe:
        assert probe.status()["open"] == 0
    assert staging_bytes(own_server) == 0.0


# ---- 6. the verdict: unknown is asked again, a server change clears it ----------------------


def test_a_probe_unanswered_in_time_leaves_saves_unknown_then_engine_driven_without_a_restart(
    lmcache_server, make_llm, monkeypatch
):
    prompts = prompts_of(LENGTHS, seed=571)
    reference = make_llm().generate(prompts, GREEDY)
    cue = hold_probe_replies(monkeypatch, EngineSaves)
    monkeypatch.setattr(local_save, "PROBE_WAIT_S", 1.0)  # the probe's wait, which runs out
    llm = make_llm(**saves_tier(lmcache_server, rpc_timeout_s=1.0))
    saves = saves_of(llm)
    mode = lambda: llm.engine.tier_health()["save_mode"]  # noqa: E731
    pump(llm, lambda: mode().startswith("lmcache_driven (unknown: "), "an unknown verdict")
    assert "answers a noop but not atom.reserve within 1 s" in mode(), mode()
    # unknown: every save is the server's store, as before the probe answered
    same_tokens(llm.generate(prompts[:2], GREEDY, on_step=check), reference[:2])
    pump(llm, lambda: settled(llm), "the server's stores")
    assert saves.calls["reserve"] == 0 and sum(saves.counts.values()) == 0
    asked = saves.probe.probes

    cue.set()  # the server answers from now on: the next retry finds the methods
    saves_ready(llm, lmcache_server.l1_segment)
    assert saves.probe.probes > asked
    w1 = Watch(llm)
    same_tokens(llm.generate(prompts[2:], GREEDY, on_step=check), reference[2:])
    llm.shutdown()  # its saves drain before it returns
    got = saves.counts
    assert got["copied"] > 0 and got["via_server"] == got["failed"] == 0, got

    second = make_llm(**tier(lmcache_server))  # loads what the engine copied, byte for byte
    w2 = Watch(second)
    out = second.generate(prompts[2:], GREEDY, on_step=check)
    same_tokens(out, reference[2:])
    assert [o.tier_hit_tokens for o in out] == [ceiling(n) for n in LENGTHS[2:]]
    w2.saved_pages, w2.saved_images = w1.saved_pages, w1.saved_images
    w2.check_loads_byte_exact()


def test_a_restarted_owned_server_is_probed_again_and_saves_and_loads_go_engine_driven(
    make_llm, monkeypatch
):
    """The owned server first starts without its L1 in shared memory: its module says so, a
    definite no for both paths. SIGKILLed, the supervisor restarts it as it should be (same
    port, L1 in /dev/shm): the verdicts are cleared, the probes ask again, and saves and loads
    are the engine's copies, byte-exact, tokens as an engine without a tier."""
    command = LMCacheServer.command

    def first_without_shared_l1(self):
        args = command(self)
        if self.starts == 0:
            at = args.index("--shm-name")
            del args[at : at + 2]
        return args

    monkeypatch.setattr(LMCacheServer, "command", first_without_shared_l1)
    prompts = prompts_of(LENGTHS, seed=581)
    reference = make_llm().generate(prompts, GREEDY)
    paths = dict(load_mode="engine_driven", save_mode="engine_driven")
    llm = make_llm(offload="lmcache_mp", lmcache=dict(FAST, **paths))
    tier_, saves = llm.engine.tier, saves_of(llm)
    health = llm.engine.tier_health
    no = "lmcache_driven (unsupported: the server's L1 is not in shared memory"

    def modes(*want):
        return lambda: tuple(health()[k] for k in ("load_mode", "save_mode")) == want

    pump(llm, lambda: all(health()[k].startswith(no) for k in paths), "two definite no's")
    server, first_pid = tier_.server, tier_.server.pid
    server.signal(signal.SIGKILL)
    pump(llm, lambda: tier_.supervisor.restarts == 1 and healthy(llm), "the restart")
    assert server.pid != first_pid and server.l1_segment
    pump(llm, modes("engine_driven", "engine_driven"), "both paths probed again")
    mapped(llm, server.l1_segment)
    saves_ready(llm, server.l1_segment)

    w = Watch(llm)
    out = llm.generate(prompts, GREEDY, on_step=check)  # misses; the engine copies the saves
    same_tokens(out, reference)
    pump(llm, lambda: settled(llm), "the saves")
    assert saves.counts["copied"] > 0 and saves.counts["failed"] == 0, saves.counts
    pump(llm, modes("engine_driven", "engine_driven"), "both paths")
    llm.engine.reset_prefix_cache()
    out = llm.generate(prompts, GREEDY, on_step=check)  # hits; the engine copies the loads
    pump(llm, lambda: settled(llm), "the loads")
    same_tokens(out, reference)
    assert [o.tier_hit_tokens for o in out] == [ceiling(n) for n in LENGTHS]
    local = llm.engine.scheduler.connector.tier_metrics.local_loads
    assert local.get(outcome="copied") == len(prompts)
    w.check_loads_byte_exact()
