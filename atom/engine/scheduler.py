"""The chunked scheduler on the block grid: admission, hit caps, prefill/decode, preemption.

Per step, under ``max_num_batched_tokens`` and ``max_num_seqs``: running sequences first (oldest
arrival first), then waiting ones: those holding a prepared prefix (a landed tier load) first,
then FCFS. A sequence computes tokens [num_computed, num_tokens); a chunk ends on the block grid
unless it is the last one, and never crosses a checkpoint boundary (``checkpoint_interval``
blocks). Every forward that ends on a boundary takes an image of the state there (a PENDING
checkpoint the runner fills after the forward).

Admission (the scheduler's ``_admit*`` methods) decides what a waiting request resumes from,
and the blocks it takes to run. Two paths, one per kind of waiting request:

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

Progress: the oldest request is never preempted by a newer one (the victim is always the newest
arrival), a load holds every block its first chunk needs before it is sent (a landed load never
waits for room), and holders of prepared prefixes are admitted before new work. Pool pressure:
allocations evict cached blocks (LRU, dropping the READY images that depended on them), then
unpinned images (those the fewest images extend first), then preempt the newest running
sequence (recompute). A preempted sequence's blocks keep their hashes, so its own images can
resume it.
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from atom.engine.block_pool import BlockPool, block_hashes
from atom.engine.checkpoints import Checkpoint, CheckpointStore
from atom.engine.connector import (
    Answered,
    Connector,
    Lease,
    Loaded,
    LoadFailed,
    Outcome,
    Unlease,
)
from atom.engine.sequence import Prepared, ScheduledSpan, SeqStatus, Sequence

__all__ = ["Admit", "LocalHit", "ScheduledSpan", "Scheduler", "SchedulerConfig"]


class Admit(enum.Enum):
    WAIT = "wait"  # not admissible yet (a lookup or load is in flight); try the next one
    BLOCKED = "blocked"  # no room: stop admitting this step (FCFS)


class LocalHit(NamedTuple):
    tokens: int  # the hit: resident and ending at a READY image (0 for none)
    image: Checkpoint | None  # the READY image at ``tokens``
    blocks: list[int]  # the hit's blocks
    resident: list[int]  # the longest resident block prefix (a superset of ``blocks``)


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    checkpoint_interval: int
    max_model_len: int
    prefix_caching: bool = True
    take_images: bool = True


@dataclass
class SchedulerOutput:
    spans: list[ScheduledSpan] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.end - s.start for s in self.spans)


def _arrival(seq: Sequence) -> int:
    return seq.seq_id


class Scheduler:
    """Owns every request's status, blocks, slot, resume point and counters."""

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
        self.waiting: list[Sequence] = []  # arrival order
        self.running: list[Sequence] = []  # arrival order
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.preemptions = 0
        self.tier_tokens_recomputed = 0
        self.tier_leases: dict[int, Lease] = {}  # op id -> what the tier's transfer holds

    # ---- requests -----------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=_arrival)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the tier's outcomes --------------------------------------------------------------

    def settle_tier(self) -> None:
        """Act on what the tier reported (also while idle: frees what finished loads held)."""
        if self.connector is not None:
            self.apply(self.connector.update())

    def apply(self, outcomes: list[Outcome]) -> None:
        """Apply the tier's outcomes in order: the only place the tier's results enter the
        pool, the image store and the sequences (``atom.engine.connector`` says what each
        one means)."""
        for outcome in outcomes:
            if isinstance(outcome, Lease):
                self.pool.acquire(outcome.blocks)
                self.store.pin(outcome.image)
                self.tier_leases[outcome.op_id] = outcome
            elif isinstance(outcome, Unlease):
                lease = self.tier_leases.pop(outcome.op_id)
                self.pool.release(reversed(lease.blocks), lease=True)
                self.store.unpin(lease.image)
            else:
                self._apply_to_request(outcome)

    def _apply_to_request(self, outcome: Outcome) -> None:
        seq = outcome.seq
        if isinstance(outcome, Loaded):
            ready = self._publish(outcome)
            if seq.is_finished:
                return
            if ready:
                self.store.pin(outcome.image)  # the request's own hold, for its restore
                seq.prepared = Prepared(outcome.tokens, outcome.image, outcome.local_tokens)
            else:  # its prefix left the pool meanwhile: recompute, as after a failed load
                self._load_failed(seq)
        elif isinstance(outcome, LoadFailed):
            if outcome.image is not None:
                self.store.drop(outcome.image)
            if seq.is_finished:
                return
            self._load_failed(seq)
        elif not isinstance(outcome, Answered):
            raise TypeError(f"unknown tier outcome {outcome!r}")
        if seq.is_finished:
            return
        if seq.status is SeqStatus.WAITING_FOR_TIER:
            seq.status = SeqStatus.WAITING

    def _publish(self, loaded: Loaded) -> bool:
        """Register a landed load's pages under the sequence's hashes and mark its image
        READY; False if the image cannot be (its prefix is no longer resident)."""
        first = loaded.local_tokens // self.block_size
        hashes = loaded.seq.block_hashes
        for i, b in enumerate(loaded.blocks):
            self.pool.register(b, hashes[first + i])
        return self.store.mark_ready(loaded.image)

    def _load_failed(self, seq: Sequence) -> None:
        """No state at the frontier: re-admission resumes from the last READY image."""
        self.pool.release(reversed(seq.block_table))
        seq.block_table = []
        seq.counters.failed_loads += 1

    # ---- the plan -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.settle_tier()
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
            drafts = self._drafts_for(seq, end, budget)
            end += len(drafts)
            if not self._grow(seq, end, out, scheduled):
                continue  # seq itself was preempted; running[i] is now the next one
            out.spans.append(self._span(seq, seq.num_computed, end, drafts=drafts))
            scheduled.add(seq.seq_id)
            budget -= end - seq.num_computed
            i += 1
        # Requests holding blocks or a tier lookup while they wait count against max_num_seqs:
        # otherwise loads planned for the whole queue fill the pool, and a long queue's lookups
        # keep its chunks locked on the server past the server's lock lifetime.
        holding = sum(1 for s in self.waiting if self._holds(s))
        order = sorted(self.waiting, key=lambda s: s.prepared is None)  # stable: FCFS within
        for seq in order:
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

    # ---- admission ------------------------------------------------------------------------

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

    def _drafts_for(self, seq: Sequence, end: int, budget: int) -> tuple[int, ...]:
        """The drafts a decode span ending at ``end`` (= num_tokens) verifies: the sequence's
        proposals, cut to the budget, to max_model_len and, when images are taken, to the
        next block boundary, so that a boundary is only ever a verify span's end (its image
        is then taken from state holding accepted tokens only, or not at all)."""
        if not seq.draft or end != seq.num_tokens or seq.num_computed != end - 1:
            return ()
        room = min(budget - 1, self.cfg.max_model_len - end)
        if self.cfg.take_images:
            room = min(room, (end - 1) // self.block_size * self.block_size + self.block_size - end)
        return tuple(seq.draft[: max(0, room)])

    def _blocks_for(self, end: int) -> int:
        return -(-end // self.block_size)

    def _allocate(self, n: int) -> list[int] | None:
        if n <= 0:
            return []
        if not self.store.make_room(n):
            return None
        return self.pool.allocate(n)

    def _grow(self, seq: Sequence, end: int, out: SchedulerOutput, scheduled: set[int]) -> bool:
        """Give a running seq blocks up to ``end``, preempting the newest running arrivals
        (never an older one); False if ``seq`` itself, the newest, had to be preempted."""
        need = self._blocks_for(end) - len(seq.block_table)
        while True:
            blocks = self._allocate(need)
            if blocks is not None:
                seq.block_table.extend(blocks)
                return True
            victim = self.running[-1]
            # running is in arrival order and visited oldest first: every scheduled sequence
            # is older than seq, so the victim is seq or newer and not yet scheduled
            assert victim is seq or victim.seq_id not in scheduled, "preempting a scheduled seq"
            self._preempt(victim, out)
            if victim is seq:
                return False

    def _span(
        self, seq: Sequence, start: int, end: int, restore=None, drafts: tuple[int, ...] = ()
    ) -> ScheduledSpan:
        image = self._image_at(seq, end, drafts)
        return ScheduledSpan(seq, start, end, restore=restore, image=image, drafts=drafts)

    def _image_at(self, seq: Sequence, end: int, drafts: tuple[int, ...] = ()) -> Checkpoint | None:
        if end % self.block_size or not self.cfg.take_images:
            return None
        n = end // self.block_size
        if not drafts:
            hashes = self._hashes(seq, n)
        else:
            # the boundary block ends in drafts: hash it as if they were accepted (the image is
            # dropped unless they are), without caching the hash on the sequence
            bs = self.block_size
            hashes = self._hashes(seq, n - 1)
            last = seq.tokens[(n - 1) * bs :] + list(drafts)
            hashes = hashes + block_hashes(last, bs, hashes[-1] if hashes else 0)
        return self.store.create(hashes[-1], end, tuple(hashes))

    def _hashes(self, seq: Sequence, n_blocks: int) -> list[int]:
        have = len(seq.block_hashes)
        if have < n_blocks:
            parent = seq.block_hashes[-1] if have else 0
            bs = self.block_size
            seq.block_hashes.extend(block_hashes(seq.tokens[have * bs : n_blocks * bs], bs, parent))
        return seq.block_hashes[:n_blocks]

    def _start(
        self, seq: Sequence, hit: int, end: int, ckpt, local: int, tier_unloaded: int = 0
    ) -> ScheduledSpan:
        seq.num_computed = hit
        seq.slot = self.free_slots.pop()
        seq.status = SeqStatus.RUNNING
        seq.counters.admitted(hit, local)
        if tier_unloaded:
            lost = max(0, min(tier_unloaded, seq.num_prompt) - hit)
            seq.counters.tier_tokens_recomputed += lost
            self.tier_tokens_recomputed += lost
        bisect.insort(self.running, seq, key=_arrival)
        return self._span(seq, hit, end, restore=ckpt)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.draft = []
        seq.status = SeqStatus.WAITING
        seq.num_computed = 0
        seq.counters.preemptions += 1
        self.preemptions += 1
        self.add(seq)
        out.preempted.append(seq)

    def _release(self, seq: Sequence) -> None:
        self.pool.release(reversed(seq.block_table))
        seq.block_table = []
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None

    # ---- after the forward ------------------------------------------------------------------

    def commit(self, span: ScheduledSpan, end: int | None = None) -> None:
        """The forward of ``span`` ran: publish its full blocks, settle its checkpoints.

        ``end``: where the committed tokens end when it is not the span's end (a verify span
        whose drafts were not all accepted: positions past ``end`` ran on rejected drafts; no
        block of them is published and the span's image, if any, is dropped)."""
        seq, bs = span.seq, self.block_size
        end = span.end if end is None else end
        seq.num_computed = end
        seq.counters.computed(end)
        first, last = span.start // bs, end // bs
        if last > first:
            hashes = self._hashes(seq, last)
            for i in range(first, last):
                self.pool.register(seq.block_table[i], hashes[i])
        if span.image is not None:
            if end == span.end:
                self.store.mark_ready(span.image)
            else:
                self.store.drop(span.image)
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
        if seq.prepared is not None:
            self.store.unpin(seq.prepared.image)
            seq.prepared = None
        self._release(seq)
        seq.draft = []
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if self.connector is not None:
            self.connector.request_finished(seq)

    def before_forward(self, spans: list[ScheduledSpan]) -> None:
        """The step is planned and its forward is next: the tier may prepare its stores."""
        if self.connector is not None:
            self.connector.before_forward(spans)

    def no_forward(self) -> None:
        """The step scheduled nothing: the tier sends what its hooks queued."""
        if self.connector is not None:
            self.connector.no_forward()

    def while_forward(self) -> None:
        """The step's forward is queued on the device: the tier's step-thread work overlaps
        it (what it reports touches no span of the step)."""
        if self.connector is not None:
            self.apply(self.connector.while_forward())

    def after_step(self, seqs: list[Sequence]) -> None:
        """These sequences committed forwards: the tier stores what became storable."""
        if self.connector is not None:
            self.apply(self.connector.after_step(seqs))
