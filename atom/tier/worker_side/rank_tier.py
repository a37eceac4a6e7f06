"""The tier on a rank other than 0: this rank's pool registered with LMCache, and the transfers
rank 0 decides, made on this rank's pool.

Rank 0 owns every decision (lookups, which blocks, deadlines as the request sees them); a rank
only moves bytes. It learns what to move from ops on the control broadcast, in the same order
as the forwards, so a save is submitted after the forward that wrote its blocks and a load
lands before the forward that reads them (rank 0 sends that forward only once every rank
reported its part done). Ops:

  ("tier_attach", RankTierSpec)   before "bind": the rank makes its pool here (the shape rank 0
                                  sends), shares it and registers it; "bind" then binds it
  ("tier_op", TierPart)           one rank's part of a load or a save
  ("tier_stop", drain_s)          drain, unregister, report "stopped"

Outcomes go back to rank 0 on this rank's own pipe (``conn``), as tuples:

  ("part", op_id, state, ok, error, latency_s[, how])
                                                 state: "late" | "done" | "failed"; how (an
                                                 engine-driven part): "copied" | "refused"
  ("health", healthy, epoch, last_error)         on every change, and once registered
  ("segment", name)                              the pool's /dev/shm segment ("" on CUDA)
  ("stopped",)

With rank collapse every rank's adapter names worker 0 of a world of 1, so every rank reads
the one copy rank 0 stored (its lookup took one read lock per reader); without it, rank r is
worker r of N and reads and writes its own objects.

Engine-driven loads (``spec.engine_loads``: load_mode engine_driven): a load's part carries
where rank 0's lookup located the objects (``Where``): with rank collapse the one copy every
rank reads (``where``), without it each rank's own objects (``ranks[r - 1]``, located by the
same lookup for every worker id; a part without this rank's is refused). The rank maps the server's
shared-memory L1 itself (its own ``Mappings``: read-only, identity-checked against the
answer; the first part waits for the mapping), checks the objects and the image header
(``LocalLoads.plan``), copies them into its own pool and reports the part done once the copy
completed (on CUDA it waits for the copy's event: the first version). A part whose copy cannot
be made (no mapping, another segment, objects not what the load expects) is reported failed
("refused"): the op fails and the request recomputes on every rank; never a retrieve, so the
read locks stay rank 0's to free.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

from atom.model_api import image_header
from atom.tier.config import OffloadConfig
from atom.tier.operations import OpState, TransferOp
from atom.tier.worker_side.events import EventPool
from atom.tier.worker_side.layout import SpecShape, share_pool, unlink_segment
from atom.tier.worker_side.local_load import LocalLoads
from atom.tier.worker_side.locator import Mappings, SegmentError, Where
from atom.tier.worker_side.transfer_thread import TransferThread

log = logging.getLogger("atom.distributed")


@dataclass(frozen=True)
class RankTierSpec:
    """What a rank needs to register its pool the way rank 0 does (sent once, picklable)."""

    url: str
    namespace: str
    key_world: int  # world_size in the keys: 1 with collapse, N without
    collapse: bool
    shape: SpecShape
    offload: dict  # OffloadConfig fields
    pool_shape: tuple[int, ...]
    pool_dtype: str  # e.g. "torch.uint8"
    engine_loads: bool = False  # loads are copied from the server's L1 by every rank

    def worker_id(self, rank: int) -> int:
        return 0 if self.collapse else rank


@dataclass(frozen=True)
class TierPart:
    """One rank's share of a transfer: the same request, range, blocks and image units on
    every rank (every rank's pool holds the same blocks at the same ids)."""

    op_id: int
    kind: str  # "load" | "save"
    lmc_id: str
    token_ids: tuple[int, ...]  # [0, end)
    start: int
    end: int
    page_blocks: tuple[int, ...]
    units: tuple[int, ...]
    where: Where | None = None  # an engine-driven load: where its objects sit (else a retrieve)
    ranks: tuple[Where, ...] = ()  # without rank collapse: rank r's own objects at r - 1


class _Units:
    """The image a part moves, as the transfer thread reads it (``op.units``)."""

    def __init__(self, units):
        self.units = list(units)


class RankTier:
    """This rank's side of the tier; lives from ``tier_attach`` to ``tier_stop`` (or ``stop``)."""

    HEALTH_POLL_S = 0.2

    def __init__(self, spec: RankTierSpec, rank: int, conn, runtime_spec):
        import zmq

        self.spec, self.rank, self.conn, self.state_spec = spec, rank, conn, runtime_spec
        self.cfg = OffloadConfig(**spec.offload)
        self.ctx = zmq.Context()
        self.ctx.linger = 0
        self._send_lock = threading.Lock()
        self._stopped = threading.Event()
        self.segment = ""
        self.pool: torch.Tensor | None = None
        self.transfers: TransferThread | None = None
        self.events: EventPool | None = None
        self.mappings: Mappings | None = None
        self.local: LocalLoads | None = None
        self._health_thread = threading.Thread(
            target=self._watch_health, name=f"atom-tier-health-r{rank}", daemon=True
        )

    # ---- serve loop (this rank's step thread) ------------------------------------------

    def attach(self, device) -> torch.Tensor:
        """Make this rank's pool, share it (on CPU its storage moves to shm, before the model
        derives any view at bind) and register it (its first attempt before returning; retries
        in the background); returns the pool."""
        dtype = getattr(torch, self.spec.pool_dtype.split(".")[-1])
        self.pool = torch.zeros(self.spec.pool_shape, dtype=dtype, device=device)
        self.segment = share_pool(self.pool)
        self._send(("segment", self.segment))  # rank 0 removes it if this rank dies
        self.events = EventPool(self.pool.device)
        if self.spec.engine_loads:
            self.mappings = Mappings(self.pool.device)
            self.local = LocalLoads(
                self.state_spec,
                self.pool,
                self.spec.shape.chunk_size,
                self.cfg.load_streams,
                copier=self.cfg.load_copy,
            )
        self.transfers = TransferThread(
            url=self.spec.url,
            namespace=self.spec.namespace,
            world_size=self.spec.key_world,
            worker_id=self.spec.worker_id(self.rank),
            pool=self.pool,
            shape=self.spec.shape,
            config=self.cfg,
            zmq_context=self.ctx,
            on_outcome=self._outcome,
        )
        # register before going back to the op loop: there, on NCCL, this rank waits inside a
        # broadcast, and a registration that synchronises this device would wait for rank 0's
        # next op (on two H200s it timed out that way)
        self.transfers.start(wait_registered_s=self.cfg.rpc_timeout_s + 2)
        self._health_thread.start()
        return self.pool

    def submit(self, part: TierPart) -> None:
        """Queue this rank's part; its event is recorded now, after every forward this rank
        was sent before it (the server waits on it before touching the blocks)."""
        if self.transfers is None:
            self._send(("part", part.op_id, "failed", False, "rank tier not started", None))
            return
        if part.where is not None:
            self._copy(part)
            return
        op = TransferOp(
            part.kind,
            part.lmc_id,
            list(part.token_ids),
            part.start,
            part.end,
            list(part.page_blocks),
            _Units(part.units),
            time.monotonic() + self.cfg.transfer_timeout_s,
        )
        op.op_id = part.op_id
        op.event = self.events.acquire()
        self.transfers.submit(op)

    def _copy(self, part: TierPart) -> None:
        """Copy this rank's part of an engine-driven load from the server's L1 (step thread:
        the next forward this rank runs comes after it); report it done or refused."""
        t0 = time.monotonic()
        try:
            where = self._where(part)
            located = where.located(self._mapping(where), t0)
            plan = self.local.plan(located, part.start, part.end, part.page_blocks, part.units)
        except Exception as exc:  # noqa: BLE001 - refused: the op fails, never wrong bytes
            why = f"rank {self.rank}: located copy refused: {exc}"
            log.warning("tier load part %d: %s", part.op_id, why)
            self._send(("part", part.op_id, "failed", False, why, None, "refused"))
            return
        done: list[float] = []
        self.local.copy(located, plan, done.append)
        self.local.drain()  # CUDA: wait for the copy's event (CPU: already done)
        self.mappings.close_idle()
        latency = (done[0] if done else time.monotonic()) - t0
        self._send(("part", part.op_id, "done", True, "", latency, "copied"))

    def _where(self, part: TierPart) -> Where:
        """Where this rank's part sits: the one copy (rank collapse), else its own objects."""
        if self.spec.collapse:
            return part.where
        if len(part.ranks) < self.rank:
            raise LookupError(f"rank 0's lookup located no objects of rank {self.rank}")
        return part.ranks[self.rank - 1]

    def _mapping(self, where: Where):
        """This rank's mapping of the segment ``where`` names (mapped now if new); raises
        ``SegmentError`` when it cannot be (another host, another file, a failed map)."""
        mapping = self.mappings.for_answer(where.ident)
        if mapping is None:  # being mapped on its thread: this part waits for it
            self.mappings.wait_mapped(self.cfg.rpc_timeout_s)
            mapping = self.mappings.for_answer(where.ident)
        if mapping is None:
            raise SegmentError(f"the server's L1 {where.ident.name} is not mapped yet")
        return mapping

    def stop(self, drain_s: float) -> None:
        """Let what is in flight finish for up to ``drain_s``, unregister, report, clean up."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.transfers is not None:
            self.transfers.stop(drain_s)
        if self._health_thread.is_alive():
            self._health_thread.join(2 * self.HEALTH_POLL_S + 1)
        try:
            self.ctx.term()
        except Exception:
            log.warning("rank %d: zmq context did not terminate cleanly", self.rank)
        if self.mappings is not None:
            self.mappings.close_all()
        unlink_segment(self.segment)
        self.segment = ""
        self._send(("stopped",))

    # ---- transfer thread ----------------------------------------------------------------

    def _outcome(self, op: TransferOp) -> None:
        if op.state is OpState.LATE:
            self._send(("part", op.op_id, "late", False, "deadline passed", None))
            return
        ok, error = op.state is OpState.DONE, op.error
        if ok and op.kind == "load":
            try:
                error = self._check_image(op)
            except Exception as exc:  # noqa: BLE001 - the part fails, rank 0 still hears of it
                error = f"rank {self.rank}: image check failed: {exc!r}"
            ok = error == ""
        if op.event is not None:
            self.events.recycle(op.event)  # a list append: safe from this thread
            op.event = None
        self._send(("part", op.op_id, "done" if ok else "failed", ok, error, op.latency_s))

    def _check_image(self, op: TransferOp) -> str:
        """'' if the load put an image of this layout and of its own boundary in place."""
        tag, position = image_header(self.state_spec, self.pool, op.units)
        if tag != self.state_spec.layout_tag:
            return f"rank {self.rank}: image of another layout"
        if position != op.end:
            return f"rank {self.rank}: image of boundary {position}, expected {op.end}"
        return ""

    def _watch_health(self) -> None:
        last = None
        while not self._stopped.is_set():
            t = self.transfers
            now = (t.note_health(), t.epoch, t.last_error) if t is not None else None
            if now is not None and now != last and t.registrations + len(t.last_error) > 0:
                self._send(("health", *now))
                last = now
            self._stopped.wait(self.HEALTH_POLL_S)

    def _send(self, msg: tuple) -> None:
        with self._send_lock:
            try:
                self.conn.send(msg)
            except (BrokenPipeError, OSError):
                pass  # rank 0 is gone: this rank exits with it


# ---- the tier's ops on a rank: a failing tier never stops the rank (nor so the engine) --------


def _tell(conn, msg: tuple) -> None:
    try:
        if conn is not None:
            conn.send(msg)
    except (OSError, ValueError):
        pass  # rank 0 is gone: this rank's parent-watch ends it


class RankTierOps:
    """The tier ops of ``broadcast_runtime.serve_ops`` on rank ``rank`` (a ``RankOps``):
    ``tier_attach`` makes this rank's ``RankTier`` (before ``bind``: ``pool`` is then the pool
    to bind), ``tier_op`` queues a part, ``tier_stop`` drains it. A tier that failed to attach
    leaves the rank serving: it reports itself unhealthy (rank 0 then moves nothing through the
    tier) and fails every part it is sent. ``conn``: this rank's outcome pipe (write end)."""

    names = frozenset({"tier_attach", "tier_op", "tier_stop"})

    def __init__(self, rank: int, conn):
        self.rank, self.conn = rank, conn
        self.tier: RankTier | None = None
        self.error = ""

    @property
    def pool(self) -> torch.Tensor | None:
        return self.tier.pool if self.tier is not None else None

    def handle(self, name: str, args: tuple, runtime, device) -> None:
        if name == "tier_attach":
            self._attach(args[0], runtime, device)
        elif name == "tier_op":
            self._submit(args[0])
        elif self.tier is None:  # tier_stop
            _tell(self.conn, ("stopped",))
        else:
            self.tier.stop(args[0])

    def close(self) -> None:
        if self.tier is not None:
            self.tier.stop(0.0)  # idempotent: unregisters and removes the pool's shm segment

    def _attach(self, spec: RankTierSpec, runtime, device) -> None:
        tier = None
        try:
            tier = RankTier(spec, self.rank, self.conn, runtime.spec)
            tier.attach(device)
            self.tier, self.error = tier, ""
        except Exception as exc:  # noqa: BLE001 - reported to rank 0 as this rank's tier health
            self.error = f"rank {self.rank}: tier attach failed: {exc!r}"
            log.exception("%s", self.error)
            if tier is not None:
                try:
                    tier.stop(0.0)  # unregisters and removes its pool's segment, if it got there
                except Exception:  # noqa: BLE001
                    log.warning(
                        "rank %d: cleaning up a failed tier attach", self.rank, exc_info=True
                    )
            _tell(self.conn, ("health", False, 0, self.error))

    def _submit(self, part: TierPart) -> None:
        """Queue this rank's part, or report it failed (no tier here, or the submit raised)."""
        why = self.error
        if self.tier is not None:
            try:
                self.tier.submit(part)
                return
            except Exception as exc:  # noqa: BLE001 - the op fails on every rank, the rank lives
                why = f"submit raised: {exc!r}"
                log.exception("tier part %d", part.op_id)
        _tell(
            self.conn, ("part", part.op_id, "failed", False, why or "rank tier not attached", None)
        )
