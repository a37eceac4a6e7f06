"""Rank 0's transfers in a tensor-parallel engine: one op, one part per rank, one outcome.

The connector (rank 0 only) sees one ``TransferOp`` per load or save, as with one rank.
``RankedTransfers`` stands where a ``TransferThread`` would and fans each op out: rank 0's part
goes to its own transfer thread, every other rank's part goes on the control broadcast (in
order with the forwards; see ``rank_tier``). The op is terminal when every part is:

- DONE only if every part is DONE (a load failed on any rank makes the request recompute on
  every rank: the connector handles it as any failed load);
- LATE as soon as any part is late (its blocks stay quarantined until every part resolves);
- a rank that is gone fails its parts (it can no longer touch its pool).

Which ranks move bytes: a load, every rank (each pool must hold the bytes); a save, every rank
without rank collapse (each stores its own object), rank 0 alone with it (one copy).

Engine-driven saves (rank collapse only: ``OffloadConfig.save_path``): rank 0's save is its
transfer thread's, engine-driven as with one rank; the reservations the connector sends ahead
go to that thread (``reserve_ahead``, ``ahead_end``), and a save whose copy completed is told
to the connector as its op's (``copied``): no other rank reads the save's blocks, so its
sources are free then, before the commit.

An engine-driven load (``submit_copies``): rank 0's connector copied its part itself from
where its lookup located the objects; every other rank is sent where its part sits (``Where``:
with rank collapse the one copy, without it that rank's own objects, which rank 0's lookup
located for every rank in the same call: ``rank_locator.py``) and copies it from the server's
shared-memory L1 (``rank_tier``), with no retrieve: the op is terminal when every other rank
reported its copy.

Per-rank numbers (parts, bytes, latencies) are kept for /health and the benchmarks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_connections

from atom.distributed.parallel_state import RankChannels, RankFailure
from atom.tier.operations import OpState, TransferOp
from atom.tier.worker_side.layout import unlink_segment
from atom.tier.worker_side.locator import Where
from atom.tier.worker_side.rank_stats import RankStats
from atom.tier.worker_side.rank_tier import RankTierSpec, TierPart

log = logging.getLogger("atom.distributed")


@dataclass
class _Fan:
    parent: TransferOp
    pending: set[int]
    ok: bool = True
    error: str = ""


class RankedTransfers:
    """A ``TransferThread`` (same interface) over every rank of a tensor-parallel engine."""

    def __init__(
        self,
        *,
        local,
        ranks: RankChannels,
        spec: RankTierSpec,
        on_outcome: Callable[[TransferOp], None],
    ):
        self.local, self.ranks, self.spec, self.on_outcome = local, ranks, spec, on_outcome
        self.server_alive = local.server_alive
        self.world = ranks.world_size
        self._lock = threading.Condition()
        self._fans: dict[int, _Fan] = {}
        # rank -> (healthy, epoch, last_error); None until it first reported
        self._health: dict[int, tuple | None] = {r: None for r in range(1, self.world)}
        self._stopped: set[int] = set()
        self._gone: dict[int, str] = {}
        self._segments: dict[int, str] = {}  # each rank's pool segment (CPU), for cleanup
        self.stats = {r: RankStats() for r in range(self.world)}
        self._closing = False
        self._reader = threading.Thread(target=self._read, name="atom-tier-ranks", daemon=True)
        local.on_outcome = self._local_outcome

    # ---- step thread --------------------------------------------------------------------

    def start(self, wait_registered_s: float = 0.0) -> bool:
        """Attach every rank's tier (before ``bind``: each makes, shares and registers its pool
        then), start rank 0's; wait up to ``wait_registered_s`` for every registration."""
        self.ranks.send("tier_attach", self.spec)
        self._reader.start()
        deadline = time.monotonic() + wait_registered_s
        registered = self.local.start(wait_registered_s)
        with self._lock:  # a rank whose first registration failed retries: wait for healthy
            up = self._lock.wait_for(
                lambda: all(h is not None and h[0] for h in self._health.values()) or self._gone,
                max(0.0, deadline - time.monotonic()),
            )
        if not up:
            log.warning("tier: not every rank registered within %.0f s", wait_registered_s)
        return registered

    def submit(self, op: TransferOp) -> None:
        ranks = range(self.world) if op.kind == "load" or not self.spec.collapse else (0,)
        with self._lock:
            self._fans[op.op_id] = _Fan(op, set(ranks))
        # parts go out now and each rank's retrieve releases its own read lock; which reached
        # the server is not known when the op fails, so its locks are never freed by range
        # (an unreleased one lapses with the server's read-lock TTL; one freed twice would
        # drop another request's lock)
        op.reached_server = True
        op.mark_submitted(None)
        if len(ranks) > 1:
            part = TierPart(
                op.op_id,
                op.kind,
                op.lmc_id,
                tuple(op.token_ids[: op.end]),
                op.start,
                op.end,
                tuple(op.page_blocks),
                tuple(op.units),
            )
            try:
                self.ranks.send("tier_op", part)
            except RankFailure as exc:  # the next forward stops the engine; fail the parts
                for r in range(1, self.world):
                    self._part(r, op.op_id, "failed", False, str(exc), None)
        local = TransferOp(
            op.kind,
            op.lmc_id,
            op.token_ids,
            op.start,
            op.end,
            op.page_blocks,
            op.image,
            op.deadline,
            owner=op,
            event=op.event,  # recorded by the connector; recycled once the op is terminal
            op_id=op.op_id,
        )
        self.local.submit(local)

    def submit_copies(self, op: TransferOp, where: Where, ranks: tuple[Where, ...] = ()) -> None:
        """An engine-driven load: rank 0's part is the copy its connector made (or issued);
        every other rank copies its own part: from ``where`` (rank 0's objects: with rank
        collapse, the one copy), without collapse from ``ranks[r - 1]`` (``Located.ranks``:
        rank r's own objects; a rank with none refuses its part). No part reaches the server,
        so the op's read locks (every rank's) stay the connector's to free once the op is
        terminal."""
        self.stats[0].record("load", True, op.nbytes, None, "copied")
        with self._lock:
            self._fans[op.op_id] = _Fan(op, set(range(1, self.world)))
        op.mark_submitted(None)
        part = TierPart(
            op.op_id,
            op.kind,
            op.lmc_id,
            tuple(op.token_ids[: op.end]),
            op.start,
            op.end,
            tuple(op.page_blocks),
            tuple(op.units),
            where,
            tuple(ranks),
        )
        try:
            self.ranks.send("tier_op", part)
        except RankFailure as exc:  # the next forward stops the engine; fail the parts
            for r in range(1, self.world):
                self._part(r, op.op_id, "failed", False, str(exc), None)

    def reserve_ahead(self, aheads: list) -> bool:
        """Reservations sent ahead of the step's forward (``TransferThread.reserve_ahead``):
        rank 0's saves are its transfer thread's, the only part of a save with rank collapse;
        without collapse there are no engine-driven saves and nothing is sent (False)."""
        return self.spec.collapse and self.local.reserve_ahead(aheads)

    def ahead_end(self) -> None:
        if self.spec.collapse:
            self.local.ahead_end()

    def copied(self, part: TransferOp) -> None:
        """Rank 0's engine-driven save ``part`` has its bytes in the server's L1 (its commit
        to come): with rank collapse it is the save's only part, so the op's sources are
        free; the connector learns it from the op (``copied_at``), as with one rank."""
        op = part.owner
        if not self.spec.collapse or not isinstance(op, TransferOp):
            return
        op.copied_at = part.copied_at
        self.on_outcome(op)

    @property
    def health(self) -> RankedTransfers:
        """What the connector reads (``healthy``, ``epoch``): across ranks, this object, which
        combines rank 0's health record with the other ranks' reports."""
        return self

    @property
    def healthy(self) -> bool:
        return self.local.healthy and self._ranks_healthy()

    def _ranks_healthy(self) -> bool:
        return not self._gone and all(h is not None and h[0] for h in self._health.values())

    def note_health(self) -> bool:
        return self.local.note_health() and self._ranks_healthy()

    @property
    def epoch(self) -> int:
        return self.local.epoch + sum(h[1] for h in self._health.values() if h is not None)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._fans)

    @property
    def registrations(self) -> int:
        return self.local.registrations

    @property
    def recoveries(self) -> int:
        return self.local.recoveries

    @property
    def since(self) -> float:
        return self.local.since

    @property
    def last_error(self) -> str:
        if self.local.last_error:
            return self.local.last_error
        for r, why in self._gone.items():
            return f"rank {r}: {why}"
        for r, h in self._health.items():
            if h is not None and not h[0] and h[2]:
                return f"rank {r}: {h[2]}"
        return ""

    def rank_health(self) -> list[dict]:
        out = [{"rank": 0, "healthy": self.local.healthy, **self.stats[0].summary()}]
        for r in range(1, self.world):
            h = self._health[r]
            out.append(
                {
                    "rank": r,
                    "healthy": h is not None and h[0] and r not in self._gone,
                    "last_error": self._gone.get(r) or (h[2] if h is not None else "no report"),
                    **self.stats[r].summary(),
                }
            )
        return out

    def stop(self, drain_s: float) -> None:
        """Every rank drains for up to ``drain_s`` (at once) and unregisters; what is left
        fails."""
        try:
            self.ranks.send("tier_stop", drain_s)
        except RankFailure as exc:
            log.warning("stopping the ranks' tier: %s", exc)
        self.local.stop(drain_s)
        bound = drain_s + 2 * self.local.cfg.rpc_timeout_s + 5
        with self._lock:
            others = set(range(1, self.world))
            if not self._lock.wait_for(lambda: others <= self._stopped | set(self._gone), bound):
                log.warning("ranks %s did not report their tier stopped", others - self._stopped)
            self._closing = True
            left = list(self._fans)
            unstopped = [r for r in range(1, self.world) if r not in self._stopped]
        for r in unstopped:
            self._remove_segment(r)
        for op_id in left:
            for r in range(self.world):
                self._part(r, op_id, "failed", False, "abandoned at shutdown", None)
        self._reader.join(2.0)

    # ---- transfer threads ---------------------------------------------------------------

    def _local_outcome(self, part: TransferOp) -> None:
        state = {OpState.LATE: "late", OpState.DONE: "done"}.get(part.state, "failed")
        self._part(0, part.op_id, state, part.state is OpState.DONE, part.error, part.latency_s)

    def _read(self) -> None:
        conns = {c: r for r, c in enumerate(self.ranks.conns, start=1)}
        while conns and not self._closing:
            for c in wait_connections(list(conns), timeout=0.5):
                r = conns[c]
                try:
                    msg = c.recv()
                except (EOFError, OSError):
                    del conns[c]
                    self._rank_gone(r, "its process exited")
                    continue
                try:
                    self._message(r, msg)
                except Exception:  # noqa: BLE001 - one bad message must not stop the reader
                    log.exception("tensor parallelism: rank %d's tier message %r", r, msg[:1])
            self._fail_late_parts_of_a_dead_server()

    def _fail_late_parts_of_a_dead_server(self) -> None:
        """The owned server died: a late part on another rank can no longer complete (nor
        write into that rank's pool), and that rank's transfer thread does not know the
        server; fail those parts so their op resolves and its blocks come back (rank 0's own
        part is failed by its transfer thread, which knows)."""
        if self.server_alive is None or self.server_alive():
            return
        with self._lock:
            stuck = [
                (r, i)
                for i, f in self._fans.items()
                if f.parent.state is OpState.LATE
                for r in f.pending
                if r != 0
            ]
        for r, op_id in stuck:
            self._part(r, op_id, "failed", False, "the server is gone", None)

    def _message(self, rank: int, msg: tuple) -> None:
        kind = msg[0]
        if kind == "part":
            self._part(rank, *msg[1:])
        elif kind == "health":
            with self._lock:
                self._health[rank] = tuple(msg[1:])
                self._lock.notify_all()
        elif kind == "segment":
            self._segments[rank] = msg[1]
        elif kind == "stopped":
            with self._lock:
                self._stopped.add(rank)
                self._lock.notify_all()

    def _rank_gone(self, rank: int, why: str) -> None:
        with self._lock:
            if rank in self._stopped:
                return  # it stopped its tier and then exited: nothing is lost
            self._gone[rank] = why
            self._lock.notify_all()
            ids = [i for i, f in self._fans.items() if rank in f.pending]
        log.error("tensor parallelism: rank %d's tier is gone (%s)", rank, why)
        self._remove_segment(rank)  # a killed rank could not remove its pool's segment
        for op_id in ids:
            self._part(rank, op_id, "failed", False, f"rank {rank} is gone ({why})", None)

    def rank_segments(self) -> list[str]:
        """The other ranks' pool segments not yet removed (CPU pools; for a last cleanup)."""
        return [n for n in self._segments.values() if n]

    def _remove_segment(self, rank: int) -> None:
        name = self._segments.pop(rank, "")
        try:
            unlink_segment(name)  # no error if the rank removed it itself
        except OSError as exc:
            log.warning("could not remove rank %d's pool segment %s: %s", rank, name, exc)

    def _part(self, rank, op_id, state, ok, error, latency_s, how="") -> None:
        """Record one rank's part; the op's outcome goes to the connector once it is known."""
        late = done = False
        with self._lock:
            fan = self._fans.get(op_id)
            if fan is None or rank not in fan.pending:
                return
            parent = fan.parent
            if state == "late":
                late = True
            else:
                fan.pending.discard(rank)
                self.stats[rank].record(parent.kind, ok, parent.nbytes, latency_s, how)
                if not ok and fan.ok:
                    fan.ok, fan.error = False, f"rank {rank}: {error or 'failed'}"
                done = not fan.pending
                if done:
                    del self._fans[op_id]
        if late:
            if parent.mark_late():
                self.on_outcome(parent)
        elif done and parent.resolve(fan.ok, fan.error):
            self.on_outcome(parent)
