"""Loads and saves of the tier's connector: planning saves, and acting on transfer outcomes.

Part of ``OffloadConnector`` (planner.py), which supplies the image store (read only), spec,
metrics and the op helpers (``_new_op``, ``_launch``, ``_retire``). Everything here runs on the
step thread, and writes no engine state: it appends outcomes for the engine to apply.

A load's outcome: DONE with an image of this layout at its own boundary -> ``Loaded``, naming
the pages and the image, which the engine publishes (blocks registered, image READY);
anything else -> ``LoadFailed`` (the engine drops the image). LATE -> the
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
from atom.model_api import image_header
from atom.tier.operations import OpState, TransferOp
from atom.tier.scheduler_side.tier_request import Phase, TierRequest
from atom.tier.worker_side.local_load import LocalLoadError

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
                self.tier_metrics.loads.inc(outcome="late")
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
            self.tier_metrics.loads.inc(outcome="failed")
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
        """The loaded pages and image, named for the engine to publish while the op still
        holds them (its ``Unlease`` comes after), then the request's (or, if it finished
        meanwhile, the prefix cache's)."""
        self.tier_metrics.loads.inc(outcome="done")
        self.tier_metrics.bytes.inc(op.nbytes, direction="load")
        if not op.local and op.finished_at is not None:
            self.tier_metrics.latency.observe(op.finished_at - op.created_at, op="load")
        self._remember_stored(op.image)  # it came from the tier
        st.load = None
        self._emitted.append(Loaded(st.seq, op.end, op.image, op.start, tuple(op.page_blocks)))
        if not op.local:  # a local op is retired when its copy completed (_local_copied)
            self._retire(st, op)
        if st.alive:
            st.saved_upto = max(st.saved_upto, op.end)
            st.to(Phase.RUNNING)

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
            self.tier_metrics.local_loads.inc(outcome="via_server")
            log.debug("load %s through the server: %s", op, why)
            return False
        op.local = True
        op.mark_in_flight()
        with self._lock:
            st.ops.add(op)
        self.local.copy(located, plan, lambda t, st=st, op=op: self._local_copied(st, op, t))
        op.resolve(True)
        self.tier_metrics.local_loads.inc(outcome="copied")
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
        self.tier_metrics.latency.observe(done_at - op.created_at, op="load")
        self._retire(st, op)

    def _load_failed(self, st: TierRequest, op: TransferOp, why: str) -> None:
        log.warning("tier load %s failed (%s); recomputing [%d, %d)", op, why, op.start, op.end)
        if not op.reached_server:  # else the server releases them as its retrieve ends
            self.lookups.free_locks(st.lmc_id, op.token_ids, op.start, op.end)
        st.load = None
        if st.alive:
            st.to(Phase.RUNNING)
            # the request computes the span itself; it is stored again (the tier lost or
            # refused it), and what the tier said it held past start is doubtful
            st.saved_upto = min(st.saved_upto, op.start)
            if st.tier_has is not None:
                st.tier_has = min(st.tier_has, op.start)
        # the engine drops the destination image (and, for a running request, recomputes)
        self._emitted.append(LoadFailed(st.seq, op.start, op.image))

    # ---- saves --------------------------------------------------------------------------

    def _plan_saves(self, st: TierRequest) -> None:
        """The only maker of saves (every path that stores calls it): the policy's
        ``may_store`` is asked here and nowhere else."""
        if not self.policy.may_store or not self.transfers.healthy or st.tier_has is None:
            return
        seq, bs, chunk = st.seq, self.spec.block_size, self.chunk_size
        b = st.saved_upto + chunk
        while b <= seq.num_computed:
            image = self.images.ready_image(seq.block_hashes[b // bs - 1])
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
                self.tier_metrics.saves.inc(outcome="late")
            return
        op.reported = True
        self._retire(st, op)
        if op.state is OpState.DONE:
            self._remember_stored(op.image)
            self._publish_stored(st, op)
            self.tier_metrics.saves.inc(outcome="done")
            self.tier_metrics.bytes.inc(op.nbytes, direction="save")
            if op.latency_s is not None:
                self.tier_metrics.latency.observe(op.latency_s, op="save")
        else:
            if not op.was_late:
                self.tier_metrics.saves.inc(outcome="failed")
            st.saved_upto = min(st.saved_upto, op.start)  # store it again later
            log.debug("tier save %s failed: %s", op, op.error)

    def _publish_stored(self, st: TierRequest, op: TransferOp) -> None:
        """Tell the KV-event publisher (``kv_events``, when events are on) that the tier holds
        the saved blocks [op.start, op.end): their chained hashes, the parent and tokens."""
        events = self.kv_events
        if events is None:
            return
        bs, hashes = self.spec.block_size, st.seq.block_hashes
        first, last = op.start // bs, op.end // bs
        parent = hashes[first - 1] if first else None
        events.tier_stored(hashes[first:last], token_ids=op.token_ids[op.start : op.end],
                           parent_block_hash=parent)  # fmt: skip

    def _remember_stored(self, image: Checkpoint) -> None:
        self._stored[image.key] = None
        self._stored.move_to_end(image.key)
        if len(self._stored) > STORED_KEYS_KEPT:
            self._stored.popitem(last=False)
