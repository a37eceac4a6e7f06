"""Engine-driven tier loads against real LMCache servers (issue 15): the lookup's answer says
where a hit's objects sit in the server's shared-memory L1, and the engine copies them into its
pool itself. Checked here: outputs and byte-exactness in both load modes, a server killed or
frozen between the answer and the copy, a restart that brings a new segment, namespace
isolation, the fallbacks to the server's own retrieve, and that nothing is left behind: read
locks on the server, mappings of its segment, segments in /dev/shm.

The server's read locks are observed through the server module itself: ``atom.locate`` reads
objects with lmcache's ``unsafe_read``, which answers only for objects that are read-locked
(``KEY_NOT_READABLE`` otherwise), so a locate of one object says whether anyone holds it
locked (``LockProbe``)."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from atom.model_api import pool_bytes
from atom.tier.operations import LookupOp
from atom.tier.server.l1_module import LOCATE_METHOD, LOCATE_VERSION
from atom.tier.server.lmcache_server import L1_SHM_PREFIX, LMCacheServer
from atom.tier.worker_side.locator import IMAGE_GROUP, PAGES_GROUP, Mappings, SegmentId

from .conftest import BLOCK
from .test_tier_faults import FAST, check, healthy, pump, same_tokens, settled
from .test_two_pass import GREEDY, ceiling, prompts_of, tier

LENGTHS = [40, 77, 100, 129, 200]
NON_READ_LOCKED = "finish read on non-read-locked key"  # lmcache's warning on a double free


# ---- what a process leaves behind ----------------------------------------------------------


def l1_mapped() -> list[str]:
    """Lines of /proc/self/maps that map an LMCache L1 segment."""
    with open("/proc/self/maps") as f:
        return [line for line in f if "lmcache_l1_pool" in line]


def l1_segments() -> set[str]:
    """This process's owned servers' L1 segments in /dev/shm."""
    return {p.name for p in Path("/dev/shm").glob(f"{L1_SHM_PREFIX}{os.getpid()}_*")}


@pytest.fixture(autouse=True)
def no_l1_left_behind():
    """After the test's engines are shut down (make_llm's teardown runs first: this fixture is
    set up before it) and its own servers stopped: no mapping of any L1 segment, and no L1
    segment in /dev/shm that was not there before (the session server's)."""
    before = l1_segments()
    yield
    gc.collect()
    assert l1_mapped() == [], "an LMCache L1 segment is still mapped after shutdown"
    assert l1_segments() <= before, "L1 segments left in /dev/shm"


# ---- observing the server's read locks -------------------------------------------------------


class LockProbe:
    """Asks the server, object by object, which of a prompt's objects are read-locked."""

    def __init__(self, url: str, namespace: str):
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        self.namespace = namespace
        self.asked = 0
        self.ctx = zmq.Context()
        self.ctx.linger = 0
        self.client = RequestClientFactory.create(url, context=self.ctx)

    def answer(self, tokens: list[int], end: int, group: int) -> dict:
        from lmcache.v1.multiprocess.protocols.server_module import ServerModuleCallRequest

        # one server session per call, ended after it: the server keeps a session's chunk
        # hashes, so a session asked about one prompt would answer for it about the next
        self.asked += 1
        request_id = f"test-lock-probe-{self.asked}"
        payload = {
            "v": LOCATE_VERSION,
            "model_name": self.namespace,
            "world_size": 1,
            "worker_id": 0,
            "request_id": request_id,
            "token_ids": list(tokens[:end]),
            "start": 0,
            "end": end,
            "groups": [[group, 1]],  # the last object of the group in [0, end)
        }
        req = ServerModuleCallRequest(LOCATE_METHOD, msgspec.msgpack.encode(payload))
        fut = self.client.server_module_call(req)
        assert fut.wait(5.0), "the server did not answer a locate in 5 s"
        resp = fut.result()
        assert resp.success, resp.error
        ended = self.client.end_session(request_id)
        assert ended.wait(5.0), "the server did not end the probe's session in 5 s"
        return msgspec.msgpack.decode(resp.payload)

    def locked(self, prompts: list[list[int]], upto=None) -> list[tuple[int, int, str]]:
        """(prompt index, boundary, "pages"|"image") of every read-locked object of the
        prompts' chunks up to ``upto[i]`` (default: their ceilings)."""
        out = []
        for i, p in enumerate(prompts):
            last = ceiling(len(p)) if upto is None else upto[i]
            for b in range(BLOCK, last + 1, BLOCK):
                for group, what in ((PAGES_GROUP, "pages"), (IMAGE_GROUP, "image")):
                    if self.answer(p, b, group)["found"]:
                        out.append((i, b, what))
        return out

    def close(self) -> None:
        self.client.close()
        self.ctx.destroy(linger=0)

    def __enter__(self) -> LockProbe:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def double_frees(server: LMCacheServer) -> int:
    """How often the server logged a read-lock release of a key nobody held locked."""
    try:
        return server.log_path.read_text(errors="replace").count(NON_READ_LOCKED)
    except OSError:
        return 0


def mapped(llm, name: str | None = None):
    """Step the idle engine until its tier has mapped a server's L1 segment (``name``'s, if
    given) and return the mapping. A segment is mapped on a thread of its own after the
    first answer that names it (at attach: the locate probe); until then hits have no located
    answer and load through the server."""
    ms = llm.engine.tier.mappings

    def ok() -> bool:
        cur = ms.current
        return cur is not None and (name is None or cur.ident.name == name)

    pump(llm, ok, f"the L1 segment {name or ''} to be mapped")
    return ms.current


# ---- watching a connector ----------------------------------------------------------------


def keep(versions: dict[tuple, list[torch.Tensor]], key: tuple, data: torch.Tensor) -> None:
    """Add ``data`` (copied) to the versions saved under ``key`` unless an equal one is there."""
    have = versions.setdefault(key, [])
    if not any(torch.equal(data, v) for v in have):
        have.append(data.clone())


class Watch:
    """Records, on one engine's connector: the bytes each save sent (per chunk's pages and per
    image, keyed by the token prefix they end), each load that landed (with the bytes it put in
    the pool), every release of read locks, every lookup answer and every local copy."""

    def __init__(self, llm):
        self.conn = conn = llm.engine.scheduler.connector
        self.chunk, self.bb = conn.chunk_size, conn.spec.block_bytes
        self.bpc = self.chunk // BLOCK
        self.pool = pool_bytes(conn.pool_tensor)
        # every distinct version saved per prefix: a prefix computed again in another batch
        # (after a miss, a restart) can round differently on CPU, and the server keeps one
        self.saved_pages: dict[tuple, list[torch.Tensor]] = {}
        self.saved_images: dict[tuple, list[torch.Tensor]] = {}
        self.loads: list[dict] = []
        self.frees: list[tuple[str, int, int]] = []
        self.hits: dict[str, int] = {}
        self.located_answers = 0
        self.copies: list[tuple[int, int, int]] = []  # (runs, blocks, bytes differing from L1)

        submit, load_done, free = conn.transfers.submit, conn._load_done, conn.lookups.free_locks
        take = conn.settled.take  # every op the threads posted, as the step thread takes it

        def on_submit(op):
            if op.kind == "save":
                first = op.start // self.chunk
                for k in range(first, op.end // self.chunk):
                    blocks = op.page_blocks[(k - first) * self.bpc : (k - first + 1) * self.bpc]
                    key = tuple(op.token_ids[: (k + 1) * self.chunk])
                    keep(self.saved_pages, key, self.pool[blocks])
                keep(self.saved_images, tuple(op.token_ids[: op.end]), self.pool[op.units])
            return submit(op)

        def on_load_done(st, op):
            self.loads.append(
                dict(
                    lmc_id=st.lmc_id,
                    tokens=list(op.token_ids[: op.end]),
                    start=op.start,
                    end=op.end,
                    local=op.local,
                    pages=self.pool[op.page_blocks].clone(),
                    image=self.pool[op.units].clone(),
                )
            )
            return load_done(st, op)

        def on_free(lmc_id, token_ids, start, end):
            self.frees.append((lmc_id, start, end))
            return free(lmc_id, token_ids, start, end)

        def on_take():
            ops = take()
            for op in ops:
                if isinstance(op, LookupOp):
                    if op.hit:
                        self.hits[op.lmc_id] = op.hit // self.chunk * self.chunk
                    self.located_answers += op.located is not None
            return ops

        conn.transfers.submit, conn._load_done = on_submit, on_load_done
        conn.lookups.free_locks, conn.settled.take = on_free, on_take
        if conn.local is not None:
            copy = conn.local.copy

            def on_copy(located, plan, on_done, **kw):
                copy(located, plan, on_done, **kw)
                # on CPU the copy is complete when it returns: each run's destination blocks
                # hold the located source bytes (compared here, no view of the mapping kept)
                src = located.mapping.data
                differ = sum(
                    int((self.pool[d : d + n].reshape(-1) != src[s : s + n * self.bb]).sum())
                    for s, d, n in plan
                )
                self.copies.append((len(plan), sum(n for _, _, n in plan), differ))
                del src

            conn.local.copy = on_copy

    def check_loads_byte_exact(self) -> None:
        """Every load put in the pool exactly the bytes a save of that prefix sent: each
        chunk's pages and the image at the load's end (one of the versions saved, when the
        prefix was computed and saved more than once)."""
        assert self.loads
        for ld in self.loads:
            toks, first = ld["tokens"], ld["start"] // self.chunk
            for k in range(first, ld["end"] // self.chunk):
                saved = self.saved_pages[tuple(toks[: (k + 1) * self.chunk])]
                got = ld["pages"][(k - first) * self.bpc : (k - first + 1) * self.bpc]
                assert any(
                    torch.equal(got, v) for v in saved
                ), f"pages of chunk {k} differ from each of the {len(saved)} versions stored"
            saved = self.saved_images[tuple(toks)]
            assert any(
                torch.equal(ld["image"], v) for v in saved
            ), f"image at {ld['end']} differs from each of the {len(saved)} versions stored"

    def check_locks_freed_once(self) -> None:
        """Per lookup that hit, its read locks are released once each: the spans the engine
        released, plus the spans of loads the server retrieved (a retrieve through the server
        releases its own span's locks), are disjoint and cover [0, hit) exactly; a copied
        load's span is released by the engine once, after its copy (on CPU: in the copy)."""
        spans: dict[str, list[tuple[int, int]]] = {}
        for lmc_id, start, end in self.frees:
            spans.setdefault(lmc_id, []).append((start, end))
        for ld in self.loads:
            if not ld["local"]:
                spans.setdefault(ld["lmc_id"], []).append((ld["start"], ld["end"]))
        for lmc_id, hit in self.hits.items():
            got = sorted(spans.get(lmc_id, []))
            covered = 0
            for start, end in got:
                assert start == covered, f"{lmc_id}: released {got}, hit {hit}"
                covered = end
            assert covered == hit, f"{lmc_id}: released {got}, hit {hit}"
        for ld in self.loads:
            if ld["local"]:
                span = (ld["lmc_id"], ld["start"], ld["end"])
                assert self.frees.count(span) == 1, f"copied load {span} released {self.frees}"


def two_pass(server, make_llm, prompts, mode: str, **extra):
    """Pass 1 stores the prompts (a fresh engine); pass 2, a fresh engine with an empty pool,
    resumes them from the tier. Returns (pass 1 outputs, pass 2 outputs, pass 2 engine, pass 1
    watch, pass 2 watch)."""
    cfg = tier(server, load_mode=mode, **extra)
    first = make_llm(**cfg)
    if mode == "engine_driven":
        mapped(first)
    w1 = Watch(first)
    out1 = first.generate(prompts, GREEDY, on_step=check)
    first.shutdown()  # its stores drain before it returns
    second = make_llm(**cfg)
    if mode == "engine_driven":
        assert mapped(second).ident.name == server.l1_segment
    w2 = Watch(second)
    out2 = second.generate(prompts, GREEDY, on_step=check)
    pump(second, lambda: settled(second), "pass 2 to settle")
    w2.saved_pages, w2.saved_images = w1.saved_pages, w1.saved_images
    return out1, out2, second, w1, w2


# ---- 1. both modes: outputs, hits, byte-exact loads, locks -----------------------------------


def loads_hold_their_locks(llm, probe, prompts, lengths) -> list:
    """Pass 3 on ``llm`` with its prefix cache emptied: as each load starts, every object it
    reads (its pages and the image at its hit) must be read-locked on the server; returns the
    pass's outputs once its tier work settled."""
    conn = llm.engine.scheduler.connector
    seen, inner = [], conn.start_load

    def start_load(seq, start, end, blocks, image):
        i = next(k for k, p in enumerate(prompts) if seq.tokens[: len(p)] == p)
        upto = [0] * len(prompts)
        upto[i] = end
        seen.append((i, end, set(probe.locked(prompts, upto))))
        return inner(seq, start, end, blocks, image)

    conn.start_load = start_load
    llm.engine.reset_prefix_cache()
    try:
        out = llm.generate(prompts, GREEDY, on_step=check)
    finally:
        conn.start_load = inner
    pump(llm, lambda: settled(llm), "pass 3 to settle")
    assert sorted(i for i, _, _ in seen) == list(range(len(prompts)))
    for i, end, locked in seen:
        assert end == ceiling(lengths[i])
        want = {(i, b, "pages") for b in range(BLOCK, end + 1, BLOCK)} | {(i, end, "image")}
        assert want <= locked, sorted(want - locked)
    return out


@pytest.mark.parametrize("mode", ["engine_driven", "lmcache_driven"])
def test_two_pass_in_both_load_modes_is_exact_and_releases_every_lock(
    lmcache_server, make_llm, mode
):
    prompts = prompts_of(LENGTHS, seed=401 if mode == "engine_driven" else 402)
    freed_twice = double_frees(lmcache_server)
    out1, out2, llm, _, w = two_pass(lmcache_server, make_llm, prompts, mode)
    conn = llm.engine.scheduler.connector
    assert llm.engine.tier_health()["load_mode"] == mode
    same_tokens(out2, out1)
    assert [o.tier_hit_tokens for o in out2] == [ceiling(n) for n in LENGTHS]
    for p, o in zip(prompts, out2):
        assert o.hbm_hit_tokens == 0 and o.tier_hit_tokens + o.computed_prompt_tokens == len(p)
    assert conn.tier_metrics.loads.get(outcome="done") == len(prompts)
    if mode == "engine_driven":
        assert conn.tier_metrics.local_loads.get(outcome="copied") == len(prompts)
        assert conn.tier_metrics.local_loads.get(outcome="via_server") == 0
        assert [ld["local"] for ld in w.loads] == [True] * len(prompts)
        assert w.located_answers == len(prompts)
        # each copy put exactly the located L1 bytes in place, pages and image in one plan
        units = llm.engine.spec.units_per_image
        want = sorted(hit // BLOCK + units for hit in w.hits.values())
        assert sorted(blocks for _, blocks, _ in w.copies) == want
        assert [differ for _, _, differ in w.copies] == [0] * len(prompts)
        assert llm.engine.tier.mappings.mapped == 1
        # every copied load reported where its latency went, each phase once
        phases = conn.tier_metrics.load_phases
        for phase in ("plan", "issue", "issue_cpu", "wait", "copy"):
            assert phases.count(phase=phase) == len(prompts), phase
        assert all(v > 0 for v in phases.samples(phase="copy"))
        assert all(v >= 0 for p in ("plan", "issue", "wait") for v in phases.samples(phase=p))
    else:
        assert conn.local is None and conn.tier_metrics.local_loads.total() == 0
        assert [ld["local"] for ld in w.loads] == [False] * len(prompts)
        assert w.located_answers == 0
    # byte-exact: what each load put in the pool is what pass 1 stored
    w.check_loads_byte_exact()
    w.check_locks_freed_once()

    ns = llm.engine.tier.namespace
    with LockProbe(lmcache_server.url, ns) as probe:
        assert probe.locked(prompts) == [], "read locks left on the server"
        # the probe does see locks: pass 3 on the same engine, empty prefix cache, checks the
        # whole load's objects are locked as each load starts
        same_tokens(loads_hold_their_locks(llm, probe, prompts, LENGTHS), out1)
        assert probe.locked(prompts) == [], "read locks left on the server after pass 3"
    w.check_locks_freed_once()
    assert double_frees(lmcache_server) == freed_twice, "a read lock was released twice"


# ---- 2./3. the server killed or frozen between the answer and the copy ---------------------


def test_sigkill_between_answer_and_copy_then_restart_maps_the_new_segment(own_server, make_llm):
    own_server.start()
    prompts = prompts_of(LENGTHS, seed=411)
    reference = make_llm().generate(prompts, GREEDY)
    llm = make_llm(**tier(own_server, **FAST))
    eng, conn, t = llm.engine, llm.engine.scheduler.connector, llm.engine.tier
    old_name = own_server.l1_segment
    old = mapped(llm, old_name)  # mapped after the tier attached
    w = Watch(llm)
    same_tokens(llm.generate(prompts, GREEDY, on_step=check), reference)
    pump(llm, lambda: settled(llm), "pass 1's stores")

    killed = []
    inner = conn.start_load

    def start_load(seq, start, end, blocks, image):
        if not killed:  # the lookup answered (and located) this load: kill before the copy
            own_server.signal(signal.SIGKILL)
            killed.append((start, end))
        return inner(seq, start, end, blocks, image)

    conn.start_load = start_load
    eng.reset_prefix_cache()
    out = llm.generate(prompts, GREEDY, on_step=check)
    conn.start_load = inner
    assert killed and not own_server.running
    same_tokens(out, reference)  # nothing crashed and every token is right
    for p, o in zip(prompts, out):
        assert o.tier_hit_tokens in (0, ceiling(len(p)))
        assert o.tier_hit_tokens + o.computed_prompt_tokens == len(p)
    # What happens to the load whose server died between its answer and its copy (observed;
    # the outputs above are what the code guarantees): the engine does not know yet (the
    # heartbeat notices within a second), so it copies it from the dead server's segment,
    # which stays mapped and unchanged (its objects were read-locked when the server died),
    # byte-exact. The lookups after the kill find no server: those requests compute.
    assert w.loads and w.loads[0]["local"]
    assert (w.loads[0]["start"], w.loads[0]["end"]) == killed[0]
    assert all(differ == 0 for _, _, differ in w.copies)
    w.check_loads_byte_exact()
    assert sum(o.tier_hit_tokens for o in out) == sum(ld["end"] - ld["start"] for ld in w.loads)

    # the engine keeps serving while the server is down
    eng.reset_prefix_cache()
    same_tokens(llm.generate(prompts, GREEDY, on_step=check), reference)

    own_server.start()  # the same port, a new segment, an empty L1
    assert own_server.l1_segment != old_name
    assert not Path("/dev/shm", old_name).exists(), "the dead server's segment is still there"
    pump(llm, lambda: healthy(llm) and settled(llm), "re-registration")
    eng.reset_prefix_cache()  # the new server's L1 is empty: misses, and stores
    out = llm.generate(prompts, GREEDY, on_step=check)
    same_tokens(out, reference)
    assert [o.tier_hit_tokens for o in out] == [0] * len(prompts)
    pump(llm, lambda: settled(llm), "the stores to the new server")
    # The first locate answer naming the new segment has it mapped (on a thread of its own:
    # test_mapping_a_segment_does_not_stall_the_engine); meanwhile hits load through the new
    # server, and a lookup that misses FAST's 0.5 s deadline on this shared host computes.
    for _ in range(3):
        if t.mappings.current.ident.name == own_server.l1_segment:
            break
        eng.reset_prefix_cache()
        out = llm.generate(prompts, GREEDY, on_step=check)
        same_tokens(out, reference)
        for p, o in zip(prompts, out):
            assert o.tier_hit_tokens in (0, ceiling(len(p)))
        pump(llm, lambda: settled(llm), "a pass to settle")
    new = mapped(llm, own_server.l1_segment)
    assert new is not old and new.ident.server_id != old.ident.server_id
    assert t.mappings.mapped == 2
    eng.reset_prefix_cache()
    before = conn.tier_metrics.local_loads.get(outcome="copied")
    out = llm.generate(prompts, GREEDY, on_step=check)
    same_tokens(out, reference)
    assert [o.tier_hit_tokens for o in out] == [ceiling(n) for n in LENGTHS]
    assert conn.tier_metrics.local_loads.get(outcome="copied") == before + len(prompts)
    pump(llm, lambda: settled(llm), "the last pass to settle")
    eng.step()  # the step thread closes retired mappings no copy reads
    assert old.closed and not new.closed
    w.check_loads_byte_exact()  # every load, through either server or copied, is exact
    maps = "".join(l1_mapped())
    assert old_name not in maps and own_server.l1_segment in maps
    with LockProbe(own_server.url, t.namespace) as probe:
        assert probe.locked(prompts) == []
    assert double_frees(own_server) == 0


def test_sigstop_between_answer_and_copy_outputs_unchanged_nothing_leaks(own_server, make_llm):
    own_server.start()
    prompts = prompts_of(LENGTHS, seed=421)
    reference = make_llm().generate(prompts, GREEDY)
    llm = make_llm(**tier(own_server, **FAST))
    eng, conn, t = llm.engine, llm.engine.scheduler.connector, llm.engine.tier
    mapped(llm, own_server.l1_segment)
    w = Watch(llm)
    same_tokens(llm.generate(prompts, GREEDY, on_step=check), reference)
    pump(llm, lambda: settled(llm), "pass 1's stores")

    frozen = []
    inner = conn.start_load

    def start_load(seq, start, end, blocks, image):
        if not frozen:  # the lookup answered (and located) this load: freeze before the copy
            own_server.signal(signal.SIGSTOP)
            frozen.append((start, end))
        return inner(seq, start, end, blocks, image)

    conn.start_load = start_load
    eng.reset_prefix_cache()
    try:
        out = llm.generate(prompts, GREEDY, on_step=check)
    finally:
        own_server.signal(signal.SIGCONT)
    conn.start_load = inner
    assert frozen
    same_tokens(out, reference)  # nothing crashed and every token is right
    # the frozen server's load is copied all the same (observed: its segment stays mapped and
    # its objects locked); lookups sent to the frozen server go late, and those requests compute
    assert w.loads and w.loads[0]["local"]
    assert (w.loads[0]["start"], w.loads[0]["end"]) == frozen[0]
    for p, o in zip(prompts, out):
        assert o.tier_hit_tokens in (0, ceiling(len(p)))
        assert o.tier_hit_tokens + o.computed_prompt_tokens == len(p)
    assert sum(o.tier_hit_tokens for o in out) == sum(ld["end"] - ld["start"] for ld in w.loads)
    assert all(differ == 0 for _, _, differ in w.copies)
    w.check_loads_byte_exact()
    pump(llm, lambda: healthy(llm) and settled(llm), "the tier to settle after SIGCONT")
    assert conn.quarantined_blocks == 0 and not conn.leases()
    copied = [ld for ld in w.loads if ld["local"]]
    for ld in copied:  # each copied load's span is released once
        assert w.frees.count((ld["lmc_id"], ld["start"], ld["end"])) == 1
    # The copied loads' objects are unlocked. (Not every prompt's: a lookup the step thread
    # gave up on while the server was frozen can leave its locks on the server, a bug of the
    # lookup thread that does not depend on the load mode:
    # test_a_lookup_answered_after_its_request_finished_releases_its_locks.)
    mine = [p for p in prompts if any(ld["tokens"] == p[: ld["end"]] for ld in copied)]
    with LockProbe(own_server.url, t.namespace) as probe:
        assert probe.locked(mine) == [], "the copied loads' read locks were not released"
        # the server kept its L1 and the engine its mapping: every prompt is copied again
        eng.reset_prefix_cache()
        before, loads_before = conn.tier_metrics.local_loads.get(outcome="copied"), len(w.loads)
        out3 = llm.generate(prompts, GREEDY, on_step=check)
        same_tokens(out3, reference)
        assert [o.tier_hit_tokens for o in out3] == [ceiling(n) for n in LENGTHS]
        assert conn.tier_metrics.local_loads.get(outcome="copied") == before + len(prompts)
        assert t.mappings.mapped == 1
        pump(llm, lambda: settled(llm), "pass 3 to settle")
        for ld in w.loads[loads_before:]:
            assert ld["local"]
            assert w.frees.count((ld["lmc_id"], ld["start"], ld["end"])) == 1
        assert probe.locked(mine) == [], "pass 3's read locks were not released"
    w.check_loads_byte_exact()


@pytest.mark.parametrize("mode", ["engine_driven", "lmcache_driven"])
def test_a_lookup_answered_after_its_request_finished_releases_its_locks(
    lmcache_server, make_llm, mode
):
    """A read-lock leak of the lookup thread, fixed (seen first after SIGSTOP/SIGCONT of the
    server; here on cue, with the real server, by holding the lookup thread's first lookup
    until the pass is over). Every lookup is given up by the step thread (LATE), its request
    computes and finishes, and the session's end is queued behind the lookup. Before the fix
    the lookup thread then ran a batch holding both the LATE lookup and its end:
    ``_do_lookup`` submitted it (the server's prefetch read-locked the hit), ``_do_end``
    dropped the adapter's pending entry and ended the session, and the ``_poll`` after the
    batch read the hit as 0, so nothing was freed: the locks stayed until lmcache's read TTL
    (300 s). Now a lookup given up before it is sent is not sent, and a session's end waits
    for a lookup still answering. Both load modes."""
    prompts = prompts_of(LENGTHS, seed=461 if mode == "engine_driven" else 462)
    llm = make_llm(**tier(lmcache_server, load_mode=mode, **FAST))
    eng, conn, t = llm.engine, llm.engine.scheduler.connector, llm.engine.tier
    if mode == "engine_driven":
        mapped(llm)
    out1 = llm.generate(prompts, GREEDY, on_step=check)
    pump(llm, lambda: settled(llm), "pass 1's stores")

    gate, held = threading.Event(), []
    lt = t.lookups
    inner = lt._do_lookup

    def do_lookup(op):  # lookup thread: the first lookup waits for the pass to end
        if not held:
            held.append(op.lmc_id)
            gate.wait(60.0)
        return inner(op)

    lt._do_lookup = do_lookup
    eng.reset_prefix_cache()
    try:
        out2 = llm.generate(prompts, GREEDY, on_step=check)
    finally:
        gate.set()
    same_tokens(out2, out1)
    assert held and [o.tier_hit_tokens for o in out2] == [0] * len(prompts)
    assert conn.tier_metrics.lookups.get(outcome="late") == len(prompts)
    pump(llm, lambda: settled(llm) and lt.sessions_ended == 2 * len(prompts), "sessions to end")
    lt._do_lookup = inner
    with LockProbe(lmcache_server.url, t.namespace) as probe:
        locked = wait_for(lambda: probe.locked(prompts), 3.0)
    assert locked == [], f"read locks of late lookups never released: {locked[:4]}..."


def wait_for(probe_fn, timeout_s: float):
    """Call ``probe_fn`` until it returns something falsy or ``timeout_s`` passes; the last
    result."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = probe_fn()
        if not got or time.monotonic() > deadline:
            return got
        time.sleep(0.2)  # allowed: a bounded poll round of another process's state


# ---- 5. namespace isolation ------------------------------------------------------------------


def test_another_namespace_gets_no_hit_and_no_located_answer(lmcache_server, make_llm):
    prompts = prompts_of(LENGTHS, seed=431)
    first = make_llm(**tier(lmcache_server))
    out1 = first.generate(prompts, GREEDY, on_step=check)
    ns = first.engine.tier.namespace
    first.shutdown()

    other = make_llm(**tier(lmcache_server, model_revision="another-revision"))
    assert other.engine.tier.namespace != ns
    w = Watch(other)
    out = other.generate(prompts, GREEDY, on_step=check)
    same_tokens(out, out1)  # the same weights: a revision name alone keeps the objects apart
    conn = other.engine.scheduler.connector
    assert [o.tier_hit_tokens for o in out] == [0] * len(prompts)
    assert conn.tier_metrics.lookups.get(outcome="miss") == len(prompts)  # answered, not lost
    assert w.located_answers == 0 and conn.tier_metrics.local_loads.total() == 0
    assert other.engine.tier.locator.calls <= 1  # the attach-time probe only: nothing located
    other.shutdown()

    third = make_llm(**tier(lmcache_server))  # the first one's namespace hits and copies
    mapped(third, lmcache_server.l1_segment)
    out3 = third.generate(prompts, GREEDY, on_step=check)
    same_tokens(out3, out1)
    assert [o.tier_hit_tokens for o in out3] == [ceiling(n) for n in LENGTHS]
    assert third.engine.scheduler.connector.tier_metrics.local_loads.get(outcome="copied") == len(
        prompts
    )


# ---- 6. fallbacks to the server's retrieve -----------------------------------------------


def test_a_located_answer_older_than_located_max_age_loads_through_the_server(
    lmcache_server, make_llm
):
    prompts = prompts_of(LENGTHS, seed=441)
    out1, out2, llm, _, w = two_pass(
        lmcache_server, make_llm, prompts, "engine_driven", located_max_age_s=1e-6
    )
    conn = llm.engine.scheduler.connector
    same_tokens(out2, out1)
    assert [o.tier_hit_tokens for o in out2] == [ceiling(n) for n in LENGTHS]
    assert conn.tier_metrics.local_loads.get(outcome="via_server") == len(prompts)
    assert conn.tier_metrics.local_loads.get(outcome="copied") == 0 and w.copies == []
    assert conn.tier_metrics.loads.get(outcome="done") == len(prompts)
    assert [ld["local"] for ld in w.loads] == [False] * len(prompts)
    assert llm.engine.tier_health()["load_mode"] == "engine_driven"  # the mode; per load: aged
    w.check_loads_byte_exact()
    w.check_locks_freed_once()
    with LockProbe(lmcache_server.url, llm.engine.tier.namespace) as probe:
        assert probe.locked(prompts) == []


def test_load_streams_reach_the_engines_copier(lmcache_server, make_llm):
    """``lmcache.load_streams`` is the copier's stream count (on a GPU its copies alternate
    between that many copy streams; tests/gpu/test_tier_load_modes_cuda.py loads with 2)."""
    llm = make_llm(**tier(lmcache_server, load_mode="engine_driven", load_streams=3))
    assert llm.engine.scheduler.connector.local.streams == 3


def test_a_server_without_shared_l1_reports_lmcache_driven_and_still_loads(make_llm):
    server = LMCacheServer(chunk_size=BLOCK, l1_size_gb=0.25)  # shared_l1=False
    server.start()
    try:
        assert server.l1_segment == ""
        prompts = prompts_of(LENGTHS, seed=451)
        cfg = tier(server, load_mode="engine_driven")
        first = make_llm(**cfg)
        mode = lambda: first.engine.tier_health()["load_mode"]  # noqa: E731
        assert mode() != "engine_driven", mode()  # probing, never a wrong mode
        pump(first, lambda: mode().startswith("lmcache_driven"), "the probe to find no module")
        assert mode().startswith("lmcache_driven (") and "--server-module" in mode(), mode()
        out1 = first.generate(prompts, GREEDY, on_step=check)
        first.shutdown()

        second = make_llm(**cfg)
        w = Watch(second)
        out2 = second.generate(prompts, GREEDY, on_step=check)
        pump(second, lambda: settled(second), "pass 2 to settle")
        conn = second.engine.scheduler.connector
        same_tokens(out2, out1)
        assert [o.tier_hit_tokens for o in out2] == [ceiling(n) for n in LENGTHS]
        assert conn.tier_metrics.loads.get(outcome="done") == len(prompts)
        assert conn.tier_metrics.local_loads.get(outcome="copied") == 0 and w.located_answers == 0
        assert second.engine.tier.mappings.current is None and l1_mapped() == []
        mode = lambda: second.engine.tier_health()["load_mode"]  # noqa: E731
        pump(second, lambda: not mode().startswith("probing"), "the probe to end")
        assert "--server-module" in mode(), mode()
        second.shutdown()
    finally:
        server.stop()


# ---- mapping a segment -------------------------------------------------------------------


def test_mapping_a_segment_does_not_stall_the_engine():
    """``Mappings.for_answer`` maps a new segment on a thread of its own so that no lookup
    waits for it. Another thread (standing for the lookup and step threads) ticks every
    millisecond meanwhile: its longest gap is how long the engine stood still. A server of its
    own, 0.5 GiB of L1 that nothing has touched yet. (Before dfd8a46 the segment was mapped with
    MAP_POPULATE, and CPython's mmap.mmap holds the GIL through the populate: 4.0 s of
    standstill for 1 GiB on the shared CI host, 0.35 s for 256 MiB.)"""
    server = LMCacheServer(chunk_size=BLOCK, l1_size_gb=0.5, shared_l1=True)
    server.start()
    ms = Mappings(torch.device("cpu"))
    try:
        with LockProbe(server.url, "any-namespace") as probe:
            ident = SegmentId.of_answer(probe.answer([], 0, PAGES_GROUP))  # identity only
        assert ident.name == server.l1_segment
        ticks, stop = [], threading.Event()

        def tick() -> None:
            while not stop.is_set():
                ticks.append(time.monotonic())
                time.sleep(0.001)  # allowed: the ticker whose gaps measure a stall

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        while len(ticks) < 20:  # the ticker runs
            time.sleep(0.001)  # allowed: a poll round (the ticker thread has started)
        t0 = time.monotonic()
        assert ms.for_answer(ident) is None  # started on the mapping thread
        assert ms.wait_mapped(120.0) and ms.current.ident == ident
        took = time.monotonic() - t0
        stop.set()
        ticker.join()
        ticks.append(time.monotonic())
        gap = max(b - a for a, b in zip(ticks, ticks[1:]) if b >= t0)
        assert gap < 0.25, (
            f"other threads stood still for {gap:.2f} s while a {ident.size / 2**30:.2f} GiB "
            f"segment was mapped ({took:.2f} s)"
        )
    finally:
        ms.close_all()
        server.stop()
