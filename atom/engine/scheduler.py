"""The chunked scheduler on the block grid: admission, hit caps, prefill/decode, preemption.

Per step, under ``max_num_batched_tokens`` and ``max_num_seqs``: running sequences first (in
admission order), then waiting ones (FCFS). A sequence computes tokens [num_computed,
num_tokens); a chunk ends on the block grid unless it is the last one, and never crosses a
checkpoint boundary (``checkpoint_interval`` blocks). Every forward that ends on a boundary
takes an image of the state there (a PENDING checkpoint the runner fills after the forward).

Admission: the local hit is the longest resident block prefix, capped to the last READY image
at or below it and to ``num_tokens - 1`` (the step must compute at least one token to have
logits). With a tier, a connector may extend the hit past it with a load.

Pool pressure: allocations evict cached blocks (LRU, dropping the READY images that depended
on them), then unpinned images (those the fewest images extend first, LRU among equals), then
preempt the newest running sequence (recompute).
A preempted sequence's blocks keep their hashes, so its own images can resume it.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from atom.engine.block_pool import BlockPool, block_hashes
from atom.engine.checkpoints import Checkpoint, CheckpointStore
from atom.engine.connector import Connector, Resume
from atom.engine.sequence import SeqStatus, Sequence


class Admit(enum.Enum):
    WAIT = "wait"  # not admissible yet (a lookup or load is in flight); try the next one
    BLOCKED = "blocked"  # no room: stop admitting this step (FCFS)


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    checkpoint_interval: int
    max_model_len: int
    prefix_caching: bool = True
    take_images: bool = True


@dataclass(eq=False)
class ScheduledSpan:
    seq: Sequence
    start: int
    end: int
    restore: Checkpoint | None = None  # copy into the slot before the forward
    image: Checkpoint | None = None  # PENDING: copy the slot into it after the forward

    @property
    def samples(self) -> bool:
        return self.end == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    spans: list[ScheduledSpan] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.end - s.start for s in self.spans)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        pool: BlockPool,
        store: CheckpointStore,
        num_slots: int,
        connector: Connector | None = None,
    ):
        self.cfg, self.pool, self.store = config, pool, store
        self.block_size = config.block_size
        self.connector = connector
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.preemptions = 0
        self.tier_tokens_recomputed = 0

    # ---- requests -----------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the plan -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self.connector is not None:
            self.connector.update()
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        scheduled: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            end = self._chunk_end(seq, seq.num_computed, budget)
            if end is None:
                i += 1
                continue
            if not self._grow(seq, end, out, scheduled):
                continue  # seq itself was preempted; running[i] is now the next one
            out.spans.append(self._span(seq, seq.num_computed, end))
            scheduled.add(seq.seq_id)
            budget -= end - seq.num_computed
            i += 1
        # Requests holding blocks while they wait (a tier load in flight, or loaded and not yet
        # running) count against max_num_seqs: otherwise loads planned for the whole queue can
        # fill the pool with requests that then have no block to run with, and none finishes.
        # So do requests holding a tier lookup: otherwise a long queue is looked up at once and
        # its chunks stay locked on the server until each request's turn, past the server's
        # lock lifetime under load (a local CI run on shared cores: 143 of 256 loads refused).
        holding = sum(1 for s in self.waiting if self._holds(s))
        for seq in list(self.waiting):
            if budget <= 0 or out.preempted:
                break
            if len(self.running) >= self.cfg.max_num_seqs or not self.free_slots:
                break
            if seq.status is SeqStatus.WAITING_FOR_TIER:
                continue
            held = self._holds(seq)
            if not held and len(self.running) + holding >= self.cfg.max_num_seqs:
                continue  # the requests already holding blocks or lookups go first
            span = self._admit(seq, budget)
            if span is Admit.BLOCKED:
                break
            if span is Admit.WAIT:
                if not held and self._holds(seq):
                    holding += 1  # a lookup was sent or a load planned for it
                continue
            holding -= held
            self.waiting.remove(seq)
            out.spans.append(span)
            budget -= span.end - span.start
        return out

    def _holds(self, seq: Sequence) -> bool:
        """A waiting sequence holds pool blocks or a tier lookup."""
        return bool(seq.block_table) or (self.connector is not None and self.connector.holds(seq))

    def _chunk_end(self, seq: Sequence, start: int, budget: int) -> int | None:
        target, bs = seq.num_tokens, self.block_size
        end = min(target, start + budget)
        step = self.cfg.checkpoint_interval * bs
        end = min(end, (start // step + 1) * step)
        if end < target:
            end = end // bs * bs
        return end if end > start else None

    def _blocks_for(self, end: int) -> int:
        return -(-end // self.block_size)

    def _allocate(self, n: int) -> list[int] | None:
        if n <= 0:
            return []
        if not self.store.make_room(n):
            return None
        return self.pool.allocate(n)

    def _grow(self, seq: Sequence, end: int, out: SchedulerOutput, scheduled: set[int]) -> bool:
        """Give a running seq blocks up to ``end``, preempting the newest unscheduled running
        sequences as needed; False if ``seq`` itself had to be preempted."""
        need = self._blocks_for(end) - len(seq.block_table)
        while True:
            blocks = self._allocate(need)
            if blocks is not None:
                seq.block_table.extend(blocks)
                return True
            victim = self.running[-1]
            if victim.seq_id in scheduled and victim is not seq:
                raise RuntimeError("pool cannot hold the scheduled batch")  # cannot happen
            self._preempt(victim, out)
            if victim is seq:
                return False

    def _span(self, seq: Sequence, start: int, end: int, restore=None) -> ScheduledSpan:
        return ScheduledSpan(seq, start, end, restore=restore, image=self._image_at(seq, end))

    def _image_at(self, seq: Sequence, end: int) -> Checkpoint | None:
        if end % self.block_size or not self.cfg.take_images:
            return None
        hashes = self._hashes(seq, end // self.block_size)
        return self.store.create(hashes[-1], end, tuple(hashes))

    def _hashes(self, seq: Sequence, n_blocks: int) -> list[int]:
        have = len(seq.block_hashes)
        if have < n_blocks:
            parent = seq.block_hashes[-1] if have else 0
            bs = self.block_size
            seq.block_hashes.extend(block_hashes(seq.tokens[have * bs : n_blocks * bs], bs, parent))
        return seq.block_hashes[:n_blocks]

    # ---- admission ------------------------------------------------------------------------

    def local_hit(self, seq: Sequence) -> tuple[int, Checkpoint | None, list[int]]:
        """(hit tokens, its READY image, the hit's blocks). Capped to an image boundary and to
        num_tokens - 1."""
        bs = self.block_size
        if not self.cfg.prefix_caching:
            return 0, None, []
        hashes = self._hashes(seq, seq.num_tokens // bs)
        blocks = []
        for h in hashes:
            b = self.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        n = min(len(blocks), (seq.num_tokens - 1) // bs)
        while n > 0:
            ckpt = self.store.get_ready(hashes[n - 1])
            if ckpt is not None:
                return n * bs, ckpt, blocks[:n]
            n -= 1
        return 0, None, []

    def _admit(self, seq: Sequence, budget: int) -> ScheduledSpan | Admit:
        resume: Resume | None = seq.resume
        if resume is not None:  # a tier load finished: the seq holds blocks and image already
            hit, ckpt, local = resume.tokens, resume.image, resume.local_tokens
            end = self._chunk_end(seq, hit, budget)
            if end is None:
                return Admit.BLOCKED
            blocks = self._allocate(self._blocks_for(end) - len(seq.block_table))
            if blocks is None:
                return Admit.BLOCKED
            seq.block_table += blocks
            seq.resume = None
            return self._start(seq, hit, end, ckpt, local)
        hit, ckpt, hit_blocks = self.local_hit(seq)
        if self.connector is not None:
            tier = self.connector.lookup(seq, hit)
            if tier is None:
                seq.status = SeqStatus.WAITING_FOR_TIER
                return Admit.WAIT
            if tier > hit:
                planned = self._plan_load(seq, hit, hit_blocks, tier)
                if planned is not None:
                    return planned
                if self.running:
                    # No room to load now, but running requests will free some: waiting for
                    # it beats recomputing what the tier holds (the lookup's answer is kept).
                    return Admit.BLOCKED
                seq.tier_unloaded = tier  # counted in _start against the hit it runs with
            self.connector.settle_lookup(seq)
        end = self._chunk_end(seq, hit, budget)
        if end is None:
            return Admit.BLOCKED
        need = self._blocks_for(end) - len(hit_blocks)
        # take the hit first so evictions made for the new blocks cannot touch it
        self.pool.acquire(hit_blocks)
        if ckpt is not None:
            self.store.pin(ckpt)
        blocks = self._allocate(need)
        if blocks is None:
            self.pool.release(reversed(hit_blocks))
            if ckpt is not None:
                self.store.unpin(ckpt)
            return Admit.BLOCKED
        seq.block_table = hit_blocks + blocks
        return self._start(seq, hit, end, ckpt, hit)

    def _start(self, seq: Sequence, hit: int, end: int, ckpt, local: int) -> ScheduledSpan:
        seq.num_computed = hit
        seq.slot = self.free_slots.pop()
        seq.status = SeqStatus.RUNNING
        c = seq.counters
        c.hbm_hit_tokens = min(local, seq.num_prompt)
        c.tier_hit_tokens = min(hit, seq.num_prompt) - c.hbm_hit_tokens
        c.computed_prompt_tokens = max(0, seq.num_prompt - hit)
        if seq.tier_unloaded:
            c.tier_tokens_recomputed = max(0, min(seq.tier_unloaded, seq.num_prompt) - hit)
            self.tier_tokens_recomputed += c.tier_tokens_recomputed
            seq.tier_unloaded = 0
        self.running.append(seq)
        return self._span(seq, hit, end, restore=ckpt)

    def _plan_load(self, seq: Sequence, hit: int, hit_blocks: list[int], tier: int) -> Admit | None:
        """Hold blocks for [start, tier) and a PENDING image at ``tier``, and hand them to the
        connector. Returns WAIT (loading, or another load of the same image is in flight) or
        None when there is no room (the caller proceeds with the local hit)."""
        bs, chunk = self.block_size, self.connector.chunk_size
        start = hit // chunk * chunk
        hashes = self._hashes(seq, tier // bs)
        pending = self.store.images.get(hashes[-1])
        if pending is not None and not pending.ready:
            return Admit.WAIT  # the same prefix is being loaded for another request
        keep = hit_blocks[: start // bs]
        self.pool.acquire(keep)
        blocks = self._allocate((tier - start) // bs)
        image = self.store.create(hashes[-1], tier, tuple(hashes)) if blocks is not None else None
        if image is None:
            if blocks is not None:
                self.pool.release(reversed(blocks))
            self.pool.release(reversed(keep))
            return None
        seq.block_table = keep + blocks
        seq.status = SeqStatus.WAITING_FOR_TIER
        self.connector.start_load(seq, start, tier, blocks, image)
        return Admit.WAIT

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.WAITING
        seq.num_computed = 0
        seq.counters.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _release(self, seq: Sequence) -> None:
        self.pool.release(reversed(seq.block_table))
        seq.block_table = []
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None

    # ---- after the forward ------------------------------------------------------------------

    def commit(self, span: ScheduledSpan) -> None:
        """The forward of ``span`` ran: publish its full blocks, settle its checkpoints."""
        seq, bs = span.seq, self.block_size
        seq.num_computed = span.end
        first, last = span.start // bs, span.end // bs
        if last > first:
            hashes = self._hashes(seq, last)
            for i in range(first, last):
                self.pool.register(seq.block_table[i], hashes[i])
        if span.image is not None:
            self.store.mark_ready(span.image)
            self.store.unpin(span.image)
        if span.restore is not None:
            self.store.unpin(span.restore)

    def abandon(self, span: ScheduledSpan) -> None:
        """The forward of ``span`` did not run (an error): its pending image is dropped."""
        if span.image is not None:
            self.store.drop(span.image)
            self.store.unpin(span.image)
        if span.restore is not None:
            self.store.unpin(span.restore)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.resume is not None:
            self.store.unpin(seq.resume.image)
            seq.resume = None
        self._release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if self.connector is not None:
            self.connector.request_finished(seq)

    # ---- invariants -----------------------------------------------------------------------

    def check_integrity(self, extra_refs: dict[int, int] | None = None) -> None:
        """free + cached + owned = total; refcounts equal their owners; images' prefixes are
        resident; no block both free and owned. Raises AssertionError with the first breach."""
        pool, store = self.pool, self.store
        owners = [0] * pool.num_blocks
        for seq in [*self.running, *self.waiting]:
            for b in seq.block_table:
                owners[b] += 1
        unit_count = 0
        for ckpt in store.owners():
            for b in ckpt.units:
                owners[b] += 1
                unit_count += 1
        refs = dict(extra_refs or {})
        if self.connector is not None:
            for b, n in self.connector.leases().items():
                refs[b] = refs.get(b, 0) + n
        for b, n in refs.items():
            owners[b] += n
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
                    assert (
                        pool.lookup(h) is not None
                    ), f"READY image at {ckpt.position}: prefix gone"
        slots = [s.slot for s in self.running]
        assert len(slots) == len(set(slots)), "two running sequences share a state slot"
        assert not set(slots) & set(self.free_slots), "a running sequence's slot is free"
