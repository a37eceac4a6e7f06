"""Admission: what a waiting request resumes from, and the blocks it takes to run.

Two paths, one per kind of waiting request:

  prepared  a landed tier load: the request holds the blocks of its prefix and of its first
            chunk, and a pinned READY image at the prefix's end; it needs only a slot.
  fresh     everything else: the local hit (resident blocks, capped to the last READY image
            and to ``num_tokens - 1``), extended by the tier when a load is worth it.

A tier load starts at the **resident frontier** (the longest resident block prefix, floored to
the chunk grid), not at the last READY image below it: a load restores the state at its own end,
so resident KV blocks are enough before it. If the load fails there is no state at the frontier:
the request is re-admitted fresh and resumes from the last READY image at or below it (or 0).

Intervals while a load is in flight (F = frontier, T = the tier's hit):
  [0, F)      resident blocks, acquired by the request
  [F, T)      fresh blocks the load writes (also leased for the transfer), image units at T
  [T, first)  fresh blocks for the request's first chunk after the load
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from atom.engine.checkpoints import Checkpoint
from atom.engine.sequence import ScheduledSpan, SeqStatus, Sequence


class Admit(enum.Enum):
    WAIT = "wait"  # not admissible yet (a lookup or load is in flight); try the next one
    BLOCKED = "blocked"  # no room: stop admitting this step (FCFS)


class LocalHit(NamedTuple):
    tokens: int  # the hit: resident and ending at a READY image (0 for none)
    image: Checkpoint | None  # the READY image at ``tokens``
    blocks: list[int]  # the hit's blocks
    resident: list[int]  # the longest resident block prefix (a superset of ``blocks``)


class Admission:
    """Admission for ``Scheduler`` (which supplies pool, store, connector and the helpers)."""

    def local_hit(self, seq: Sequence) -> LocalHit:
        """The local hit, capped to an image boundary and to num_tokens - 1."""
        bs = self.block_size
        if not self.cfg.prefix_caching:
            return LocalHit(0, None, [], [])
        hashes = self._hashes(seq, (seq.num_tokens - 1) // bs)
        resident = []
        for h in hashes:
            b = self.pool.lookup(h)
            if b is None:
                break
            resident.append(b)
        for n in range(len(resident), 0, -1):
            ckpt = self.store.get_ready(hashes[n - 1])
            if ckpt is not None:
                return LocalHit(n * bs, ckpt, resident[:n], resident)
        return LocalHit(0, None, [], resident)

    def _admit(self, seq: Sequence, budget: int) -> ScheduledSpan | Admit:
        if seq.prepared is not None:
            return self._admit_prepared(seq, budget)
        return self._admit_fresh(seq, budget)

    def _admit_prepared(self, seq: Sequence, budget: int) -> ScheduledSpan | Admit:
        prep = seq.prepared
        end = self._chunk_end(seq, prep.tokens, budget)
        if end is None:
            return Admit.BLOCKED
        blocks = self._allocate(self._blocks_for(end) - len(seq.block_table))
        if blocks is None:
            return Admit.BLOCKED
        seq.block_table += blocks
        seq.prepared = None
        return self._start(seq, prep.tokens, end, prep.image, prep.local_tokens)

    def _admit_fresh(self, seq: Sequence, budget: int) -> ScheduledSpan | Admit:
        # prompt logprobs need every prompt position's logits: such a request computes its
        # whole prompt, with no local hit and no tier load (as vLLM does)
        whole = seq.params.prompt_logprobs is not None
        hit = LocalHit(0, None, [], []) if whole else self.local_hit(seq)
        unloaded = 0
        if self.connector is not None and not whole:
            answer = self.connector.lookup(seq, hit.tokens)
            if answer is None:
                seq.status = SeqStatus.WAITING_FOR_TIER
                return Admit.WAIT
            if answer.tokens > hit.tokens:
                planned = self._plan_load(seq, hit, answer.tokens)
                if planned is not None:
                    self.settle_tier()  # a load copied by the engine lands as it is issued
                    if seq.prepared is not None:
                        return self._admit_prepared(seq, budget)
                    return planned
                if self._others_hold(seq):
                    # No room to load now, but running or holding requests will free some:
                    # waiting beats recomputing what the tier holds (the answer is kept).
                    return Admit.BLOCKED
                unloaded = answer.tokens
            self.connector.settle_lookup(seq)
        span = self._take_hit(seq, hit, budget, unloaded)
        if span is Admit.BLOCKED and hit.tokens and not self._others_hold(seq):
            # the hit's blocks and its pinned image leave no room for the first chunk, and
            # nothing running or held will free any: compute from 0 (evicting them) instead
            span = self._take_hit(seq, LocalHit(0, None, [], []), budget, unloaded)
        return span

    def _others_hold(self, seq: Sequence) -> bool:
        """Another request holds pool blocks that it will give back (running or waiting)."""
        return bool(self.running) or any(s.block_table for s in self.waiting if s is not seq)

    def _take_hit(
        self, seq: Sequence, hit: LocalHit, budget: int, unloaded: int
    ) -> ScheduledSpan | Admit:
        end = self._chunk_end(seq, hit.tokens, budget)
        if end is None:
            return Admit.BLOCKED
        # take the hit first so evictions made for the new blocks cannot touch it
        self.pool.acquire(hit.blocks)
        if hit.image is not None:
            self.store.pin(hit.image)
        blocks = self._allocate(self._blocks_for(end) - len(hit.blocks))
        if blocks is None:
            self.pool.release(reversed(hit.blocks))
            if hit.image is not None:
                self.store.unpin(hit.image)
            return Admit.BLOCKED
        seq.block_table = hit.blocks + blocks
        return self._start(seq, hit.tokens, end, hit.image, hit.tokens, unloaded)

    def _plan_load(self, seq: Sequence, hit: LocalHit, tier: int) -> Admit | None:
        """Hold the frontier's blocks, blocks for [start, tier) and for the first chunk after
        it, and a PENDING image at ``tier``, and hand the load to the connector. Returns WAIT
        (loading, or another load of the same image is in flight) or None when there is no
        room (the caller proceeds with the local hit)."""
        bs, chunk = self.block_size, self.connector.chunk_size
        # the image lives in the endpoint chunk's object: a load carries at least that chunk
        start = min(len(hit.resident) * bs, tier - chunk) // chunk * chunk
        hashes = self._hashes(seq, tier // bs)
        pending = self.store.images.get(hashes[-1])
        if pending is not None and not pending.ready:
            return Admit.WAIT  # the same prefix is being loaded for another request
        keep = hit.resident[: start // bs]
        first_end = self._chunk_end(seq, tier, self.cfg.max_num_batched_tokens) or tier
        self.pool.acquire(keep)
        blocks = self._allocate(self._blocks_for(first_end) - start // bs)
        image = self.store.create(hashes[-1], tier, tuple(hashes)) if blocks is not None else None
        if image is None:
            if blocks is not None:
                self.pool.release(reversed(blocks))
            self.pool.release(reversed(keep))
            return None
        seq.block_table = keep + blocks
        seq.status = SeqStatus.WAITING_FOR_TIER
        self.apply(
            self.connector.start_load(seq, start, tier, blocks[: (tier - start) // bs], image)
        )
        self.store.unpin(image)  # the creation pin: the load's lease holds the image now
        return Admit.WAIT
