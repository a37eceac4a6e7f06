"""Scheduler side of the LMCache tier: lookups, load and save decisions, completions.

The connector answers; the engine scheduler decides. It writes no engine state (no
``Sequence``, no block pool, no image store): lookups return a ``TierAnswer``, and ``update``,
``start_load``, ``after_step`` and ``shutdown`` return the outcomes they produced (``Answered``,
``Loaded`` naming the blocks and image a load filled, ``LoadFailed``, and the transfers'
``Lease`` / ``Unlease``), which the engine applies. Per request it keeps one ``TierRequest``
(its phase, locks, saves and live transfers; ``tier_request.py`` has the phases):

  lookup    at first admission, for tokens[:n-1] (the adapter floors to the chunk grid), so a
            hit always leaves a prefill token and ends where a load can end (a stored image).
            When HBM already covers every loadable token the request is admitted at once and
            the answer only tells the saves what the tier still holds (an idle tier costs no
            step). An answer the request waits on is first judged against the concurrent
            lookups of its prefix, and asked again when they show it short (lookup_outcomes.py).
  load      [start, tier_hit) as the engine planned it (start = the resident frontier); the
            read locks below ``start`` are freed at once. Success -> ``Loaded`` (the engine
            publishes the blocks, the image becomes READY). Failure or lateness ->
            ``LoadFailed``; the span is stored again.
  saves     every READY image boundary past what the tier holds, each store ending at that
            image, sources leased until terminal; a finished request's stores still complete.
  session   ended once, after the request finished and its last transfer is terminal.

A lookup that did not answer is not an empty answer: the request neither loads nor stores.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from threading import Lock

from atom.engine.checkpoints import Checkpoint, CheckpointStore
from atom.engine.connector import Answered, Connector, Outcome, TierAnswer
from atom.engine.sequence import Sequence
from atom.metrics import Registry
from atom.model_api import StateSpec
from atom.tier.config import OffloadConfig
from atom.tier.operations import LookupOp, SettledOps, TransferOp
from atom.tier.policy import TierPolicy
from atom.tier.scheduler_side.lookup_outcomes import LookupOutcomes
from atom.tier.scheduler_side.tier_request import Phase, TierRequest
from atom.tier.scheduler_side.transfer_outcomes import TransferOutcomes
from atom.tier.tier_metrics import TierMetrics
from atom.tier.worker_side.events import EventPool

log = logging.getLogger("atom.offload")


class OffloadConnector(LookupOutcomes, TransferOutcomes, Connector):
    def __init__(
        self,
        *,
        config: OffloadConfig,
        spec: StateSpec,
        chunk_size: int,
        images: CheckpointStore,  # read only: which images are READY
        pool_tensor,
        events: EventPool,
        transfers,  # TransferThread (or a test double with the same interface)
        lookups,  # LookupThread
        metrics: Registry,
        notify_progress,
        clock=time.monotonic,
        local=None,  # local_load.LocalLoads: engine-driven loads (None: every load via server)
        mappings=None,  # l1_map.Mappings the locator maps into (closed here when idle)
        policy: TierPolicy | None = None,  # what it may do (None: the config's, one rank)
        settled: SettledOps | None = None,  # where the threads post ops (None: its own)
    ):
        self.cfg, self.spec, self.chunk_size = config, spec, chunk_size
        # the engine's KV-event publisher (``atom.kv_events``) when events are on: told of
        # every save that settled, as blocks the tier now holds
        self.kv_events = None
        self.policy = policy or TierPolicy.of(config)
        self.images, self.pool_tensor = images, pool_tensor
        self.events, self.transfers, self.lookups = events, transfers, lookups
        self.notify, self.clock = notify_progress, clock
        self.settled = settled if settled is not None else SettledOps(notify_progress)
        # the threads' end of it (any thread): an op settled, folded in at the next update
        self.post = self.settled.post
        self._emitted: list[Outcome] = []  # for the engine, returned by update()
        self._lock = Lock()  # guards _requests / ops against the metrics thread
        self._requests: dict[int, TierRequest] = {}  # seq_id -> alive or with live transfers
        self._stored: OrderedDict[int, None] = OrderedDict()  # image keys the tier holds
        self._epoch = transfers.epoch
        self.local, self.mappings = local, mappings
        self.tier_metrics = TierMetrics(metrics, self)

    # ---- computed state (also read by the metrics thread) ----------------------------------

    def _live_ops(self) -> list[TransferOp]:
        with self._lock:
            return [op for st in self._requests.values() for op in st.ops]

    @property
    def live_ops(self) -> int:
        return len(self._live_ops())

    @property
    def quarantined(self) -> set[TransferOp]:
        """Transfers given up on (late) whose fate is unknown: their blocks stay leased."""
        return {op for op in self._live_ops() if op.was_late and op.leased}

    @property
    def quarantined_blocks(self) -> int:
        return sum(len(op.page_blocks) for op in self.quarantined)

    def request_state(self, seq: Sequence) -> TierRequest | None:
        return self._requests.get(seq.seq_id)

    def is_stored(self, image: Checkpoint) -> bool:
        """The tier is known to hold this image (a save of it or a load from it succeeded)."""
        return image.key in self._stored

    def is_saving(self, image: Checkpoint) -> bool:
        return any(op.kind == "save" and op.image.key == image.key for op in self._live_ops())

    # ---- Connector: step thread ------------------------------------------------------------

    def update(self) -> list[Outcome]:
        epoch = self.transfers.epoch
        if epoch != self._epoch:  # the tier may have lost everything: store again from 0
            self._epoch = epoch
            self.tier_lost()
        if self.local is not None:
            self.local.poll()  # copies that completed: their locks are freed, ops retired
            if self.mappings is not None:
                self.mappings.close_idle()
        for op in self.settled.take():
            if isinstance(op, LookupOp):
                self._on_lookup(op)
            elif op.kind == "load":
                self._on_load(op)
            else:
                self._on_save(op)
        self._sweep_deadlines()
        self._judge_answers()
        self._end_sessions()
        self.lookups.flush()
        return self._drain()

    def _drain(self) -> list[Outcome]:
        """The outcomes produced since the last call returned them, in order."""
        emitted, self._emitted = self._emitted, []
        return emitted

    def tier_lost(self) -> None:
        """The tier may hold none of what it held (a restart, a clear): trust nothing stored
        before, and store again what the running requests compute."""
        self._stored.clear()
        for st in self._requests.values():
            st.saved_upto = 0
            if st.tier_has is not None:
                st.tier_has = 0

    def _state(self, seq: Sequence) -> TierRequest:
        st = self._requests.get(seq.seq_id)
        if st is None:
            st = TierRequest(seq, f"{seq.request_id}-{uuid.uuid4().hex[:12]}")
            with self._lock:
                self._requests[seq.seq_id] = st
        return st

    def lookup(self, seq: Sequence, local_hit: int) -> TierAnswer | None:
        st = self._state(seq)
        if st.phase is Phase.NEW:
            self._first_lookup(st, local_hit)
        if st.phase is Phase.LOOKING_UP:
            return None
        return TierAnswer(st.answer if st.phase is Phase.ANSWERED else 0)

    def _first_lookup(self, st: TierRequest, local_hit: int) -> None:
        if not self.policy.may_load or not self.transfers.healthy:
            # save-only: store everything, load nothing; tier down: no answer, neither
            st.tier_has = 0 if self.transfers.healthy else None
            st.to(Phase.RUNNING)
            return
        tokens = st.seq.tokens[: st.seq.num_tokens - 1]
        self._send_lookup(st, tokens, self.clock() + self.cfg.lookup_timeout_s)
        st.session_open = True
        if local_hit >= (len(tokens) // self.chunk_size) * self.chunk_size:
            st.to(Phase.CONFIRMING)  # the tier cannot add a token: admit now
        else:
            st.to(Phase.LOOKING_UP)

    def holds(self, seq: Sequence) -> bool:
        st = self._requests.get(seq.seq_id)
        return st is not None and st.holds

    def settle_lookup(self, seq: Sequence) -> None:
        st = self._requests.get(seq.seq_id)
        if st is not None and st.phase is Phase.ANSWERED:
            st.located = None
            self._free_locks(st)
            st.to(Phase.RUNNING)

    def start_load(
        self, seq: Sequence, start: int, end: int, blocks: list[int], image: Checkpoint
    ) -> list[Outcome]:
        st = self._state(seq)
        if st.phase is not Phase.ANSWERED or end > st.locked:
            raise RuntimeError(f"{st.lmc_id}: load [{start}, {end}) without its lookup's locks")
        if start > 0:
            self.lookups.free_locks(st.lmc_id, seq.tokens, 0, start)
        st.locked = 0  # [start, end) passes to the load; the server frees what lies past end
        if end < st.answer:
            self.lookups.free_locks(st.lmc_id, seq.tokens, end, st.answer)
        op = self._new_op("load", st, start, end, blocks, image)
        st.load = op
        st.to(Phase.LOADING)
        located, st.located = st.located, None
        if self.local is None or not self._load_locally(st, op, located):
            self._launch(st, op)  # the server copies it
        return self._drain()

    def after_step(self, seqs: list[Sequence]) -> list[Outcome]:
        self.lookups.flush()  # the frees this step's loads queued
        for seq in seqs:
            st = self._requests.get(seq.seq_id)
            if st is not None:
                self._plan_saves(st)
        return self._drain()

    def request_finished(self, seq: Sequence) -> None:
        st = self._requests.get(seq.seq_id)
        if st is not None:
            self._drop_held(st)
            self._free_locks(st)
            st.to(Phase.DONE)

    def leases(self) -> dict[int, int]:
        refs: dict[int, int] = {}
        for op in self._live_ops():
            if op.leased:
                for b in op.page_blocks:
                    refs[b] = refs.get(b, 0) + 1
        return refs

    def busy(self) -> bool:
        return any(st.ops or st.lookup_pending for st in self._requests.values())

    def health(self) -> dict:
        return {"healthy": self.transfers.healthy}

    # ---- lookups (answers: lookup_outcomes.py) ----------------------------------------

    def _free_locks(self, st: TierRequest) -> None:
        if st.locked:
            self.lookups.free_locks(st.lmc_id, st.seq.tokens, 0, st.locked)
            st.locked = 0

    def _sweep_deadlines(self) -> None:
        """The step thread's own bound: a lookup or transfer that the threads have not
        answered by its deadline (plus a margin) is treated as late here too."""
        now = self.clock()
        margin = 1.0
        for st in list(self._requests.values()):
            lk = st.lookup
            if st.lookup_pending and now > lk.deadline and lk.mark_late():
                st.answer = 0  # no answer: neither load nor store (the thread frees locks)
                self.tier_metrics.lookups.inc(outcome="late")
                if st.phase in (Phase.LOOKING_UP, Phase.CONFIRMING):
                    if st.phase is Phase.LOOKING_UP:
                        self._emitted.append(Answered(st.seq))
                    st.to(Phase.RUNNING)
            op = st.load
            if op is not None and not op.was_late and now > op.deadline + margin:
                op.mark_late()
                self._on_load(op)

    # ---- common -------------------------------------------------------------------------

    def _new_op(self, kind: str, st: TierRequest, start: int, end: int, blocks, image):
        """The one TransferOp factory: the op leases its blocks and image from here on."""
        op = TransferOp(
            kind,
            st.lmc_id,
            st.seq.tokens,  # the live list: ops read tokens [0, end), which never change
            start,
            end,
            list(blocks),
            image,
            self.clock() + self.cfg.transfer_timeout_s,
            owner=st,
        )
        op.nbytes = (len(op.page_blocks) + len(op.units)) * self.spec.block_bytes  # pages + image
        self._emitted.append(op.lease())
        return op

    def _launch(self, st: TierRequest, op: TransferOp) -> None:
        op.event = self.events.acquire()
        with self._lock:
            st.ops.add(op)
        self.transfers.submit(op)

    def _retire(self, st: TierRequest, op: TransferOp) -> None:
        """A terminal op gives back its event and leases (once)."""
        if op.leased:
            self._emitted.append(op.release())
        if op.event is not None:
            self.events.recycle(op.event)
            op.event = None
        with self._lock:
            st.ops.discard(op)

    def _end_sessions(self) -> None:
        for st in list(self._requests.values()):
            if st.alive or st.ops or st.lookup_pending:
                continue  # a pending lookup may still take locks: its answer frees them
            self._free_locks(st)
            if st.session_open:
                self.lookups.end_session(st.lmc_id)
                st.session_open = False
            with self._lock:
                del self._requests[st.seq.seq_id]

    def shutdown(self, timeout_s: float) -> list[Outcome]:
        """Stores in flight get ``timeout_s`` to finish; then every lease is released and
        every session ended (a lookup still pending is given up and its locks freed)."""
        self.transfers.stop(timeout_s)
        if self.local is not None:
            self.local.drain()  # local copies complete quickly: their locks are freed below
        outcomes = self.update()
        for st in list(self._requests.values()):
            lk = st.lookup
            if st.lookup_pending and lk.mark_late():
                st.answer = 0
                self.lookups.free_locks(st.lmc_id, lk.token_ids, 0, len(lk.token_ids))
            for op in list(st.ops):
                op.resolve(False, "shutdown")
                self._retire(st, op)
            if st.alive:
                self._drop_held(st)
                self._free_locks(st)
                st.to(Phase.DONE)
        self._end_sessions()
        self.lookups.stop(timeout_s)
        return outcomes + self._drain()
