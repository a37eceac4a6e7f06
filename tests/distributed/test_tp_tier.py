"""The tier across ranks (CPU, gloo; rank 0 is this process, rank 1 a spawned one) against real
LMCache servers: every rank registers its pool and moves its part of every transfer.

- Two passes at TP=2, with rank collapse on and off: pass 2 (a fresh engine, an empty pool)
  resumes from the tier at the ceiling and equals pass 1 token for token; each rank loaded
  every hit; with collapse rank 1 stored nothing, without it as much as rank 0. Loads are
  engine-driven on every rank (each rank copies out of the server's shared-memory L1: no
  retrieve): with collapse the one located copy, without it each rank its own objects (rank
  0's lookup located every rank's in the same call). ``load_mode: lmcache_driven`` without
  collapse still makes every part the server's retrieve.
- A located copy rank 1 refuses (a stale answer: another segment; without collapse also no
  location for rank 1 at all) fails the op: the request recomputes on every rank, outputs
  unchanged, and every read lock is released once.
- Without collapse a prompt rank 1 never stored is no hit, though rank 0 stored it.
- The server's stored bytes with collapse are exactly 1/2 of those without.
- Engine-driven saves with rank collapse: rank 0 copies every save into space the server
  reserved (reservations sent ahead through the ranks' transfers, each copy told as its op's
  before the commit), pass 2 resumes from those bytes at the ceiling with pass 1's tokens, and
  the server holds exactly the bytes the server's own stores leave.
- Every read lock a lookup took (one per rank on a collapsed copy, one on each rank's objects
  without collapse) is released once every rank copied (one free of rank 0's, which releases
  every rank's and reader's lock): a non-forced clear afterwards empties the server's L1.
- A rank killed mid-run stops the engine with an error within 30 s; afterwards no rank, no
  owned server and no shared-memory segment is left.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
import urllib.request
from pathlib import Path

import pytest
import zmq

from atom import LLM, SamplingParams
from atom.distributed.broadcast_runtime import RankFailure
from atom.tier.server.admin import clear_server
from atom.tier.server.lmcache_server import LMCacheServer
from tests.distributed.test_tp_engine import KW, alive
from tests.offload.test_engine_driven import double_frees, mapped
from tests.offload.test_two_pass import ceiling, prompts_of

BLOCK = KW["block_size"]
TP_KW = {**KW, "num_blocks": 64, "tensor_parallel_size": 2}
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
PROMPTS = prompts_of([40, 77, 100, 64])


def l1_bytes(server: LMCacheServer) -> float:
    """What the server's L1 holds now, from its own Prometheus gauge (read at scrape time)."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith("lmcache_mp_l1_memory_usage_bytes"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("lmcache_mp_l1_memory_usage_bytes not exported")


def cleared(server: LMCacheServer) -> tuple[float, int]:
    """(the bytes the server's L1 still holds after a non-forced clear, which drops only
    objects no read lock holds; the read locks it saw released twice)."""
    ctx = zmq.Context()
    clear_server(server.url, ctx, 10.0)
    ctx.term()
    return l1_bytes(server), double_frees(server)


def tp_llm(server: LMCacheServer, collapse: str, model: str = "v41-tiny", **tier) -> LLM:
    tier = {"url": server.url, "tp_rank_collapse": collapse, **tier}
    return LLM(model, offload="lmcache_mp", lmcache=tier, **TP_KW)


class SentCopies:
    """Records what rank 0 sends the other ranks for each engine-driven load: (where, ranks)."""

    def __init__(self):
        from atom.tier.worker_side.tier_ranks import RankedTransfers

        self.cls, self.submit = RankedTransfers, RankedTransfers.submit_copies
        self.sent: list[tuple] = []

    def __enter__(self) -> SentCopies:
        def record(transfers, op, where, ranks=()):
            self.sent.append((where, ranks))
            self.submit(transfers, op, where, ranks)

        self.cls.submit_copies = record
        return self

    def __exit__(self, *exc) -> None:
        self.cls.submit_copies = self.submit


class CopiedSaves:
    """Records the saves rank 0's transfers tell the connector were copied (their op's
    ``copied_at``), across ranks: ``RankedTransfers.copied``."""

    def __init__(self):
        from atom.tier.worker_side.tier_ranks import RankedTransfers

        self.cls, self.copied = RankedTransfers, RankedTransfers.copied
        self.ops: list = []

    def __enter__(self) -> CopiedSaves:
        def record(transfers, part):
            self.copied(transfers, part)
            self.ops.append(part.owner)

        self.cls.copied = record
        return self

    def __exit__(self, *exc) -> None:
        self.cls.copied = self.copied


class LoadPathLog(logging.Handler):
    """The tier's ``tier loads:`` lines (rank 0's tier logs it, once, when it attaches)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("tier loads:"):
            self.lines.append((record.levelno, record.getMessage()))


def two_pass(collapse: str, model: str = "v41-tiny", **tier):
    """Pass 1 and pass 2 at TP=2 on a fresh server (its L1 in shared memory, with atom's
    module); returns outputs, health and stored bytes, the first engine's ``tier loads:``
    log lines, what rank 0 sent the other ranks for pass 2's engine-driven loads, and the
    first engine's engine-driven saves (their counts and reservations ahead, and the ops told
    copied; None with the server's stores)."""
    server = LMCacheServer(chunk_size=BLOCK, l1_size_gb=0.2, shared_l1=True)
    server.start(wait=True)
    log, tier_log = LoadPathLog(), logging.getLogger("atom.offload")
    level = tier_log.level
    try:
        tier_log.addHandler(log)
        tier_log.setLevel(logging.INFO)
        with CopiedSaves() as copied:  # (from the start: the tier binds its hook then)
            try:
                first = tp_llm(server, collapse, model, **tier)
            finally:
                tier_log.removeHandler(log)
                tier_log.setLevel(level)
            saves = first.engine.tier.saves  # (the engine lets go of its tier at shutdown)
            out1 = first.generate(PROMPTS, GREEDY)
            health1 = first.engine.tier.health()
            first.shutdown()  # every rank's saves drain before it returns
        engine_saves = None
        if saves is not None:
            engine_saves = (dict(saves.counts), dict(saves.ahead), copied.ops)
        stored = l1_bytes(server)
        second = tp_llm(server, collapse, model, **tier)
        # one read lock per loading rank when they share one copy
        assert second.engine.tier.lookups.readers == (2 if collapse == "true" else 1)
        if second.engine.tier.mappings is not None:  # engine-driven loads
            assert mapped(second).ident.name == server.l1_segment  # else hits go via server
        with SentCopies() as copies:
            out2 = second.generate(PROMPTS, GREEDY)
        health2 = second.engine.tier.health()
        calls = dict(second.engine.tier.lookups.calls)  # the lookup path's round-trips
        second.shutdown()
        left, frees = cleared(server)
        assert frees == 0, "a read lock was released twice"
    finally:
        server.stop()
    return out1, out2, health1, health2, stored, left, log.lines, (copies.sent, calls, engine_saves)


LMCACHE_DRIVEN = "false, load_mode lmcache_driven"


@pytest.fixture(scope="module")
def runs():
    out = {c: two_pass(c) for c in ("true", "false")}
    out[LMCACHE_DRIVEN] = two_pass("false", load_mode="lmcache_driven")
    return out


@pytest.mark.parametrize("collapse", ["true", "false", LMCACHE_DRIVEN])
def test_tp2_two_pass_resumes_from_the_tier_on_every_rank(runs, collapse):
    out1, out2, health1, health2, stored, left, load_log, (sent, calls, saves) = runs[collapse]
    assert saves is None  # the server's stores (save_mode lmcache_driven, the default)
    # every rank copies its loads, unless lmcache_driven is asked for (the server retrieves
    # them): said once at start (INFO) and in /health
    [(level, line)] = load_log
    assert level == logging.INFO
    if collapse == "true":
        assert line.startswith("tier loads: engine_driven (tensor_parallel_size=2 with "), line
    elif collapse == "false":
        assert line.startswith("tier loads: engine_driven (tensor_parallel_size=2 without "), line
    else:
        assert line.startswith("tier loads: lmcache_driven (lmcache.load_mode=lmcache_"), line
    engine_driven = collapse != LMCACHE_DRIVEN
    assert health2["load_mode"] == ("engine_driven" if engine_driven else "lmcache_driven")
    tp = health2["tensor_parallel"]
    assert tp["size"] == 2 and tp["rank_collapse"] is (collapse == "true")
    for p, a, b in zip(PROMPTS, out1, out2):
        assert a.token_ids == b.token_ids
        assert b.tier_hit_tokens == ceiling(len(p)), (len(p), b.tier_hit_tokens)
        assert b.hbm_hit_tokens == 0
    r0, r1 = tp["ranks"]
    hits = sum(o.tier_hit_tokens > 0 for o in out2)
    assert r0["parts"]["load"] == r1["parts"]["load"] == hits
    assert r0["failed"] == r1["failed"] == {"load": 0, "save": 0}
    assert r1["bytes"]["load"] == r0["bytes"]["load"] > 0
    assert "load_ms_p50" in r1, "rank 1's load latency was not recorded"
    # how each rank's parts moved: copied out of the server's L1, or the server's retrieve
    how = "copied" if engine_driven else "retrieved"
    assert r0["loads"] == r1["loads"] == {**{"copied": 0, "refused": 0, "retrieved": 0}, how: hits}
    # one round-trip per lookup (atom.lookup_locate) located every rank's part of each hit;
    # what rank 1 was sent to copy: the one copy (collapse), else its own objects (other
    # spans of the server's L1 than rank 0's)
    if engine_driven:
        assert set(calls) == {"lookup_locate"} and calls["lookup_locate"] >= len(PROMPTS), calls
    assert len(sent) == (hits if engine_driven else 0)
    for where, ranks in sent:
        if collapse == "true":
            assert ranks == ()
        else:
            [own] = ranks
            assert own.ident == where.ident and own.end == where.end
            assert not {*own.pages, own.image} & {*where.pages, where.image}
    s0, s1 = health1["tensor_parallel"]["ranks"]
    assert s0["parts"]["save"] > 0
    if collapse == "true":
        assert s1["parts"]["save"] == 0 and s1["bytes"]["save"] == 0  # one copy: rank 0's
    else:
        assert s1["parts"]["save"] == s0["parts"]["save"]
        assert s1["bytes"]["save"] == s0["bytes"]["save"]
    print(f"collapse={collapse}: rank 0 {r0}; rank 1 {r1}")


def test_v4_at_tp2_resumes_from_one_collapsed_copy():
    """DeepSeek-V4 splits what its layers declare, as V4.1 does, and what the tier stores comes
    from its replicated modules: one copy (rank 0's) serves both ranks, pass 2 resumes at the
    ceiling, and computes pass 1's tokens."""
    out1, out2, _, health2, stored, _, _, _ = two_pass("true", "v4-tiny")
    assert stored > 0
    for p, a, b in zip(PROMPTS, out1, out2):
        assert a.token_ids == b.token_ids
        assert b.tier_hit_tokens == ceiling(len(p)), (len(p), b.tier_hit_tokens)
    r0, r1 = health2["tensor_parallel"]["ranks"]
    assert r0["failed"] == r1["failed"] == {"load": 0, "save": 0}
    assert r1["bytes"]["load"] == r0["bytes"]["load"] > 0


def test_engine_driven_saves_with_rank_collapse_store_what_the_servers_stores_do(runs):
    """save_mode engine_driven at TP=2 with rank collapse: rank 0 copies each save itself,
    pass 2 loads those bytes on both ranks and computes pass 1's tokens."""
    out1, out2, health1, health2, stored, left, _, (_, _, saves) = two_pass(
        "true", save_mode="engine_driven"
    )
    assert health1["save_mode"] == "engine_driven", health1["save_mode"]
    counts, ahead, copied = saves
    s0, s1 = health1["tensor_parallel"]["ranks"]
    assert s0["parts"]["save"] > 0 and s1["parts"]["save"] == 0  # rank 0's one copy
    assert s0["failed"]["save"] == 0
    # every save copied by the engine (none fell back to the server's store), each told to
    # the connector as copied before its commit, each reserved ahead of its step's forward
    assert counts["copied"] + counts["resident"] == s0["parts"]["save"], counts
    assert counts["via_server"] == counts["failed"] == counts["aborted"] == 0, counts
    assert len(copied) == counts["copied"] and all(op.copied_at for op in copied)
    assert ahead["claimed"] > 0, ahead
    # the same objects as the server's stores make, and the same outputs
    assert stored == runs["true"][4] > 0
    for p, a, b, c in zip(PROMPTS, out1, out2, runs["true"][0]):
        assert a.token_ids == b.token_ids == c.token_ids
        assert b.tier_hit_tokens == ceiling(len(p)), (len(p), b.tier_hit_tokens)
    r0, r1 = health2["tensor_parallel"]["ranks"]
    assert r0["failed"] == r1["failed"] == {"load": 0, "save": 0}
    assert r1["bytes"]["load"] == r0["bytes"]["load"] > 0
    assert left == 0, "a read lock was left behind"


def test_collapse_stores_half_the_bytes_and_every_read_lock_is_released(runs):
    with_collapse, without = runs["true"][4], runs["false"][4]
    assert without > 0
    assert with_collapse * 2 == without, (with_collapse, without)
    assert runs[LMCACHE_DRIVEN][4] == without  # who copies loads changes no stored byte
    for collapse, run in runs.items():
        assert run[5] == 0, f"collapse={collapse}: a read lock was left behind"


def test_tp2_outputs_with_the_tier_equal_tp2_without(runs):
    plain = LLM("v41-tiny", **TP_KW)
    try:
        out = plain.generate(PROMPTS, GREEDY)
    finally:
        plain.shutdown()
    assert [o.token_ids for o in out] == [o.token_ids for o in runs["true"][0]]


def _ours(pid: int) -> bool:
    """``pid`` is this process, a descendant of it, or no live process (one this test
    killed); False for a live process of another tree (a test run beside this one)."""
    me = os.getpid()
    while pid > 1:
        if pid == me:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return not Path(f"/proc/{pid}").exists()
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the parent's pid
    return False


def shm_entries() -> set[str]:
    """/dev/shm's entries, less those of a live process outside this one's tree: LMCache
    names a segment after the process that made it (its first number), so a run beside this
    one cannot fail the leak checks; an entry that names no pid always counts."""
    out = set()
    for name in os.listdir("/dev/shm"):
        m = re.search(r"_(\d+)", name)
        if m is None or _ours(int(m.group(1))):
            out.add(name)
    return out


def test_the_leak_check_counts_this_trees_segments_only():
    names = {
        f"atom_leak_check_{os.getpid()}_0": True,  # this process's
        "atom_leak_check_1_0": False,  # a live process of another tree (init)
        "atom_leak_check_nopid": True,  # names no pid
    }
    try:
        for name in names:
            Path("/dev/shm", name).touch()
        seen = shm_entries()
        assert {n: n in seen for n in names} == names
    finally:
        for name in names:
            Path("/dev/shm", name).unlink(missing_ok=True)


def test_a_killed_rank_with_the_tier_leaves_nothing_behind():
    before = shm_entries()
    llm = LLM("v41-tiny", offload="lmcache_mp", lmcache={"l1_size_gb": 0.2}, **TP_KW)
    (proc,) = llm.engine.runtime.processes
    server_pid = llm.engine.tier.server.pid
    steps = []

    def kill_on_third(engine):
        steps.append(1)
        if len(steps) == 3:
            os.kill(proc.pid, signal.SIGKILL)

    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 \(pid \d+\) exited with code -9"):
        llm.generate(prompts_of([70, 90], seed=4), GREEDY, on_step=kill_on_third)
    took = time.monotonic() - t0
    assert took < 30, f"the engine took {took:.0f} s to notice a dead rank"
    llm.shutdown()
    proc.join(5)
    assert not proc.is_alive()
    assert not alive(server_pid), "the owned LMCache server outlived the engine"
    left = shm_entries() - before
    assert not left, f"shared-memory segments left behind: {sorted(left)}"


def test_a_collapsed_lookup_takes_one_read_lock_per_rank():
    """The lookup of a TP=2 engine with collapse holds each object until both ranks released
    it: after one release a non-forced clear keeps it, after the second it drops it (one lock
    per lookup would let the first rank's retrieve unpin an object the second still copies)."""
    from lmcache.integration.atom import AtomMPParallelConfig

    from atom.tier.worker_side.lookup_thread import scheduler_adapter_class

    server = LMCacheServer(chunk_size=BLOCK, l1_size_gb=0.2)
    server.start(wait=True)
    ctx = zmq.Context()
    ctx.linger = 0
    adapters, holder = [], None
    try:
        one = LLM("v41-tiny", offload="lmcache_mp", lmcache={"url": server.url}, **KW)
        prompt = PROMPTS[2]
        one.generate([prompt], GREEDY)
        ns = one.engine.tier.namespace
        one.shutdown()  # its saves drain
        stored = l1_bytes(server)
        # a lookup answers only while a worker of its namespace is registered
        holder = LLM("v41-tiny", offload="lmcache_mp", lmcache={"url": server.url}, **KW)
        assert stored > 0
        par = AtomMPParallelConfig(world_size=1, worker_id=0, tp_size=1)
        looker = scheduler_adapter_class(2)(server.url, ctx, ns, BLOCK, par, mq_timeout=10)
        releaser = scheduler_adapter_class(1)(server.url, ctx, ns, BLOCK, par, mq_timeout=10)
        adapters += [looker, releaser]
        looker.maybe_submit_lookup_request("r", prompt)
        hit = None
        while hit is None:
            hit = looker.check_lookup_result("r")  # a blocking RPC per call: no sleep needed
        assert hit == ceiling(len(prompt)), hit
        clear_server(server.url, ctx, 10.0)  # drops what the lookup did not lock
        locked = l1_bytes(server)
        assert 0 < locked < stored
        releaser.free_lookup_locks(prompt, 0, hit, "r")  # one rank's share
        clear_server(server.url, ctx, 10.0)
        assert l1_bytes(server) == locked, "one release unpinned objects a second rank reads"
        releaser.free_lookup_locks(prompt, 0, hit, "r")  # the other rank's share
        clear_server(server.url, ctx, 10.0)
        assert l1_bytes(server) == 0, "the second release left a lock"
    finally:
        # close the clients before the context: lmcache polls every client of the process on
        # one shared loop, and a context destroyed under it wedges every later client
        for a in adapters:
            a.shutdown()
        ctx.term()
        if holder is not None:
            holder.shutdown()
        server.stop()


def test_a_rank_whose_tier_cannot_attach_leaves_the_engine_serving(runs, monkeypatch):
    """A failing tier never stops the engine: rank 1's attach fails (its pool cannot be
    made), it reports itself unhealthy and binds a pool of its own, rank 0 moves nothing
    through the tier, and the outputs equal TP=2 without the tier."""
    import dataclasses

    from atom.tier.worker_side.tier_ranks import RankedTransfers

    init = RankedTransfers.__init__

    def broken_spec(self, *, spec, **kw):
        init(self, spec=dataclasses.replace(spec, pool_dtype="torch.no_such"), **kw)

    monkeypatch.setattr(RankedTransfers, "__init__", broken_spec)
    before = shm_entries()
    llm = LLM("v41-tiny", offload="lmcache_mp", lmcache={"l1_size_gb": 0.2}, **TP_KW)
    try:
        (proc,) = llm.engine.runtime.processes
        health = llm.engine.tier.health()
        r1 = health["tensor_parallel"]["ranks"][1]
        assert not r1["healthy"] and "tier attach failed" in r1["last_error"], r1
        out = llm.generate(PROMPTS, GREEDY)
        assert proc.is_alive()
        after = llm.engine.tier.health()["tensor_parallel"]["ranks"]
    finally:
        llm.shutdown()
    assert [o.token_ids for o in out] == [o.token_ids for o in runs["true"][0]]
    assert all(o.tier_hit_tokens == 0 for o in out)
    assert after[1]["parts"] == {"load": 0, "save": 0}
    left = shm_entries() - before
    assert not left, f"shared-memory segments left behind: {sorted(left)}"


def test_a_located_copy_rank_1_refuses_fails_the_load_and_releases_every_lock(monkeypatch):
    """Rank 1 is sent a stale answer (the segment's inode one off: another file than the one
    the server describes): it refuses to map it, reports its part refused, the op fails, the
    request recomputes on every rank (pass 2's tokens equal pass 1's), rank 0's single free
    still releases every reader's lock (a non-forced clear empties L1), and the next pass
    copies on both ranks again (rank 1's mapping of the real segment is untouched)."""
    import dataclasses

    from atom.tier.worker_side.tier_ranks import RankedTransfers

    submit = RankedTransfers.submit_copies

    def stale(self, op, where, ranks=()):
        ident = dataclasses.replace(where.ident, ino=where.ident.ino + 1)
        submit(self, op, dataclasses.replace(where, ident=ident), ranks)

    server = LMCacheServer(chunk_size=BLOCK, l1_size_gb=0.2, shared_l1=True)
    server.start(wait=True)
    try:
        first = tp_llm(server, "true")
        out1 = first.generate(PROMPTS, GREEDY)
        first.shutdown()
        monkeypatch.setattr(RankedTransfers, "submit_copies", stale)
        second = tp_llm(server, "true")
        mapped(second)
        out2 = second.generate(PROMPTS, GREEDY)
        refused = second.engine.tier.health()["tensor_parallel"]["ranks"]
        second.shutdown()
        monkeypatch.setattr(RankedTransfers, "submit_copies", submit)
        third = tp_llm(server, "true")
        mapped(third)
        out3 = third.generate(PROMPTS, GREEDY)
        copied = third.engine.tier.health()["tensor_parallel"]["ranks"]
        third.shutdown()
        left, frees = cleared(server)
    finally:
        server.stop()
    assert frees == 0, "a read lock was released twice"
    assert [o.token_ids for o in out2] == [o.token_ids for o in out1]
    assert [o.token_ids for o in out3] == [o.token_ids for o in out1]
    r0, r1 = refused
    assert r1["loads"]["refused"] == r1["failed"]["load"] == r0["loads"]["copied"] > 0, refused
    assert r1["loads"]["copied"] == 0 and r1["bytes"]["load"] == 0
    assert all(o.tier_hit_tokens == 0 for o in out2)  # every hit failed: recomputed
    r0, r1 = copied
    assert r0["loads"]["copied"] == r1["loads"]["copied"] > 0 and r1["failed"]["load"] == 0
    assert left == 0, "a refused copy left a read lock behind"


def skip_rank_1_saves(llm: LLM, lacking: list[int], holed: list[int]) -> list[tuple[int, int]]:
    """Rank 1 never stores ``lacking``, nor the second save of ``holed``: its parts of those
    saves are not sent to it and are counted done, so the server holds rank 0's objects of
    both prompts and, of ``holed``, rank 1's chunks before and after that save's span (a hole
    in one rank's objects). Returns the spans skipped of ``holed`` ([start, end))."""
    import dataclasses

    transfers = llm.engine.tier.transfers
    send = transfers.ranks.send
    lacking_head, holed_head = tuple(lacking[:BLOCK]), tuple(holed[:BLOCK])
    holes: list[tuple[int, int]] = []

    def send_but_rank_1s(name, *args):
        part = args[0] if args else None
        if name == "tier_op" and part.kind == "save":
            head = part.token_ids[:BLOCK]
            skip = head == lacking_head
            if head == holed_head and part.start > 0 and not holes:
                holes.append((part.start, part.end))
                skip = True
            if skip:
                transfers._part(1, part.op_id, "done", True, "", None)
                return True
        return send(name, *args)

    transfers.ranks = dataclasses.replace(transfers.ranks, send=send_but_rank_1s)
    return holes


def test_without_collapse_a_hit_rank_1_lacks_is_none_and_a_part_it_cannot_copy_fails(
    monkeypatch,
):
    """Without rank collapse each rank copies its own objects, which rank 0's lookup located
    for every rank in one call:

    - pass 1 stores every prompt, but rank 1 never stores the last one, and of the third one
      not its second save (rank 1 holds chunks before and after that span): pass 2 does not
      hit the last one (a chunk one rank lacks is no hit), hits the third one up to the hole
      in rank 1's objects and no further, and every other prompt at the ceiling, each rank
      copying its own part;
    - pass 3 sends rank 1 no location of its own (it must not copy rank 0's objects instead),
      pass 4 a stale one (another inode): rank 1 refuses every part, the ops fail, the
      requests recompute on every rank with pass 1's tokens;
    - no read lock is left behind (a non-forced clear empties L1) and none was released twice
      (the server logs no release of an unlocked key)."""
    from atom.tier.worker_side.tier_ranks import RankedTransfers

    submit = RankedTransfers.submit_copies

    def none_for_rank_1(self, op, where, ranks=()):
        submit(self, op, where, ())

    def stale_for_rank_1(self, op, where, ranks=()):
        import dataclasses

        ident = dataclasses.replace(ranks[0].ident, ino=ranks[0].ident.ino + 1)
        submit(self, op, where, (dataclasses.replace(ranks[0], ident=ident),))

    lacking, holed = PROMPTS[-1], PROMPTS[2]
    server = LMCacheServer(chunk_size=BLOCK, l1_size_gb=0.2, shared_l1=True)
    server.start(wait=True)
    outs, ranks = [], []
    try:
        first = tp_llm(server, "false")
        holes = skip_rank_1_saves(first, lacking, holed)
        outs.append(first.generate(PROMPTS, GREEDY))
        first.shutdown()
        for patch in (None, none_for_rank_1, stale_for_rank_1):
            monkeypatch.setattr(RankedTransfers, "submit_copies", patch or submit)
            llm = tp_llm(server, "false")
            mapped(llm)
            outs.append(llm.generate(PROMPTS, GREEDY))
            ranks.append(llm.engine.tier.health()["tensor_parallel"]["ranks"])
            llm.shutdown()
        left, frees = cleared(server)
    finally:
        server.stop()
    assert frees == 0, "a read lock was released twice"
    assert left == 0, "a read lock was left behind"
    for out in outs[1:]:
        assert [o.token_ids for o in out] == [o.token_ids for o in outs[0]]
    copied, missing, stale = ranks
    hits = [o.tier_hit_tokens for o in outs[1]]
    # the hole starts past the first chunk and ends before the prompt's last full chunk
    assert len(holes) == 1 and 0 < holes[0][0] < holes[0][1] < ceiling(len(holed)), holes
    want = [ceiling(len(p)) for p in PROMPTS[:-1]] + [0]
    want[2] = holes[0][0]  # capped where rank 1's objects stop, though rank 0 holds them all
    assert hits == want, (hits, holes)
    r0, r1 = copied
    assert r0["loads"]["copied"] == r1["loads"]["copied"] == len(PROMPTS) - 1
    assert r0["failed"] == r1["failed"] == {"load": 0, "save": 0}
    assert r1["bytes"]["load"] == r0["bytes"]["load"] > 0
    for refused in (missing, stale):
        r0, r1 = refused
        assert r1["loads"]["refused"] == r1["failed"]["load"] == r0["loads"]["copied"] > 0
        assert r1["loads"]["copied"] == 0 and r1["bytes"]["load"] == 0
    assert all(o.tier_hit_tokens == 0 for out in outs[2:] for o in out)  # recomputed


def test_without_collapse_a_server_without_the_one_call_locates_every_rank_in_one_locate():
    """A server whose module lacks ``atom.lookup_locate`` (as before issue 39): LMCache's
    lookup, then one ``atom.locate`` per hit that locates every rank's objects; pass 2 copies
    on both ranks with pass 1's tokens and leaves no read lock behind."""
    from tests.offload.test_one_rpc_lookup import OldModuleServer

    server = OldModuleServer(chunk_size=BLOCK, l1_size_gb=0.2, shared_l1=True)
    server.start(wait=True)
    try:
        first = tp_llm(server, "false")
        out1 = first.generate(PROMPTS, GREEDY)
        first.shutdown()
        second = tp_llm(server, "false")
        mapped(second)
        out2 = second.generate(PROMPTS, GREEDY)
        r0, r1 = second.engine.tier.health()["tensor_parallel"]["ranks"]
        calls = dict(second.engine.tier.lookups.calls)
        second.shutdown()
        left, frees = cleared(server)
    finally:
        server.stop()
    assert [o.token_ids for o in out2] == [o.token_ids for o in out1]
    assert [o.tier_hit_tokens for o in out2] == [ceiling(len(p)) for p in PROMPTS]
    n = len(PROMPTS)
    assert calls["lookup"] == calls["locate"] == n and "lookup_locate" not in calls, calls
    assert r0["loads"]["copied"] == r1["loads"]["copied"] == n, (r0, r1)
    assert r1["bytes"]["load"] == r0["bytes"]["load"] > 0
    assert left == 0 and frees == 0
