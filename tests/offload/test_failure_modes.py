"""One test (or a few) per failure mode of design/FAILURE_MODES.md, on a real engine (v41-tiny,
CPU) whose tier is an OffloadConnector over fakes that end lookups and transfers on cue
(tests/offload/fakes.py), and on the transfer and lookup threads driven directly.

Modes 16-17 (CUDA interprocess events, stream ordering) need a GPU; the CPU-checkable half of 16
(events are pooled, reused and held until their op is terminal) is tested with a stand-in
event. Mode 18 (the namespace) is covered by the namespace tests, not here.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from atom.engine.model_runner import ModelRunner, SlotOwnershipError
from atom.engine.scheduler import ScheduledSpan
from atom.engine.sequence import SeqStatus, Sequence
from atom.model_api import pool_bytes
from atom.models.registry import load_runtime
from atom.sampling_params import SamplingParams
from atom.tier.config import OffloadConfig
from atom.tier.operations import LookupOp, OpState

from .fakes import (
    BLOCK,
    FakeFuture,
    FakeWorkerAdapter,
    StuckThread,
    cursor_of_image,
    image_bytes,
    make_transfer_thread,
    prompt_of,
    transfer_op,
    unstarted_lookup_thread,
    wired_transfer_thread,
)

WAIT_S = 10.0  # upper bound for a thread to reach a barrier (never slept)


def fill_tier(h, prompt, max_tokens=2):
    """Run ``prompt`` with every save completing at once (the server ends up holding each
    boundary), then empty the local cache so the next run of it must come from the tier."""
    auto = h.transfers.auto
    h.transfers.auto = {"save"}
    seq = h.add(prompt, max_tokens)
    h.run([seq])
    h.step()  # fold the last outcomes in
    h.engine.reset_prefix_cache()
    h.transfers.auto = auto
    return seq


def cached_without_images(h, prompt) -> None:
    """Run ``prompt`` with every save completing (the tier holds each boundary), then evict
    every image: its blocks stay cached with their hashes but are no hit, so the next run of
    it loads from the tier."""
    h.transfers.auto = {"save"}
    first = h.add(prompt, max_tokens=1)
    h.run([first])
    h.step()
    h.transfers.auto = set()
    while h.engine.scheduler.store.evict_fewest_dependents():
        pass


def ops_of(h, seq, kind=None):
    st = h.tier_state(seq)
    if st is None:
        return []
    lmc = st.lmc_id
    return [op for op in h.transfers.submitted if op.lmc_id == lmc and kind in (None, op.kind)]


def assert_held(h, blocks):
    """Blocks owned by someone: never handed out by an allocation."""
    for b in blocks:
        assert h.pool.ref[b] >= 1, f"block {b} lost its lease (ref 0)"
    assert not set(blocks) & h.reusable_blocks(), "a leased block is allocatable"


def assert_saved_what_was_decided(h, op):
    """The bytes the server read at completion are the bytes the save was decided on."""
    pages, units = h.transfers.snapshots[op.op_id]
    got_pages, got_units = h.server.read[op.op_id]
    assert torch.equal(pages, got_pages), f"{op}: page bytes changed while leased"
    assert torch.equal(units, got_units), f"{op}: image bytes changed while leased"


# ---- 1. the fence sees every stage ---------------------------------------------------------------


def test_fm1_queued_save_keeps_its_blocks_when_its_request_finishes(make):
    h = make(num_blocks=24)
    a = h.add(prompt_of(35, 1), max_tokens=1)
    h.run([a])
    saves = ops_of(h, a, "save")
    assert [(o.start, o.end) for o in saves] == [(0, 16), (16, 32)]
    assert all(o.state is OpState.QUEUED for o in saves)  # decided, never sent
    assert a.is_finished and a.block_table == []
    leased = [b for o in saves for b in o.page_blocks]
    units = [u for o in saves for u in o.units]
    assert_held(h, leased + units)
    assert all(o.image.pins >= 1 for o in saves)

    # another request takes the rest of the pool; its own saves complete at once
    h.transfers.auto = {"save"}
    b = h.add(prompt_of(200, 2), max_tokens=2)
    while not b.is_finished:
        h.step()
        assert_held(h, leased + units)
        assert not set(leased + units) & set(b.block_table)
    assert h.engine.store.evicted + h.pool.evictions > 0, "the pool was never under pressure"

    for o in saves:
        h.transfers.complete(o)
    h.step()
    for o in saves:
        assert o.state is OpState.DONE and h.connector.is_stored(o.image)
        assert_saved_what_was_decided(h, o)
    assert h.connector.leases() == {}
    h.shutdown()


def test_fm1_queued_saves_keep_their_blocks_through_preemption(make):
    h = make(num_blocks=20, max_num_seqs=2)
    prompts = [prompt_of(64, 1), prompt_of(64, 2)]
    seqs = [h.add(p, max_tokens=3) for p in prompts]
    h.step_until(lambda: h.engine.scheduler.preemptions > 0, max_steps=20)
    victim = next(s for s in seqs if s.counters.preemptions)
    pending = [o for o in ops_of(h, victim, "save") if o.state is OpState.QUEUED]
    assert pending, "the preempted request had no save in the queue"
    leased = [b for o in pending for b in o.page_blocks]
    assert victim.num_computed == 0 and not set(leased) & set(victim.block_table)
    assert_held(h, leased)
    for s in seqs:
        if s is not victim:
            assert not set(leased) & set(s.block_table)

    h.transfers.auto = {"save"}
    h.transfers.complete_all()
    h.run(seqs)
    for o in pending:
        assert_saved_what_was_decided(h, o)

    ref = make(num_blocks=64)
    ref.transfers.auto = {"save"}
    alone = [ref.add(p, max_tokens=3) for p in prompts]
    ref.run(alone)
    assert [s.output for s in seqs] == [s.output for s in alone]
    h.shutdown()


@pytest.mark.parametrize("how", ["thread_deadline", "scheduler_deadline"])
def test_fm1_late_load_keeps_its_blocks_quarantined_until_it_resolves(make, how):
    h = make(offload={"transfer_timeout_s": 2.0})
    p = prompt_of(87, 3)
    first = fill_tier(h, p, max_tokens=3)
    s = h.add(p, max_tokens=3)
    h.step_until(lambda: h.transfers.loads)
    load = h.transfers.loads[0]
    dest = list(load.page_blocks) + list(load.units)

    if how == "thread_deadline":
        h.transfers.late(load)
    else:  # the thread never answered: the scheduler's own bound (deadline + margin)
        h.clock.advance(2.0 + 1.5)
    h.step()
    assert load.state is OpState.LATE and load in h.connector.quarantined
    assert s.counters.failed_loads == 1
    assert h.connector.quarantined_blocks == len(load.page_blocks)

    h.transfers.auto = {"save"}
    h.step()
    h.step()
    assert s.status is SeqStatus.RUNNING  # recomputing, into other blocks
    for _ in range(2):
        assert_held(h, dest)
        assert not set(dest) & set(s.block_table)
        h.step()

    # the server answers at last, writing the blocks it was given: nobody else holds them
    h.transfers.complete(load, ok=True)
    h.step()
    assert load not in h.connector.quarantined and not load.leased
    h.run([s])
    assert s.output == first.output
    h.shutdown()


# ---- 2. a finished request's tail save ------------------------------------------------------


def test_fm2_tail_save_of_a_finished_request_completes_then_releases(make):
    h = make(num_blocks=24)
    p = prompt_of(40, 4)
    s = h.add(p, max_tokens=1)
    h.run([s])
    st = h.tier_state(s)
    saves = ops_of(h, s, "save")
    assert len(saves) == 2 and not st.alive and s.block_table == []
    h.step()
    assert st in h.connector._requests.values() and st.lmc_id not in h.lookups.ended

    # the pool churns meanwhile (cached blocks evicted, images dropped with their prefix)
    h.transfers.auto = {"save"}
    other = h.add(prompt_of(200, 5), max_tokens=1)
    h.run([other])

    for o in saves:
        h.transfers.complete(o)
    h.step()
    for o in saves:
        assert o.state is OpState.DONE and h.connector.is_stored(o.image) and not o.leased
        assert o.token_ids[: o.end] == p[: o.end]  # an op reads its tokens up to its end
        assert_saved_what_was_decided(h, o)
    assert st not in h.connector._requests.values()
    assert h.lookups.ended.count(st.lmc_id) == 1
    assert h.server.hit(p[:39]) == 32  # stored under the request's own hashes
    h.shutdown()
    assert h.lookups.ended.count(st.lmc_id) == 1


def test_fm2_abandoned_tail_saves_release_their_leases(make):
    h = make()
    s = h.add(prompt_of(50, 6), max_tokens=1)
    h.run([s])
    st = h.tier_state(s)
    s1, s2, s3 = ops_of(h, s, "save")
    # s1: the server lost it (late, then given up on); s2 failed; s3 pending at shutdown
    h.transfers.late(s1)
    h.step()
    assert s1 in h.connector.quarantined and s1.leased
    s1.resolve(False, "lost: the server that held it is gone")
    h.transfers.post(s1)
    h.transfers.complete(s2, ok=False)
    h.step()
    assert not s1.leased and not s2.leased and s3.leased
    assert st in h.connector._requests.values()  # s3 still reads its blocks
    assert not (h.connector.is_stored(s1.image) or h.connector.is_stored(s2.image))
    h.shutdown()  # asserts no lease, pin or session is left
    assert s3.state is OpState.FAILED and not s3.leased
    assert h.lookups.ended.count(st.lmc_id) == 1


def test_fm2_load_that_completes_after_its_request_was_aborted(make):
    h = make()
    p = prompt_of(87, 7)
    first = fill_tier(h, p, max_tokens=2)
    r = h.add(p, max_tokens=2)
    h.step_until(lambda: h.transfers.loads)
    load = h.transfers.loads[0]
    assert h.engine.abort(r.request_id)
    h.step()
    assert_held(h, load.page_blocks)  # the load still writes them
    h.transfers.complete(load, ok=True)
    h.step()
    hashed_free = [b for b in h.free_blocks() if h.pool.hash_of[b] is not None]
    assert not hashed_free, f"free blocks carry hashes: {hashed_free}"
    img = load.image
    assert not (img.ready and img.pins == 0 and img.key not in h.engine.store._lru)

    h.transfers.auto = {"save", "load"}
    again = h.add(p, max_tokens=2)
    h.run([again])
    assert again.output == first.output
    h.shutdown()


# ---- 3. a failed load's destination is not a save source -----------------------------------


@pytest.mark.parametrize("how", ["failed", "late"])
def test_fm3_failed_load_destination_is_never_a_save_source(make, how):
    h = make()
    p = prompt_of(87, 8)
    first = fill_tier(h, p, max_tokens=2)
    clean = {(o.start, o.end): h.server.read[o.op_id] for o in ops_of(h, first, "save")}
    s = h.add(p, max_tokens=2)
    h.step_until(lambda: h.transfers.loads)
    load = h.transfers.loads[0]
    dest = list(load.page_blocks)
    pool_bytes(h.engine.runner.pool)[dest] = 0xAB  # a partial write before the failure

    if how == "failed":
        h.transfers.complete(load, ok=False)
    else:
        h.transfers.late(load)
    h.transfers.auto = {"save"}
    h.run([s])
    h.step()
    assert s.counters.failed_loads == 1 and s.output == first.output
    later = [o for o in ops_of(h, s, "save") if o.op_id > load.op_id]
    assert later, "the recomputed span was never saved"
    for o in later:
        assert o.image is not load.image
        if how == "late":  # still quarantined: the recompute could not have used them
            assert not set(o.page_blocks) & set(dest)
        pages, units = h.server.read[o.op_id]
        assert not (pages == 0xAB).all(dim=1).any(), f"{o} read a stale destination block"
        ref_pages, _ = clean[(o.start, o.end)]
        assert torch.equal(pages, ref_pages), f"{o}: bytes differ from a clean computation"
    h.transfers.complete_all(ok=False)
    h.shutdown()


@pytest.mark.parametrize("how", ["failed", "late", "refused"])
def test_a_failed_load_releases_each_read_lock_exactly_once(make, how):
    """A retrieve that reached the server releases the read locks it holds, failed or not
    (lmcache 0.5.6); the engine frees the range itself only when its load never got there.
    Freed twice, a lock count would drop another request's lock on a shared object."""
    h = make()
    p = prompt_of(87, 9)
    first = fill_tier(h, p, max_tokens=2)
    s = h.add(p, max_tokens=2)
    h.step_until(lambda: h.transfers.loads)
    load = h.transfers.loads[0]
    lmc = h.tier_state(s).lmc_id
    if how == "failed":
        h.transfers.complete(load, ok=False)
    elif how == "late":
        h.transfers.late(load)
    else:
        h.transfers.refuse(load)
    h.transfers.auto = {"save"}
    h.run([s])
    h.step()
    assert s.counters.failed_loads == 1 and s.output == first.output
    if how == "late":  # the retrieve ends after all: the server releases its locks then
        assert h.lookups.frees_of(lmc) == []
        h.transfers.complete(load, ok=False)
        h.step()
    freed = [(load.start, load.end)] if how == "refused" else []
    assert h.lookups.frees_of(lmc) == freed
    assert all(t == r == 1 for t, r in h.lookups.lock_balance(lmc).values())
    h.transfers.complete_all(ok=False)
    h.shutdown()


# ---- 4. blocks still read by another op stay leased ----------------------------------------


def test_fm4_retiring_one_op_keeps_the_blocks_its_siblings_still_read(make):
    h = make()
    s = h.add(prompt_of(50, 9), max_tokens=4)
    h.step_until(lambda: len(ops_of(h, s, "save")) == 3)
    s1, s2, s3 = ops_of(h, s, "save")
    assert not s.is_finished
    # one retires while its request still runs: the request keeps the blocks
    h.transfers.complete(s1)
    h.step()
    assert not s1.leased and all(h.pool.ref[b] == 1 for b in s1.page_blocks)
    assert set(s1.page_blocks) <= set(s.block_table)
    h.run([s])
    # the request is gone; one sibling fails: the other still holds its blocks and image
    h.transfers.complete(s2, ok=False)
    h.step()
    assert not s2.leased and s3.leased
    assert_held(h, s3.page_blocks + s3.units)
    assert s3.image.pins == 1 and s3.image in h.engine.store.owners()
    for b in s2.page_blocks:
        assert h.pool.ref[b] == 0
    h.transfers.complete(s3)
    h.step()
    assert_saved_what_was_decided(h, s3)
    h.shutdown()


# ---- 5. cursor equality does not prove slot ownership --------------------------------------


def test_fm5_runner_refuses_a_new_owner_continuing_at_the_old_cursor():
    runtime = load_runtime(
        "v41-tiny",
        dtype=torch.float32,
        kv_dtype="fp32",
        index_dtype="fp32",
        block_size=BLOCK,
        device="cpu",
        seed=0,
    )
    runner = ModelRunner(runtime, num_blocks=8, num_slots=1)
    runner.bind()
    params = SamplingParams(max_tokens=1)
    a = Sequence(prompt_of(20, 1), params)
    b = Sequence(prompt_of(20, 2), params)
    a.slot = b.slot = 0
    a.block_table, b.block_table = [0, 1], [2, 3]

    runner.execute([ScheduledSpan(a, 0, 16)])
    runner.execute([ScheduledSpan(b, 0, 16)])  # b enters the slot at 0 (reset)
    assert runtime.slots.position(0) == 16  # the cursor a left it at, by coincidence
    before = runner.slot_bytes[0].clone()
    with pytest.raises(SlotOwnershipError):
        runner.execute([ScheduledSpan(a, 16, 20)])
    assert torch.equal(runner.slot_bytes[0], before), "refused after touching the slot"
    runner.execute([ScheduledSpan(b, 16, 20)])  # the owner continues
    assert runtime.slots.position(0) == 20


# ---- 6. the image is taken before the next step mutates the state --------------------------


def test_fm6_every_image_holds_the_cursor_and_state_of_its_boundary(make):
    h = make()
    h.transfers.auto = {"save"}
    seqs = [h.add(prompt_of(45, 10), max_tokens=8), h.add(prompt_of(38, 11), max_tokens=12)]
    eng, checked = h.engine, set()
    while not all(s.is_finished for s in seqs):
        h.step()
        for s in seqs:
            n = s.num_computed
            if s.is_finished or n % BLOCK or n == 0:
                continue
            img = eng.store.get_ready(s.block_hashes[n // BLOCK - 1])
            assert img is not None and img.position == n
            # taken this step, and no later step has touched the slot since
            assert cursor_of_image(eng, img.units) == [n, *s.tokens[n - 3 : n]]
            assert torch.equal(image_bytes(eng, img.units), eng.runner.slot_bytes[s.slot])
            checked.add((s.seq_id, n))
    assert {n for _, n in checked} >= {16, 32, 48}  # 48: taken by a decode step
    for o in h.transfers.saves:  # and what the tier got
        _, units = h.server.read[o.op_id]
        f = eng.runtime.geometry.field("cursor")
        cur = units.reshape(-1)[f.offset : f.offset + f.nbytes].clone().view(torch.int64)
        assert int(cur[0]) == o.end
    h.shutdown()


# ---- 7. committed positions ------------------------------------------------------------------


def test_fm7_saves_cover_only_committed_positions(make):
    h = make()
    seen = []
    h.transfers.on_submit = lambda op: seen.append(
        (op, op.owner.seq.num_computed, op.owner.seq.num_tokens, op.image.ready)
    )
    h.transfers.auto = {"save"}
    s = h.add(prompt_of(40, 12), max_tokens=12)
    h.step_until(lambda: s.num_computed == 40)
    # optimistic tokens (as drafts would be) past two boundaries: nothing of them is saved
    drafts = prompt_of(24, 13)
    s.tokens.extend(drafts)
    before = len(seen)
    h.connector.after_step([s])
    assert len(seen) == before
    del s.tokens[-len(drafts) :]
    h.run([s])
    assert seen
    for op, computed, _, ready in seen:
        assert op.end <= computed and op.image.position == op.end and ready
    assert any(op.end == 48 for op, *_ in seen)  # committed by a decode step
    h.shutdown()


# ---- 8. the prefill tail ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [17, 47, 48, 49, 64])
def test_fm8_every_hit_leaves_a_prompt_token_to_compute(make, n):
    h = make()
    p = prompt_of(n, 14)
    first = h.add(p, max_tokens=2)
    h.transfers.auto = {"save", "load"}
    h.run([first])
    ceiling = (n - 1) // BLOCK * BLOCK

    hbm = h.add(p, max_tokens=2)  # the local cache holds all of it
    h.run([hbm])
    c = hbm.counters
    assert c.hbm_hit_tokens == ceiling and c.computed_prompt_tokens == n - ceiling >= 1

    h.engine.reset_prefix_cache()
    tier = h.add(p, max_tokens=2)  # the tier holds all of it
    h.run([tier])
    assert h.lookups.ops[-1].token_ids == p[:-1]
    c = tier.counters
    assert c.tier_hit_tokens == ceiling and c.computed_prompt_tokens == n - ceiling >= 1
    assert first.output == hbm.output == tier.output
    h.shutdown()


# ---- 9. the ends agree -----------------------------------------------------------------------


def test_fm9_full_prompt_tier_hit_page_end_image_and_resume_agree(make):
    h = make(max_num_seqs=1, max_num_batched_tokens=BLOCK)
    p = prompt_of(5 * BLOCK + 7, 15)
    first = fill_tier(h, p, max_tokens=4)
    spans = []
    execute = h.engine.runner.execute
    h.engine.runner.execute = lambda sps: (spans.extend(sps), execute(sps))[1]
    s = h.add(p, max_tokens=4)
    h.step_until(lambda: h.transfers.loads)
    load = h.transfers.loads[0]
    assert h.lookups.ops[-1].token_ids == p[:-1]
    assert (load.start, load.end) == (0, 5 * BLOCK) and load.image.position == load.end
    h.transfers.complete(load)
    assert cursor_of_image(h.engine, load.units)[0] == load.end
    h.run([s])
    resumed = spans[0]
    assert resumed.seq is s and resumed.restore is load.image
    assert resumed.start == load.end  # the runner checked the restored cursor against it
    assert s.counters.tier_hit_tokens == 5 * BLOCK and s.counters.computed_prompt_tokens == 7
    assert s.output == first.output
    h.shutdown()


def test_fm9_hbm_first_then_the_tier_from_the_hbm_hit(make):
    h = make(auto_lookups=False)
    p = prompt_of(87, 16)
    h.lookups.auto = True
    first = fill_tier(h, p, max_tokens=2)
    h.lookups.auto = False
    h.transfers.auto = {"save", "load"}
    local = h.add(p[:40], max_tokens=1)  # the local cache gets [0, 32), the tier is not asked
    h.step()
    h.lookups.answer(h.lookups.ops[-1], 0)
    h.run([local])

    s = h.add(p, max_tokens=2)
    h.step()
    lk = h.lookups.ops[-1]
    h.lookups.answer(lk)
    h.run([s])
    lmc = h.tier_state(s).lmc_id
    (load,) = ops_of(h, s, "load")
    assert (load.start, load.end) == (32, 80)
    assert h.lookups.frees_of(lmc) == [(0, 32)]  # HBM covers it: freed, once
    assert all(t == r == 1 for t, r in h.lookups.lock_balance(lmc).values())
    c = s.counters
    assert (c.hbm_hit_tokens, c.tier_hit_tokens, c.computed_prompt_tokens) == (32, 48, 7)
    assert s.output == first.output
    h.shutdown()


# ---- 10. a lookup that did not answer is not an empty answer ---------------------------------


@pytest.mark.parametrize("how", ["timeout", "rpc_error"])
def test_fm10_unanswered_lookup_gives_no_load_and_no_saves(make, how):
    h = make(auto_lookups=False, offload={"lookup_timeout_s": 2.0})
    h.transfers.auto = {"save", "load"}
    control = h.add(prompt_of(40, 17), max_tokens=1)
    h.step()
    h.lookups.answer(h.lookups.ops[-1], 0)  # an empty answer: the tier lacks it, so store
    h.run([control])
    assert [(o.start, o.end) for o in ops_of(h, control, "save")] == [(0, 16), (16, 32)]

    s = h.add(prompt_of(87, 18), max_tokens=2)
    h.step()
    (lk,) = [o for o in h.lookups.ops if o.owner.seq is s]
    h.step()
    assert s.status is SeqStatus.WAITING_FOR_TIER and not h.last.ran
    if how == "timeout":
        h.clock.advance(1.9)
        h.step()
        assert s.status is SeqStatus.WAITING_FOR_TIER
        h.clock.advance(0.2)
    else:
        h.lookups.fail(lk)
    h.run([s])
    h.step()
    assert ops_of(h, s, "load") == [] and ops_of(h, s, "save") == []
    if how == "timeout":  # the answer comes after all: nothing changes
        assert lk.state is OpState.LATE
        h.lookups.answer(lk, 48)
        h.step()
        assert ops_of(h, s, "load") == [] and ops_of(h, s, "save") == []
        lmc = h.tier_state(s).lmc_id
        assert all(t == r == 1 for t, r in h.lookups.lock_balance(lmc).values())
    assert h.lookups.ended.count(h.tier_state(s).lmc_id) == 1
    h.shutdown()


def test_save_only_config_still_stores(make):
    h = make(offload={"load": False})
    h.transfers.auto = {"save"}
    s = h.add(prompt_of(40, 19), max_tokens=1)
    h.run([s])
    assert ops_of(h, s, "load") == []
    assert [(o.start, o.end) for o in ops_of(h, s, "save")] == [(0, 16), (16, 32)]
    h.shutdown()


# ---- 11. a withdrawn promise frees its lookup locks ------------------------------------------


def test_fm11_hit_covered_by_hbm_frees_its_locks_once(make):
    h = make()
    h.transfers.auto = {"save"}
    p = prompt_of(87, 20)
    first = h.add(p, max_tokens=1)
    h.run([first])
    h.step()
    # the tier may have lost it (a restart): the HBM-covered request confirms at admission
    # (a prefix it knows stored it would confirm only near a boundary to store)
    h.connector.tier_lost()
    again = h.add(p, max_tokens=1)
    h.run([again])
    h.step()
    lmc = h.tier_state(again).lmc_id
    assert again.counters.hbm_hit_tokens == 80 and ops_of(h, again, "load") == []
    assert h.lookups.frees_of(lmc) == [(0, 80)]
    assert all(t == r == 1 for t, r in h.lookups.lock_balance(lmc).values())
    h.shutdown()
    assert h.lookups.frees_of(lmc) == [(0, 80)] and h.lookups.ended.count(lmc) == 1


def test_hbm_covered_request_runs_without_waiting_for_its_lookup(make):
    """An idle tier costs no step: when HBM already covers every loadable token, the request
    is admitted at once and asks nothing until it nears the first boundary it would store
    (96, asked from 92); the lookup's late answer frees its locks once and tells the saves
    what the tier lost (here: everything), which is then stored again."""
    h = make(auto_lookups=False)
    h.transfers.auto = {"save"}
    p = prompt_of(87, 22)
    h.lookups.auto = True
    first = h.add(p, max_tokens=2)
    h.run([first])
    h.step()
    h.lookups.auto = False
    assert h.server.hit(p[:-1]) == 80
    h.server.forget()  # the tier lost it; HBM still has it
    saves = len(h.transfers.saves)
    s = h.add(p, max_tokens=12)
    h.step()
    assert s.counters.hbm_hit_tokens == 80 and s.num_computed > 80
    assert [o for o in h.lookups.ops if o.owner.seq is s] == []  # nothing to store yet
    h.step_until(lambda: [o for o in h.lookups.ops if o.owner.seq is s])
    (lk,) = [o for o in h.lookups.ops if o.owner.seq is s]
    assert 92 <= s.num_computed < 96 and lk.token_ids == p[:80]
    h.step()
    assert lk.hit is None and s.num_computed > 92  # unanswered, yet the request runs
    h.lookups.answer(lk)
    h.run([s])
    lmc = h.tier_state(s).lmc_id
    assert lk.hit == 0 and h.lookups.frees_of(lmc) == []
    assert len(h.transfers.saves) > saves  # what the tier lost is stored again
    assert h.server.hit(p[:-1]) == 80
    h.shutdown()
    assert h.lookups.ended.count(lmc) == 1


def test_fm11_request_aborted_while_its_lookup_runs_frees_the_late_hit_once(make):
    h = make(auto_lookups=False)
    p = prompt_of(87, 21)
    h.lookups.auto = True
    fill_tier(h, p)
    h.lookups.auto = False
    s = h.add(p, max_tokens=1)
    h.step()
    (lk,) = [o for o in h.lookups.ops if o.owner.seq is s]
    assert h.engine.abort(s.request_id)
    h.step()
    lmc = h.tier_state(s).lmc_id
    assert lmc not in h.lookups.ended  # its lookup may still take locks
    h.lookups.answer(lk)
    h.step()
    assert lk.hit == 80 and h.lookups.frees_of(lmc) == [(0, 80)]
    assert h.lookups.ended.count(lmc) == 1 and ops_of(h, s) == []
    h.shutdown()
    assert h.lookups.frees_of(lmc) == [(0, 80)]


def test_fm11_hit_without_room_to_load_frees_its_locks_once(make):
    big = make()
    p = prompt_of(87, 22)
    fill_tier(big, p)
    h = make(server=big.server, num_blocks=6)  # 5 blocks + a 2-unit image do not fit
    s = h.add(p, max_tokens=1)
    h.run([s])
    h.step()
    lmc = h.tier_state(s).lmc_id
    assert ops_of(h, s, "load") == [] and s.counters.computed_prompt_tokens == 87
    assert h.lookups.frees_of(lmc) == [(0, 80)]
    assert all(t == r == 1 for t, r in h.lookups.lock_balance(lmc).values())
    h.shutdown()
    big.shutdown()


def test_fm11_lookup_answered_as_its_deadline_passes_still_frees_its_locks(make, monkeypatch):
    h = make(auto_lookups=False, offload={"lookup_timeout_s": 2.0})
    thread = unstarted_lookup_thread(h.connector, 48, OffloadConfig(lookup_timeout_s=2.0))
    adapter = thread._adapter
    h.connector.lookups = thread  # the real lookup thread's logic, run here on cue
    try:
        s = h.add(prompt_of(70, 23), max_tokens=1)
        h.step()
        kind, (lk,) = thread._commands.popleft()
        assert kind == "lookup"
        thread._do_lookup(lk)
        resolve = LookupOp.resolve

        def racing(op, hit, error=""):  # the step thread's sweep lands just before it
            if op is lk and hit is not None and op.state is not OpState.LATE:
                h.clock.advance(2.5)
                h.engine.scheduler.settle_tier()
            return resolve(op, hit, error)

        monkeypatch.setattr(LookupOp, "resolve", racing)
        thread._poll()
        monkeypatch.setattr(LookupOp, "resolve", resolve)
        assert lk.state is OpState.DONE and lk.hit == 48
        h.run([s])
        h.step()
        assert ops_of(h, s, "load") == []
        freed = [(a, e) for i, a, e in adapter.frees if i == lk.lmc_id]
        freed += [(c[2], c[3]) for k, c in thread._commands if k == "free" and c[0] == lk.lmc_id]
        assert any(a <= 0 and e >= 48 for a, e in freed), "the hit's locks are never freed"
    finally:
        h.connector.lookups = h.lookups


def test_fm11_shutdown_with_a_lookup_pending_ends_its_session(make):
    h = make(auto_lookups=False)
    s = h.add(prompt_of(40, 24), max_tokens=1)
    h.step()
    assert s.status is SeqStatus.WAITING_FOR_TIER
    h.engine.shutdown(timeout_s=0.0)
    assert not h.connector._requests
    assert h.lookups.ended.count(h.tier_state(s).lmc_id) == 1


# ---- 12. a lost or failed tier hit is stored again -------------------------------------------


@pytest.mark.parametrize("how", ["lost", "late"])
def test_fm12_lost_tier_hit_is_stored_again(make, how):
    h = make()
    p = prompt_of(87, 25)
    first = fill_tier(h, p)
    s = h.add(p, max_tokens=2)
    h.step_until(lambda: h.transfers.loads)
    load = h.transfers.loads[0]
    h.server.forget()  # the server restarted: its hit is gone
    if how == "lost":
        h.transfers.complete(load, ok=True)  # keys not found: the load fails
        assert load.state is OpState.FAILED
    else:
        h.transfers.late(load)
    h.transfers.auto = {"save"}
    h.run([s])
    h.step()
    again = sorted(ops_of(h, s, "save"), key=lambda o: o.start)
    assert again and again[0].start == load.start
    assert [(o.start, o.end) for o in again] == [(i, i + BLOCK) for i in range(0, 80, BLOCK)]
    assert h.server.hit(p[:-1]) == 80
    h.transfers.complete_all(ok=False)

    h.engine.reset_prefix_cache()
    h.transfers.auto = {"save", "load"}
    t = h.add(p, max_tokens=2)
    h.run([t])
    assert t.counters.tier_hit_tokens == 80 and t.output == s.output == first.output
    h.shutdown()


# ---- 13. deadlines without races -------------------------------------------------------------


def test_fm13_finished_transfer_is_done_even_when_its_round_runs_past_the_deadline():
    out = []
    tt = make_transfer_thread(out.append)
    tt.health.adapter = FakeWorkerAdapter()
    op = transfer_op(deadline=time.monotonic() - 5.0)
    op.mark_submitted(FakeFuture(done=True, ok=True))
    tt._inflight.append(op)
    tt._poll_round()
    assert op.state is OpState.DONE and out == [op] and tt._inflight == []


def test_fm13_unfinished_transfer_past_its_deadline_is_late_once_then_resolves():
    out = []
    tt = make_transfer_thread(out.append)
    tt.health.adapter = FakeWorkerAdapter()
    early = transfer_op(deadline=time.monotonic() + 60)
    late = transfer_op(deadline=time.monotonic() - 1.0)
    broken = transfer_op(deadline=time.monotonic() + 60)
    early.mark_submitted(FakeFuture())
    late.mark_submitted(fut := FakeFuture())
    broken.mark_submitted(FakeFuture(raises=RuntimeError("reply lost")))
    tt._inflight += [early, late, broken]
    tt._poll_round()
    tt._poll_round()
    assert early.state is OpState.IN_FLIGHT
    assert late.state is OpState.LATE
    assert broken.state is OpState.FAILED and "transfer raised" in broken.error
    assert out == [late, broken]  # LATE reported once, over two rounds
    fut.done = True
    tt._poll_round()
    assert late.state is OpState.DONE and out == [late, broken, late]
    assert tt._inflight == [early]


def test_fm13_scheduler_deadline_bounds_a_load_the_thread_never_answers(make):
    h = make(offload={"transfer_timeout_s": 3.0})
    p = prompt_of(87, 26)
    first = fill_tier(h, p)
    s = h.add(p, max_tokens=2)
    h.step_until(lambda: h.transfers.loads)
    load = h.transfers.loads[0]
    h.clock.advance(3.5)  # past the deadline, within the margin: the thread's own call
    h.step()
    assert load.state is OpState.QUEUED and s.status is SeqStatus.WAITING_FOR_TIER
    h.clock.advance(1.0)
    h.step()
    assert load.state is OpState.LATE and load in h.connector.quarantined
    h.transfers.auto = {"save"}
    h.run([s])
    assert s.counters.failed_loads == 1 and s.output == first.output
    h.shutdown()
    assert load.state is OpState.FAILED and not load.leased


def test_fm13_each_load_is_called_late_at_its_own_deadline(make):
    """The step thread walks the requests for late work only once the earliest deadline has
    passed: a second load started later is still bounded by its own, later deadline after the
    first one's sweep."""
    h = make(offload={"transfer_timeout_s": 3.0})
    p1, p2 = prompt_of(87, 26), prompt_of(87, 27)
    fill_tier(h, p1)
    fill_tier(h, p2)
    s1 = h.add(p1, max_tokens=2)
    h.step_until(lambda: len(h.transfers.loads) == 1)
    first = h.transfers.loads[0]
    h.clock.advance(2.0)
    s2 = h.add(p2, max_tokens=2)
    h.step_until(lambda: len(h.transfers.loads) == 2)
    second = h.transfers.loads[1]
    h.clock.advance(2.1)  # the first is 1.1 s past its deadline, the second 1.9 s short of it
    h.step()
    assert first.state is OpState.LATE and second.state is OpState.QUEUED
    h.clock.advance(1.0)  # the second is past its deadline, within the margin
    h.step()
    assert second.state is OpState.QUEUED
    h.clock.advance(1.0)
    h.step()
    assert second.state is OpState.LATE
    h.transfers.auto = {"save"}
    h.run([s1, s2])
    assert s1.counters.failed_loads == 1 and s2.counters.failed_loads == 1
    h.shutdown()


# ---- 14. prompt completion, no spinning ------------------------------------------------------


def test_fm14_transfer_thread_blocks_when_idle_and_polls_only_while_in_flight(monkeypatch):
    w = wired_transfer_thread(monkeypatch, poll_interval_s=0.001)
    tt, adapter, cond, outcomes, got = w.tt, w.adapter, w.cond, w.outcomes, w.got
    rounds = []
    poll_round = tt._poll_round
    tt._poll_round = lambda: (rounds.append(len(tt._inflight)), poll_round())[1]
    try:
        assert tt.start(wait_registered_s=WAIT_S)
        assert cond.blocked.wait(WAIT_S)
        # registered and idle: one round ran, then an untimed wait (blocked, not polling)
        assert cond.waits[-1] is None and rounds == [0]
        cond.blocked.clear()
        mark = len(cond.waits)
        op, fut = w.submit_queried(WAIT_S)
        fut.done = True
        assert got.wait(WAIT_S) and cond.blocked.wait(WAIT_S)
        assert outcomes == [(op, OpState.DONE)]
        timed = cond.waits[mark:-1]
        assert timed and all(w == tt.poll_interval_s for w in timed)  # a timer while in flight
        assert cond.waits[-1] is None  # and blocked again once nothing is
        assert all(t is tt.thread for t in fut.query_threads)  # one thread queries futures
    finally:
        tt.stop(1.0)
    assert not tt.thread.is_alive() and adapter.shutdowns == 1


def test_fm14_load_completion_wakes_the_idle_engine_at_once(make):
    h = make()
    p = prompt_of(87, 27)
    fill_tier(h, p)
    s = h.add(p, max_tokens=2)
    h.step_until(lambda: h.transfers.loads)
    h.step()
    assert not h.last.ran  # idle: only the load is outstanding
    h.engine.wait_for_progress(0.0)
    assert not h.engine.wait_for_progress(0.0)
    h.transfers.complete(h.transfers.loads[0])
    assert h.engine.wait_for_progress(0.0)  # notified by the outcome, not by a timer
    h.step()
    assert h.last.ran and s.status is SeqStatus.RUNNING
    h.run([s])
    h.shutdown()


# ---- 15. errors are not masked ---------------------------------------------------------------


def test_fm15_a_failed_round_is_reported_over_an_older_error(monkeypatch):
    errors = ["first"]

    def server_alive():
        if errors:
            raise RuntimeError(f"round failed: {errors.pop()}")
        return True

    w = wired_transfer_thread(monkeypatch, server_alive=server_alive, poll_interval_s=0.001)
    tt, adapter, cond, got = w.tt, w.adapter, w.cond, w.got
    tt.last_error = "RuntimeError('an older error')"
    try:
        tt.start(wait_registered_s=WAIT_S)
        assert cond.blocked.wait(WAIT_S)
        assert tt.round_errors == 1 and "first" in tt.last_error
        cond.blocked.clear()
        errors.append("second")
        tt.submit(transfer_op())
        assert adapter.submitted.wait(WAIT_S)
        adapter.futures[0].done = True
        assert got.wait(WAIT_S) and cond.blocked.wait(WAIT_S)
        assert tt.round_errors == 2 and "second" in tt.last_error
        assert [state for _, state in w.outcomes] == [OpState.DONE]  # the thread kept serving
    finally:
        tt.stop(1.0)


def test_fm15_stop_leaves_the_adapter_to_a_thread_that_did_not_stop():
    tt = make_transfer_thread(lambda op: None)
    tt.health.adapter = adapter = FakeWorkerAdapter()
    tt.thread = stuck = StuckThread()
    tt.stop(0.0)
    assert stuck.joins, "stop did not wait for the thread"
    assert adapter.shutdowns == 0 and tt.health.adapter is adapter


# ---- 16. events are pooled (the CPU-checkable half) ------------------------------------------


def test_fm16_events_are_pooled_reused_and_held_until_terminal(make, monkeypatch):
    made = []

    class StandInEvent:  # torch.cuda.Event(interprocess=True), as far as the pool sees it
        def __init__(self, interprocess=False):
            assert interprocess
            self.thread = threading.current_thread()
            made.append(self)

        def record(self):
            pass

    monkeypatch.setattr(torch.cuda, "Event", StandInEvent)
    h = make()
    events = h.tier.events
    events.cuda = True
    s = h.add(prompt_of(50, 28), max_tokens=1)
    h.run([s])
    s1, s2, s3 = ops_of(h, s, "save")
    assert events.created == 3 and len(set(map(id, h.transfers.events))) == 3
    h.transfers.complete(s1)
    h.transfers.late(s2)
    h.step()
    held = s2.event
    assert held not in events._free  # the server may still wait on a late op's event
    t = h.add(prompt_of(20, 29), max_tokens=1)
    h.run([t])
    assert events.created == 3  # t's save reused s1's event
    h.transfers.complete_all()
    h.step()
    assert all(op.event is None for op in (s1, s2, s3)) and len(events._free) == events.created == 3
    assert all(e.thread is threading.main_thread() for e in made)  # the step thread
    h.shutdown()


# ---- a tier that returns the image of another boundary --------------------------------------


def test_a_loaded_image_of_another_boundary_is_refused_and_recomputed(make):
    """On the H200 a load once delivered the image of an earlier boundary (see
    benchmarks/gpu/NOTES.md). The connector checks the image's own boundary: the request
    recomputes with unchanged output instead of resuming from the wrong state."""
    h = make()
    p = prompt_of(55, 12)
    first = fill_tier(h, p, max_tokens=3)
    images = h.server.images
    key48, key32 = tuple(p[:48]), tuple(p[:32])
    assert key48 in images and key32 in images
    images[key48] = images[key32].clone()  # the server hands back boundary 32 for 48
    h.transfers.auto = {"save", "load"}
    s = h.add(p, max_tokens=3)
    h.run([s])
    assert s.output == first.output
    assert s.counters.failed_loads == 1 and s.counters.tier_hit_tokens == 0
    assert h.engine.metrics.render().count('atom_tier_loads_total{outcome="failed"} 1') == 1
    h.shutdown()


def test_requests_holding_blocks_for_loads_never_exceed_max_num_seqs(make):
    """Loads planned for a long queue must not fill the pool with requests that then have no
    block to run with (found in CI: the accuracy job's pass 2 stalled with every block held by
    loaded, waiting requests). Requests holding blocks while they wait count against
    max_num_seqs, and all of them finish once their loads do."""
    h = make(max_num_seqs=3)
    prompts = [prompt_of(50, 300 + i) for i in range(8)]
    for p in prompts:
        fill_tier(h, p, max_tokens=1)
    seqs = [h.add(p, max_tokens=2) for p in prompts]
    for _ in range(6):  # loads stay in flight: nothing completes them yet
        h.step()
        holding = [s for s in h.engine.scheduler.waiting if s.block_table]
        assert len(h.engine.scheduler.running) + len(holding) <= 3
    assert len(h.transfers.loads) == 3
    h.transfers.auto = {"load", "save"}
    h.transfers.complete_all()
    h.run(seqs)
    assert [s.counters.tier_hit_tokens for s in seqs] == [48] * len(prompts)
    h.shutdown()


@pytest.mark.parametrize("num_blocks", [12, 14])
def test_a_tier_hit_without_room_waits_for_running_requests_instead_of_recomputing(
    make, num_blocks
):
    """Found on the H200 serving run (82.5% of the reuse ceiling): a request whose load did not
    fit while others ran was admitted with its HBM hit alone and recomputed what the tier held.
    While requests run (and will free blocks), it now waits for room and loads."""
    big = make()
    p = prompt_of(87, 22)
    fill_tier(big, p)
    h = make(server=big.server, num_blocks=num_blocks, max_num_batched_tokens=16)
    h.transfers.auto = {"load", "save"}
    a = h.add(prompt_of(120, 5), max_tokens=4)  # fills most of the pool while it runs
    h.step_until(lambda: a.num_computed >= 96)
    b = h.add(p, max_tokens=1)
    h.run([a, b])
    assert b.counters.tier_hit_tokens == 80
    assert b.counters.computed_prompt_tokens == 7
    h.shutdown()
    big.shutdown()


def test_a_request_that_recomputed_a_cached_prefix_still_stores_its_tail(make):
    """Found on the H200 serving run (82.5% of the reuse ceiling): a request that recomputed a
    prefix whose cached copy was still in the pool kept its own blocks unhashed; when the
    cached copy was evicted, every later image of the request (its prefix holds those hashes)
    was dropped at once, and its tail was never stored. The live blocks now take the hashes
    over, so the images stay and every boundary is stored."""
    h = make(max_num_batched_tokens=BLOCK)
    h.transfers.auto = {"save"}
    p = prompt_of(88, 31)
    first = h.add(p[:48], max_tokens=1)
    h.run([first])
    h.step()
    h.server.forget()  # the tier does not have the prefix: the request must compute it
    store, pool = h.engine.scheduler.store, h.engine.scheduler.pool
    cached = [b for b in range(pool.num_blocks) if pool.is_cached(b)]
    # no image left: the prefix blocks stay cached, unusable as a hit
    while store.evict_fewest_dependents():
        pass
    s = h.add(p, max_tokens=1)
    h.step_until(lambda: s.num_computed >= 48)
    assert s.counters.hbm_hit_tokens == 0
    for b in cached:
        pool.forget(b)  # the cached copy of the prefix leaves the pool
    h.run([s])
    h.step()
    assert h.server.hit(p[:87]) == 80
    h.shutdown()


def test_a_load_survives_the_eviction_of_cached_copies_of_the_prefix_it_loads(make):
    """Found on the H200 serving run (8 of 64 requests recomputed 6,912 tokens the tier held):
    a load's PENDING image was dropped when the pool evicted a cached block whose hash is in
    the image's prefix, although the load itself registers that hash when it lands; the load
    then ended as a recompute. A PENDING image is now checked when it becomes READY, not
    dropped with a prefix hash its writer will register."""
    h = make()
    p = prompt_of(40, 77)
    cached_without_images(h, p)
    pool = h.engine.scheduler.pool
    cached = [b for b in range(pool.num_blocks) if pool.is_cached(b)]
    assert cached, "the prefix's blocks should be cached"
    seq = h.add(p, max_tokens=1)
    h.step_until(lambda: h.transfers.loads)
    load = h.transfers.loads[-1]
    # the load starts at the resident frontier: block [0, 16) is the request's own now, and
    # the endpoint chunk [16, 32) (which carries the image) is loaded next to a cached copy
    assert (load.start, load.end) == (16, 32)
    still_cached = [b for b in cached if pool.is_cached(b)]
    assert still_cached
    for b in still_cached:
        pool.forget(b)  # the cached copies leave the pool while the load is in flight
    assert not load.image.doomed
    h.transfers.complete(load)
    h.run([seq])
    assert seq.counters.failed_loads == 0
    assert (seq.counters.hbm_hit_tokens, seq.counters.tier_hit_tokens) == (16, 16)
    h.shutdown()


def test_a_tier_hit_that_can_never_fit_is_computed_and_counted(make):
    """With nothing running there is nothing to wait for: a load that does not fit the pool
    is given up and the prompt computed chunk by chunk. What the tier held beyond the hit is
    reported (per request and as tier_tokens_recomputed_total) instead of passing silently."""
    big = make()
    p = prompt_of(72, 23)  # 5 blocks; the tier holds 64 tokens: a load needs 4 + an image's 2
    fill_tier(big, p)
    h = make(server=big.server, num_blocks=5, max_num_batched_tokens=16)
    h.transfers.auto = {"load", "save"}
    s = h.add(p, max_tokens=1)
    h.run([s])
    assert h.transfers.loads == []
    c = s.counters
    assert (c.tier_hit_tokens, c.computed_prompt_tokens, c.tier_tokens_recomputed) == (0, 72, 64)
    assert h.engine.stats()["tier_tokens_recomputed"] == 64
    assert "atom_tier_tokens_recomputed_total 64" in h.engine.metrics.render()
    h.shutdown()
    big.shutdown()


def test_reset_prefix_cache_drops_the_image_of_a_load_still_in_flight(make):
    """An aborted request's load can land after a reset; its image must not become an HBM hit
    of the emptied cache (the PENDING image used to die with its prefix hashes at the reset;
    it now outlives hash evictions, so the reset drops it itself)."""
    h = make()
    p = prompt_of(40, 77)
    cached_without_images(h, p)
    store = h.engine.scheduler.store
    seq = h.add(p, max_tokens=1)
    h.step_until(lambda: h.transfers.loads)
    load = h.transfers.loads[-1]
    h.engine.abort(seq.request_id)
    h.engine.reset_prefix_cache()
    assert load.image.doomed
    h.transfers.complete(load)
    h.step()
    assert not [c for c in store.images.values() if c.ready]
    again = h.add(p, max_tokens=1)
    assert h.engine.scheduler.local_hit(again)[0] == 0
    h.engine.abort(again.request_id)
    h.shutdown(check=False)


def test_a_long_queue_is_looked_up_only_as_far_as_it_can_be_admitted(make):
    """Found in a local run of .ci/run while other jobs shared its 2 cores: with nothing
    running, the whole queue (256 requests) was looked up at once; each lookup locks its chunks
    on the server, and by the time the last requests ran (minutes later) the server's lock
    lifetime (300 s) had passed: 143 of 256 loads were refused and recomputed, and pass 2 took
    794 s instead of 8. A request holding a lookup now counts against max_num_seqs like one
    holding blocks."""
    h = make(max_num_seqs=3)
    prompts = [prompt_of(50, 400 + i) for i in range(8)]
    for p in prompts:
        fill_tier(h, p, max_tokens=1)
    h.lookups.auto = False  # the test answers lookups itself, after each step
    h.lookups.ops.clear()
    h.transfers.auto = {"load", "save"}
    seqs = [h.add(p, max_tokens=1) for p in prompts]
    for _ in range(3):
        h.step()
        assert len([op for op in h.lookups.ops if not op.terminal]) <= 3
    assert len(h.lookups.ops) == 3
    while not all(s.is_finished for s in seqs):  # answer what is asked, as it is asked
        for op in list(h.lookups.ops):
            if not op.terminal:
                h.lookups.answer(op)
        h.step()
        pending = [s for s in h.engine.scheduler.waiting if h.connector.holds(s)]
        assert len(h.engine.scheduler.running) + len(pending) <= 3
    assert [s.counters.tier_hit_tokens for s in seqs] == [48] * len(prompts)
    h.shutdown()
