"""Loads and saves of the tier's connector: planning saves, and acting on transfer outcomes.

Part of ``OffloadConnector`` (scheduler.py), which supplies pool, store, spec, metrics and the
op helpers (``_new_op``, ``_launch``, ``_retire``). Everything here runs on the step thread.

A load's outcome: DONE with an image of this layout at its own boundary -> its pages are
published and the image is READY (``Loaded``); anything else -> ``LoadFailed``. LATE -> the
request recomputes at once, the op stays quarantined (its leases held) until it resolves.
A save's outcome: DONE -> the image is known stored; FAILED -> the span is stored again later.

Engine-driven loads (``_load_locally``): the lookup's answer located the objects; the engine
checks them against the load and copies them itself (local_load.py). The op is DONE when the
copy is issued (the next forward is ordered after it), and stays live, with its leases, until
the copy completed: then the read locks of its span are freed and its latency is observed
(from the decision to load to the copy's completion). A located answer that cannot serve the
load (a server since gone or replaced, too old, objects not what the load expects) sends the
load through the server instead.
"""

from __future__ import annotations

import logging

from atom.engine.checkpoints import Checkpoint
from atom.engine.connector import Loaded, LoadFailed
from atom.kv_transfer.offload.local_load import LocalLoadError
from atom.kv_transfer.offload.operations import OpState, TransferOp
from atom.kv_transfer.offload.tier_request import Phase, TierRequest
from atom.model_api import image_header

log = logging.getLogger("atom.offload")

STORED_KEYS_KEPT = 1 << 16  # image keys remembered as stored (the oldest are forgotten)


class TransferOutcomes:
    # ---- loads --------------------------------------------------------------------------

    def _on_load(self, op: TransferOp) -> None:
        st: TierRequest = op.owner
        if op.reported:
            return
        if op.state is OpState.LATE:
            if not op.was_late:
                op.was_late = True  # quarantined until it resolves
                self.m.loads.inc(outcome="late")
                self._load_failed(st, op, "deadline passed")
            return
        op.reported = True
        if op.was_late:  # the request moved on; the quarantine ends
            self._retire(st, op)
            return
        why = self._check_loaded(op)
        if why is None:
            self._load_done(st, op)
        else:
            self.m.loads.inc(outcome="failed")
            self._retire(st, op)
            self._load_failed(st, op, why)

    def _check_loaded(self, op: TransferOp) -> str | None:
        """None if the load put an image of this layout and of its own boundary in place."""
        if op.state is not OpState.DONE:
            return op.error or "failed"
        if op.local:
            return None  # checked in the source bytes before the copy (no device read)
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
        for i, b in enumerate(op.page_blocks):
            self.pool.register(b, seq.block_hashes[op.start // bs + i])
        self.m.loads.inc(outcome="done")
        self.m.bytes.inc(op.nbytes, direction="load")
        if not op.local and op.finished_at is not None:
            self.m.latency.observe(op.finished_at - op.created_at, op="load")
        image = op.image
        self._remember_stored(image)  # it came from the tier
        ready = self.store.mark_ready(image)
        st.load = None
        if st.alive and ready:
            self.store.pin(image)  # the request's own hold, for its restore
            st.saved_upto = max(st.saved_upto, op.end)
            self._emitted.append(Loaded(seq, op.end, image, op.start))
        if not op.local:  # a local op is retired when its copy completed (_local_copied)
            self._retire(st, op)
        if st.alive:
            st.to(Phase.RUNNING)
            if not ready:  # its prefix left the pool meanwhile
                self._recompute(st, op.start)

    def _load_locally(self, st: TierRequest, op: TransferOp, located) -> bool:
        """Copy ``op`` from where the lookup located it (``located``, or None: nowhere);
        False: send it to the server (counted as via_server)."""
        why = self._local_refusal(located)
        plan = None
        if why is None:
            try:
                plan = self.local.plan(located, op.start, op.end, op.page_blocks, op.units)
            except LocalLoadError as exc:
                why = str(exc)
        if plan is None:
            self.m.local_loads.inc(outcome="via_server")
            log.debug("load %s through the server: %s", op, why)
            return False
        op.local = True
        op.mark_in_flight()
        with self._lock:
            st.ops.add(op)
        self.local.copy(located, plan, lambda t, st=st, op=op: self._local_copied(st, op, t))
        op.resolve(True)
        self.m.local_loads.inc(outcome="copied")
        self._on_load(op)
        return True

    def _local_refusal(self, located) -> str | None:
        alive = getattr(self.transfers, "server_alive", None)
        if located is None:
            return "the answer says nowhere (mapping in progress, locate failed or timed out)"
        if self.mappings is None or located.mapping is not self.mappings.current:
            return "the server that located it was replaced"
        if not self.transfers.healthy or (alive is not None and not alive()):
            return "the server is down"
        if self.clock() - located.at > self.cfg.located_max_age_s:
            return f"located {self.clock() - located.at:.0f} s ago"
        return None

    def _local_copied(self, st: TierRequest, op: TransferOp, done_at: float) -> None:
        """The copy completed: free the span's read locks, retire the op."""
        self.lookups.free_locks(st.lmc_id, op.token_ids, op.start, op.end)
        self.m.latency.observe(done_at - op.created_at, op="load")
        self._retire(st, op)

    def _load_failed(self, st: TierRequest, op: TransferOp, why: str) -> None:
        log.warning("tier load %s failed (%s); recomputing [%d, %d)", op, why, op.start, op.end)
        self.store.drop(op.image)
        if not op.reached_server:  # else the server releases them as its retrieve ends
            self.lookups.free_locks(st.lmc_id, op.token_ids, op.start, op.end)
        st.load = None
        if st.alive:
            st.to(Phase.RUNNING)
            self._recompute(st, op.start)

    def _recompute(self, st: TierRequest, start: int) -> None:
        """The request computes the span itself; it is stored again (the tier lost or refused
        it)."""
        st.saved_upto = min(st.saved_upto, start)
        if st.tier_has is not None:
            st.tier_has = min(st.tier_has, start)  # what it said it held past start is doubtful
        self._emitted.append(LoadFailed(st.seq, start))

    # ---- saves --------------------------------------------------------------------------

    def _plan_saves(self, st: TierRequest) -> None:
        """The only maker of saves (every path that stores calls it): the policy's
        ``may_store`` is asked here and nowhere else."""
        if not self.policy.may_store or not self.transfers.healthy or st.tier_has is None:
            return
        seq, bs, chunk = st.seq, self.spec.block_size, self.chunk_size
        b = st.saved_upto + chunk
        while b <= seq.num_computed:
            image = self.store.get_ready(seq.block_hashes[b // bs - 1])
            if image is not None:
                # stored is trusted only where this request's lookup confirmed it: the server
                # may have evicted or lost what an older save put there
                known = self.is_stored(image) and b <= st.tier_has
                if not (known or self.is_saving(image)):
                    blocks = seq.block_table[st.saved_upto // bs : b // bs]
                    st.session_open = True
                    self._launch(st, self._new_op("save", st, st.saved_upto, b, blocks, image))
                st.saved_upto = b
            b += chunk

    def _on_save(self, op: TransferOp) -> None:
        st: TierRequest = op.owner
        if op.reported:
            return
        if op.state is OpState.LATE:
            if not op.was_late:
                op.was_late = True
                self.m.saves.inc(outcome="late")
            return
        op.reported = True
        self._retire(st, op)
        if op.state is OpState.DONE:
            self._remember_stored(op.image)
            self.m.saves.inc(outcome="done")
            self.m.bytes.inc(op.nbytes, direction="save")
            if op.latency_s is not None:
                self.m.latency.observe(op.latency_s, op="save")
        else:
            if not op.was_late:
                self.m.saves.inc(outcome="failed")
            st.saved_upto = min(st.saved_upto, op.start)  # store it again later
            log.debug("tier save %s failed: %s", op, op.error)

    def _remember_stored(self, image: Checkpoint) -> None:
        self._stored[image.key] = None
        self._stored.move_to_end(image.key)
        if len(self._stored) > STORED_KEYS_KEPT:
            self._stored.popitem(last=False)
