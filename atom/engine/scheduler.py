"""The chunked scheduler on the block grid: admission, hit caps, prefill/decode, preemption.

Per step, under ``max_num_batched_tokens`` and ``max_num_seqs``: running sequences first (in
admission order), then waiting ones (FCFS). A sequence computes tokens [num_computed,
num_tokens); a chunk ends on the block grid unless it is the last one, and never crosses a
checkpoint boundary (``checkpoint_interval`` blocks). Every forward that ends on a boundary
takes an image of the state there (a PENDING checkpoint the runner fills after the forward).

Admission: the local hit is the longest resident block prefix, capped to the last READY image
at or below it and to ``num_tokens - 1`` (the step must compute at least one token to have
logits). With a tier, a connector may extend the hit past it with a load.

Pool pressure: allocations evict cached blocks (LRU, dropping the images that depended on
them), then unpinned images (LRU), then preempt the newest running sequence (recompute).
A preempted sequence's blocks keep their hashes, so its own images can resume it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from atom.engine.block_pool import BlockPool, block_hashes
from atom.engine.checkpoints import Checkpoint, CheckpointStore
from atom.engine.sequence import SeqStatus, Sequence


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
    ):
        self.cfg, self.pool, self.store = config, pool, store
        self.block_size = config.block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.preemptions = 0

    # ---- requests -----------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the plan -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
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
        while self.waiting and budget > 0 and not out.preempted:
            if len(self.running) >= self.cfg.max_num_seqs or not self.free_slots:
                break
            span = self._admit(self.waiting[0], budget)
            if span is None:
                break
            self.waiting.popleft()
            out.spans.append(span)
            budget -= span.end - span.start
        return out

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

    def _admit(self, seq: Sequence, budget: int) -> ScheduledSpan | None:
        hit, ckpt, hit_blocks = self.local_hit(seq)
        end = self._chunk_end(seq, hit, budget)
        if end is None:
            return None
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
            return None
        seq.block_table = hit_blocks + blocks
        seq.num_computed = hit
        seq.slot = self.free_slots.pop()
        seq.status = SeqStatus.RUNNING
        c = seq.counters
        c.hbm_hit_tokens, c.tier_hit_tokens = min(hit, seq.num_prompt), 0
        c.computed_prompt_tokens = max(0, seq.num_prompt - hit)
        self.running.append(seq)
        return self._span(seq, hit, end, restore=ckpt)

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
        self._release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

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
        for b, n in (extra_refs or {}).items():
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
