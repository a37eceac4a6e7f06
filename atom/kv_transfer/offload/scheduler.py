"""Scheduler side of the LMCache tier: lookups, load and save decisions, completions.

Per request (one ``TierRequest`` on ``seq.connector_state``, one LMCache request id for its
whole life, since its tokens only ever grow):

  lookup    at first admission, for tokens[:n-1] (the adapter floors to the chunk grid), so a
            hit always leaves a prefill token and ends where a load can end (a stored image).
            When HBM already covers every loadable token the request is admitted at once and
            the answer only tells the saves what the tier still holds (an idle tier costs no
            step).
  load      HBM first: only [floor_chunk(hbm_hit), tier_hit) is loaded; read locks of the rest
            are freed at once. Success -> blocks published, image READY, the request resumes.
            Failure or lateness -> the request recomputes; the span is stored again later.
  saves     every READY image boundary past what the tier holds, each store ending at that
            image, sources leased until terminal; a finished request's stores still complete.
  session   ended once, after the request finished and its last store is terminal.

A lookup that did not answer is not an empty answer: the request neither loads nor stores.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from threading import Lock

from atom.engine.block_pool import BlockPool
from atom.engine.checkpoints import Checkpoint, CheckpointStore
from atom.engine.connector import Connector, Resume
from atom.engine.sequence import SeqStatus, Sequence
from atom.kv_transfer.offload.config import OffloadConfig
from atom.kv_transfer.offload.events import EventPool
from atom.kv_transfer.offload.operations import LookupOp, OpState, TransferOp
from atom.kv_transfer.offload.worker import op_bytes
from atom.metrics import Registry
from atom.model_api import StateSpec, image_header

log = logging.getLogger("atom.offload")


@dataclass(eq=False)
class TierRequest:
    seq: Sequence
    lmc_id: str
    lookup: LookupOp | None = None
    tier_hit: int | None = None  # capped answer; None until known
    settled: bool = False  # the lookup's locks were handed to a load or freed
    background: bool = False  # HBM covers every loadable token: the lookup only informs saves
    can_save: bool = False  # the tier's content for this prefix is known
    saved_upto: int = 0  # the tier holds [0, saved_upto) with an image there
    tier_has: int = 0  # what the lookup said the tier held for this request
    load: TransferOp | None = None
    ops: set[TransferOp] = field(default_factory=set)  # live (leased) transfers
    finished: bool = False
    session_open: bool = False


class OffloadConnector(Connector):
    def __init__(
        self,
        *,
        config: OffloadConfig,
        spec: StateSpec,
        chunk_size: int,
        pool: BlockPool,
        store: CheckpointStore,
        pool_tensor,
        events: EventPool,
        transfers,  # TransferThread (or a test double with the same interface)
        lookups,  # LookupThread
        metrics: Registry,
        notify_progress,
        clock=time.monotonic,
    ):
        self.cfg, self.spec, self.chunk_size = config, spec, chunk_size
        self.pool, self.store, self.pool_tensor = pool, store, pool_tensor
        self.events, self.transfers, self.lookups = events, transfers, lookups
        self.notify, self.clock = notify_progress, clock
        self._outcomes: deque = deque()
        self._lock = Lock()
        self._requests: set[TierRequest] = set()  # alive or with live transfers
        self._events: dict[TransferOp, object] = {}
        self.quarantined: set[TransferOp] = set()
        self._epoch = transfers.epoch
        self.live_ops = 0  # read by the metrics thread: plain ints, no iteration
        self.quarantined_blocks = 0
        self._init_metrics(metrics)

    def _init_metrics(self, m: Registry) -> None:
        self.m_lookups = m.counter("tier_lookups_total", "Tier lookups by outcome.")
        self.m_loads = m.counter("tier_loads_total", "Tier loads by outcome.")
        self.m_saves = m.counter("tier_saves_total", "Tier saves by outcome.")
        self.m_bytes = m.counter("tier_bytes_total", "Bytes moved to/from the tier by direction.")
        self.m_latency = m.histogram("tier_transfer_seconds", "Load/save latency, submit to end.")
        self.m_lookup_latency = m.histogram("tier_lookup_seconds", "Lookup latency.")
        m.gauge(
            "tier_transfers_in_flight", "Loads and saves not yet terminal.", lambda: self.live_ops
        )
        m.gauge(
            "tier_quarantined_blocks",
            "Blocks held by transfers of unknown fate.",
            lambda: self.quarantined_blocks,
        )

    # ---- outcomes from the threads (any thread) ---------------------------------------------

    def post(self, op) -> None:
        with self._lock:
            self._outcomes.append(op)
        self.notify()

    # ---- Connector: step thread ------------------------------------------------------------

    def update(self) -> None:
        epoch = self.transfers.epoch
        if epoch != self._epoch:  # the tier may have lost everything: store again from 0
            self._epoch = epoch
            for st in self._requests:
                st.saved_upto, st.tier_has = 0, 0
        with self._lock:
            outcomes, self._outcomes = list(self._outcomes), deque()
        for op in outcomes:
            if isinstance(op, LookupOp):
                self._on_lookup(op)
            elif op.kind == "load":
                self._on_load(op)
            else:
                self._on_save(op)
        self._sweep_deadlines()
        self._end_sessions()
        self.quarantined = {op for op in self.quarantined if op.leased}
        self.quarantined_blocks = sum(len(op.page_blocks) for op in self.quarantined)

    def _state(self, seq: Sequence) -> TierRequest:
        st = seq.connector_state
        if st is None:
            st = TierRequest(seq, f"{seq.request_id}-{uuid.uuid4().hex[:12]}")
            seq.connector_state = st
            self._requests.add(st)
        return st

    def lookup(self, seq: Sequence, local_hit: int) -> int | None:
        st = self._state(seq)
        if st.tier_hit is not None:
            return 0 if st.settled else st.tier_hit
        if st.background:
            return 0
        if st.lookup is None:
            if not self.cfg.load:  # save-only: store everything, load nothing
                st.tier_hit, st.settled, st.can_save = 0, True, self.transfers.healthy
                return 0
            if not self.transfers.healthy:
                st.tier_hit = 0  # no answer: neither load nor store this prefix
                return 0
            tokens = seq.tokens[: seq.num_tokens - 1]
            st.lookup = LookupOp(st.lmc_id, tokens, self.clock() + self.cfg.lookup_timeout_s, st)
            st.session_open = True
            self.lookups.lookup(st.lookup)
            if local_hit >= (len(tokens) // self.chunk_size) * self.chunk_size:
                # the tier cannot add a token: admit now; the answer only tells the saves what
                # the tier still holds (an idle tier costs no step)
                st.background = True
                return 0
        return None

    def holds(self, seq: Sequence) -> bool:
        st = seq.connector_state
        return (
            st is not None
            and st.lookup is not None
            and not st.settled
            and not st.background
            and (st.tier_hit is None or st.tier_hit > 0)
        )

    def settle_lookup(self, seq: Sequence) -> None:
        st = seq.connector_state
        if st is None or st.settled or st.tier_hit is None:
            return
        st.settled = True
        if st.tier_hit:
            self.lookups.free_locks(st.lmc_id, seq.tokens, 0, st.tier_hit)

    def start_load(
        self, seq: Sequence, start: int, end: int, blocks: list[int], image: Checkpoint
    ) -> None:
        st = self._state(seq)
        st.settled = True
        if start > 0:
            self.lookups.free_locks(st.lmc_id, seq.tokens, 0, start)
        op = TransferOp(
            "load",
            st.lmc_id,
            seq.tokens,  # the live list: ops read tokens [0, end), which never change
            start,
            end,
            list(blocks),
            image,
            self.clock() + self.cfg.transfer_timeout_s,
            owner=st,
        )
        op.lease(self.pool, self.store)
        self.store.unpin(image)  # the creation pin passes to the op's lease
        op.nbytes = op_bytes(op, self.spec.block_bytes)
        st.load = op
        self._launch(st, op)

    def after_step(self, seqs: list[Sequence]) -> None:
        if not self.cfg.save:
            return
        for seq in seqs:
            st = seq.connector_state
            if st is not None and st.can_save:
                self._plan_saves(st)

    def request_finished(self, seq: Sequence) -> None:
        st = seq.connector_state
        if st is not None:
            st.finished = True

    def leases(self) -> dict[int, int]:
        refs: dict[int, int] = {}
        for st in self._requests:
            for op in st.ops:
                if op.leased:
                    for b in op.page_blocks:
                        refs[b] = refs.get(b, 0) + 1
        return refs

    def busy(self) -> bool:
        return any(st.ops or (st.lookup and st.tier_hit is None) for st in self._requests)

    def health(self) -> dict:
        return {"healthy": self.transfers.healthy}

    # ---- lookups ------------------------------------------------------------------------

    def _on_lookup(self, op: LookupOp) -> None:
        st: TierRequest = op.owner
        if op.finished_at is not None:
            self.m_lookup_latency.observe(op.finished_at - op.created_at)
        if st.tier_hit is not None:  # the request stopped waiting (late) or finished
            return
        if op.state is OpState.DONE:
            hit = op.hit // self.chunk_size * self.chunk_size
            st.tier_hit, st.can_save, st.saved_upto, st.tier_has = hit, True, hit, hit
            self.m_lookups.inc(outcome="hit" if hit else "miss")
        else:
            st.tier_hit = 0
            self.m_lookups.inc(outcome="failed")
            log.debug("lookup %s: %s", op.lmc_id, op.error)
        if st.background:  # the request runs from HBM: nothing to load, free what it locked
            self.settle_lookup(st.seq)
            if not st.finished and st.seq.block_table:
                self._plan_saves(st)
            return
        self._wake(st)

    # ---- loads --------------------------------------------------------------------------

    def _on_load(self, op: TransferOp) -> None:
        st: TierRequest = op.owner
        if op.reported:
            return
        if op.state is OpState.LATE:
            if not op.was_late:
                op.was_late = True
                self.quarantined.add(op)
                self.m_loads.inc(outcome="late")
                self._load_failed(st, op, "deadline passed")
            return
        op.reported = True
        if op.was_late:  # the request moved on; the quarantine ends
            self._retire(st, op)
            self.quarantined.discard(op)
            return
        why = self._check_loaded(op)
        if why is None:
            self._load_done(st, op)
        else:
            self.m_loads.inc(outcome="failed")
            self._retire(st, op)
            self._load_failed(st, op, why)

    def _check_loaded(self, op: TransferOp) -> str | None:
        """None if the load put an image of this layout and of its own boundary in place."""
        if op.state is not OpState.DONE:
            return op.error or "failed"
        tag, position = image_header(self.spec, self.pool_tensor, op.units)
        if tag != self.spec.layout_tag:
            return "image of another layout"
        if position != op.end:
            return f"image of boundary {position}, expected {op.end}"
        return None

    def _load_done(self, st: TierRequest, op: TransferOp) -> None:
        """Publish the loaded pages and image while the op still holds them, then hand them
        to the request (or, if it finished meanwhile, to the prefix cache)."""
        seq, bs = st.seq, self.spec.block_size
        hashes = seq.block_hashes
        for i, b in enumerate(op.page_blocks):
            self.pool.register(b, hashes[op.start // bs + i])
        self.m_loads.inc(outcome="done")
        self.m_bytes.inc(op.nbytes, direction="load")
        if op.latency_s is not None:
            self.m_latency.observe(op.latency_s, op="load")
        image = op.image
        image.stored = True  # it came from the tier
        ready = self.store.mark_ready(image)
        st.load = None
        alive = not st.finished
        if alive and ready:
            self.store.pin(image)  # the request's own hold, for its restore
            seq.resume = Resume(tokens=op.end, image=image, local_tokens=op.start)
            st.saved_upto = max(st.saved_upto, op.end)
        self._retire(st, op)
        if alive and not ready:
            self._recompute(st, op.start)
        self._wake(st)

    def _load_failed(self, st: TierRequest, op: TransferOp, why: str) -> None:
        log.warning("tier load %s failed (%s); recomputing [%d, %d)", op, why, op.start, op.end)
        self.store.drop(op.image)
        self.lookups.free_locks(st.lmc_id, op.token_ids, op.start, op.end)
        if op.leased and op.terminal:
            op.release(self.pool, self.store)
        st.load = None
        if not st.finished:
            self._recompute(st, op.start)

    def _recompute(self, st: TierRequest, start: int) -> None:
        """The request drops what it held for the load and will compute the span itself;
        the recomputed span is stored again (the tier lost or refused it)."""
        seq = st.seq
        seq.counters.failed_loads += 1
        self.pool.release(reversed(seq.block_table))
        seq.block_table = []
        st.saved_upto = min(st.saved_upto, start)
        self._wake(st)

    def _sweep_deadlines(self) -> None:
        """The step thread's own bound: a lookup or transfer that the threads have not
        answered by its deadline (plus a margin) is treated as late here too."""
        now = self.clock()
        margin = 1.0
        for st in list(self._requests):
            lk = st.lookup
            if lk is not None and st.tier_hit is None and now > lk.deadline and lk.mark_late():
                st.tier_hit = 0  # no answer: neither load nor store (the thread frees locks)
                self.m_lookups.inc(outcome="late")
                self._wake(st)
            op = st.load
            if op is not None and not op.was_late and now > op.deadline + margin:
                op.mark_late()
                self._on_load(op)

    # ---- saves --------------------------------------------------------------------------

    def _plan_saves(self, st: TierRequest) -> None:
        if not self.transfers.healthy:
            return
        seq, bs, chunk = st.seq, self.spec.block_size, self.chunk_size
        b = st.saved_upto + chunk
        while b <= seq.num_computed:
            image = self.store.get_ready(seq.block_hashes[b // bs - 1])
            if image is not None:
                # a stored flag is trusted only where this request's lookup confirmed it: the
                # server may have evicted or lost what an older save put there
                known = image.stored and b <= st.tier_has
                if not (known or image.saving):
                    self._save(st, st.saved_upto, b, image)
                st.saved_upto = b
            b += chunk

    def _save(self, st: TierRequest, start: int, end: int, image: Checkpoint) -> None:
        seq, bs = st.seq, self.spec.block_size
        op = TransferOp(
            "save",
            st.lmc_id,
            seq.tokens,  # the live list: ops read tokens [0, end), which never change
            start,
            end,
            seq.block_table[start // bs : end // bs],
            image,
            self.clock() + self.cfg.transfer_timeout_s,
            owner=st,
        )
        op.lease(self.pool, self.store)
        op.nbytes = op_bytes(op, self.spec.block_bytes)
        image.saving = True
        st.session_open = True
        self._launch(st, op)

    def _on_save(self, op: TransferOp) -> None:
        st: TierRequest = op.owner
        if op.reported:
            return
        if op.state is OpState.LATE:
            if not op.was_late:
                op.was_late = True
                self.quarantined.add(op)
                self.m_saves.inc(outcome="late")
            return
        op.reported = True
        self._retire(st, op)
        self.quarantined.discard(op)
        op.image.saving = False
        if op.state is OpState.DONE:
            op.image.stored = True
            self.m_saves.inc(outcome="done")
            self.m_bytes.inc(op.nbytes, direction="save")
            if op.latency_s is not None:
                self.m_latency.observe(op.latency_s, op="save")
        else:
            if not op.was_late:
                self.m_saves.inc(outcome="failed")
            st.saved_upto = min(st.saved_upto, op.start)  # store it again later
            log.debug("tier save %s failed: %s", op, op.error)

    # ---- common -------------------------------------------------------------------------

    def _launch(self, st: TierRequest, op: TransferOp) -> None:
        st.ops.add(op)
        self.live_ops += 1
        event = self.events.acquire()
        self._events[op] = event
        self.transfers.submit(op, event)

    def _retire(self, st: TierRequest, op: TransferOp) -> None:
        """A terminal op gives back its event and leases (once)."""
        if op.leased:
            op.release(self.pool, self.store)
        self.events.recycle(self._events.pop(op, None))
        if op in st.ops:
            st.ops.discard(op)
            self.live_ops -= 1

    def _wake(self, st: TierRequest) -> None:
        seq = st.seq
        if not st.finished and seq.status is SeqStatus.WAITING_FOR_TIER and st.load is None:
            seq.status = SeqStatus.WAITING

    def _end_sessions(self) -> None:
        for st in list(self._requests):
            if not st.finished or st.ops:
                continue
            if st.lookup is not None and st.tier_hit is None:
                continue  # its lookup may still take locks; settle first
            if not st.settled and st.tier_hit:
                st.settled = True
                self.lookups.free_locks(st.lmc_id, st.seq.tokens, 0, st.tier_hit)
            if st.session_open:
                self.lookups.end_session(st.lmc_id)
                st.session_open = False
            self._requests.discard(st)

    def shutdown(self, timeout_s: float) -> None:
        """Stores in flight get ``timeout_s`` to finish; then every lease is released and
        every session ended (a lookup still pending is given up and its locks freed)."""
        self.transfers.stop(timeout_s)
        self.update()
        for st in list(self._requests):
            lk = st.lookup
            if lk is not None and st.tier_hit is None and lk.mark_late():
                st.tier_hit, st.settled = 0, True
                self.lookups.free_locks(st.lmc_id, lk.token_ids, 0, len(lk.token_ids))
        for st in list(self._requests):
            for op in list(st.ops):
                op.resolve(False, "shutdown")
                self._retire(st, op)
            st.finished = True
        self.quarantined.clear()
        self._end_sessions()
        self.lookups.stop(timeout_s)
