"""The invariants of the pool, the checkpoint store and the scheduler, checked in one place.

Tests call ``check_integrity`` after every step. Owners of a block are the sequences whose block
tables hold it, the checkpoints whose units it is, and the leases the engine holds for the
tier's transfers (``Scheduler.tier_leases``, which must be what the tier's transfers need).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from atom.engine.scheduler import Scheduler


def check_integrity(sched: Scheduler) -> None:
    """free + cached + owned = total; refcounts equal their owners; images' prefixes are
    resident; no block both free and owned; slots unique. Raises AssertionError at the first
    breach."""
    pool, store = sched.pool, sched.store
    owners = [0] * pool.num_blocks
    for seq in [*sched.running, *sched.waiting]:
        for b in seq.block_table:
            owners[b] += 1
    unit_count = 0
    for ckpt in store.owners():
        for b in ckpt.units:
            owners[b] += 1
            unit_count += 1
    held: dict[int, int] = {}
    for lease in sched.tier_leases.values():
        for b in lease.blocks:
            held[b] = held.get(b, 0) + 1
            owners[b] += 1
    if sched.connector is not None:
        tier = sched.connector.leases()
        assert held == tier, f"the engine holds leases {held}, the tier's transfers need {tier}"
    for b in range(pool.num_blocks):
        assert pool.ref[b] == owners[b], f"block {b}: ref {pool.ref[b]} != owners {owners[b]}"
        free, cached = pool.is_free(b), pool.is_cached(b)
        assert not (free and cached), f"block {b} both free and cached"
        if owners[b]:
            assert not (free or cached), f"block {b} is owned and also free/cached"
        else:
            assert free or cached, f"block {b} is neither owned nor free"
        if cached:
            assert pool.hash_of[b] is not None, f"cached block {b} has no hash"
        if free:
            assert pool.hash_of[b] is None, f"free block {b} still carries a hash"
    for b, h in pool.twins().items():
        assert owners[b] and pool.hash_of[b] is None, f"twin block {b} is not live/unhashed"
        assert pool.lookup(h) not in (None, b), f"twin block {b}: its hash has no holder"
    in_use = sum(1 for b in range(pool.num_blocks) if owners[b])
    assert pool.num_free + pool.num_cached + in_use == pool.num_blocks
    assert unit_count == store.counts()["units"]
    for ckpt in store.images.values():
        assert len(ckpt.units) == store.units, f"image at {ckpt.position} lost units"
        if ckpt.ready:
            for h in ckpt.prefix:
                assert pool.lookup(h) is not None, f"READY image at {ckpt.position}: prefix gone"
    for seq in sched.waiting:
        if seq.prepared is not None:
            assert seq.prepared.image.pins > 0, f"{seq}: prepared image is not pinned"
    slots = [s.slot for s in sched.running]
    assert len(slots) == len(set(slots)), "two running sequences share a state slot"
    assert not set(slots) & set(sched.free_slots), "a running sequence's slot is free"
    ids = [s.seq_id for s in sched.running]
    assert ids == sorted(ids), "running sequences are not in arrival order"
