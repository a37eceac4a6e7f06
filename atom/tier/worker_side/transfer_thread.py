"""The transfer thread: submits loads and saves to LMCache and polls them in rounds.

It owns the worker adapter. The step thread only enqueues ops (``submit``) and receives
outcomes through ``on_outcome`` (called here, on this thread; the receiver queues them).

A round: submit what is queued, then query every in-flight future once. An op is checked
for a terminal result first and only then against its deadline, so a finished transfer is
never failed because its round ran late. A round runs on a timer (``poll_interval_s``) only
while transfers are in flight; otherwise the thread blocks until there is work.

Server faults (the adapter's life, registration and health: ``adapter_link.AdapterLink``):
the adapter's heartbeat notices an outage and re-registers after it. A LATE op
(deadline passed, fate unknown) stays quarantined until its future resolves, or until the
server has been healthy again for a grace period without answering it, or until an owned
server process is known dead: a resumed server answers within milliseconds, so silence after
that means the process that held the op is gone. A run of refused saves while "healthy"
(a restart the heartbeat missed) replaces the adapter with a fresh registration. Each of these
(and a first registration after failed ones) calls ``WorkerHealth.on_server_change``'s hooks.

Engine-driven saves (``saves``, ``local_save.EngineSaves``, taken in by ``save_intake``): a
round's saves claim the reservations their step sent ahead of its forward, or are reserved in
one call to the server module; each op's future is an ``EngineSave`` that copies and commits
it (or hands it to the server's store, ``_store_via_server``), polled in the same rounds under
the same deadlines; the round's commits go out together at its end.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from atom.tier.config import OffloadConfig
from atom.tier.operations import OpState, SaveAhead, TransferOp
from atom.tier.worker_side.adapter_link import AdapterLink
from atom.tier.worker_side.copy_waiter import CopyWaiter
from atom.tier.worker_side.engine_save import EngineSave, fail_future
from atom.tier.worker_side.layout import SpecShape, build_spec
from atom.tier.worker_side.save_intake import SaveIntake

log = logging.getLogger("atom.offload")

AHEAD_END = "ahead_end"  # queued after a step's saves: unclaimed reservations are given back


class TransferThread:
    def __init__(
        self,
        *,
        url: str,
        namespace: str,
        world_size: int,
        pool: torch.Tensor,
        worker_id: int = 0,
        shape: SpecShape,
        config: OffloadConfig,
        zmq_context,
        on_outcome: Callable[[TransferOp], None],
        server_alive: Callable[[], bool] | None = None,
        poll_interval_s: float = 0.0005,
        saves=None,
    ):
        self.shape, self.cfg = shape, config
        self.on_outcome = on_outcome
        # worker_id: this rank's worker in the keys (0 with rank collapse)
        self.link = AdapterLink(
            url=url,
            namespace=namespace,
            world_size=world_size,
            worker_id=worker_id,
            pool=pool,
            shape=shape,
            config=config,
            zmq_context=zmq_context,
        )
        self.server_alive = server_alive
        self.poll_interval_s = poll_interval_s
        self.saves = saves  # local_save.EngineSaves: engine-driven saves (None: the server's)
        self._cond = threading.Condition()
        # ops, and (engine-driven saves) lists of reservations to send ahead or AHEAD_END
        self._queue: deque = deque()
        self._inflight: list[TransferOp] = []
        self.health = self.link.health  # what the connector reads: adapter, registrations, ...
        self.intake = None  # save_intake.SaveIntake: engine-driven saves' way in
        self._copy_done = False  # a save's copy completed since the last round began
        if saves is not None:
            saves.fallback = self._store_via_server
            saves.waiter = CopyWaiter(self.copy_done)
            self.health.on_server_change.append(saves.server_changed)
            self.intake = SaveIntake(saves)
        self._stop = False
        self._drain_until: float | None = None
        self.round_errors = 0
        self.rounds = 0  # polling rounds run (each holds the interpreter lock while it runs)
        self.thread = threading.Thread(target=self._run, name="atom-lmcache-transfer", daemon=True)

    # ---- step thread ------------------------------------------------------------------------

    def start(self, wait_registered_s: float = 0.0) -> bool:
        self.thread.start()
        return self.link.registered.wait(wait_registered_s) if wait_registered_s > 0 else False

    def submit(self, op: TransferOp) -> None:
        """Queue ``op`` (its ``event`` marks when its source bytes are written)."""
        with self._cond:
            self._queue.append(op)
            self._cond.notify()

    def copy_done(self) -> None:
        """A save's copy completed (the copy waiter's thread): run a round now rather than at
        the next poll (its commit goes out and the step thread learns its blocks are free)."""
        with self._cond:
            self._copy_done = True
            self._cond.notify()

    def reserve_ahead(self, aheads: list[SaveAhead]) -> bool:
        """Reserve ``aheads`` now, before the step's forward, if saves are engine-driven
        (else False: nothing sent); a save op with the same key claims its reservation, and
        ``ahead_end`` gives back what the step's saves did not claim."""
        if self.saves is None or not self.saves.supported:
            return False
        with self._cond:
            self._queue.append(list(aheads))
            self._cond.notify()
        return True

    def ahead_end(self) -> None:
        """The step's saves are queued: reservations sent ahead and not claimed by them are
        given back (in queue order, so after those saves are taken)."""
        with self._cond:
            self._queue.append(AHEAD_END)
            self._cond.notify()

    @property
    def healthy(self) -> bool:
        return self.health.healthy

    @property
    def last_error(self) -> str:
        """The last failure: a registration's, an outage's or a round's (what /health shows)."""
        return self.link.last_error

    @last_error.setter
    def last_error(self, error: str) -> None:
        self.link.last_error = error

    @property
    def since(self) -> float:
        """Wall time of the tier's last up/down change (or of the start)."""
        return self.link.since

    def note_health(self) -> bool:
        """The tier's health, its changes logged (any thread: ``AdapterLink.note_health``)."""
        return self.link.note_health()

    @property
    def epoch(self) -> int:
        """Changes whenever the tier may have lost what it held (re-registration, recovery)."""
        return self.health.epoch

    @property
    def registrations(self) -> int:
        return self.health.registrations

    @property
    def recoveries(self) -> int:
        return self.health.recoveries

    @property
    def in_flight(self) -> int:
        with self._cond:
            queued = sum(isinstance(item, TransferOp) for item in self._queue)
            return len(self._inflight) + queued

    def stop(self, drain_s: float) -> None:
        """Let queued and in-flight transfers finish for up to ``drain_s``, then give up on
        the rest, unregister and join."""
        with self._cond:
            self._drain_until = time.monotonic() + max(0.0, drain_s)
            self._stop = True
            self._cond.notify()
        self.thread.join(drain_s + self.cfg.rpc_timeout_s * 2 + 5)
        if self.thread.is_alive():
            log.error("transfer thread did not stop; leaving the adapter in place")

    # ---- transfer thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._busy() and not self._stop:
                        wait = None if self.health.adapter is not None else self.link.retry_in()
                        if not self._cond.wait(wait) and self.health.adapter is None:
                            break  # time to try connecting again
                    if self._busy() and not self._queue and not self._stop:
                        only_late = self._inflight and all(
                            op.state is OpState.LATE for op in self._inflight
                        )
                        if not self._copy_done:
                            self._cond.wait(0.05 if only_late else self.poll_interval_s)
                    self._copy_done = False
                    stopping = self._stop
                if stopping and self._drained():
                    break
                self.rounds += 1
                try:
                    self.link.ensure(self._stop)
                    self._submit_queued()
                    self._poll_round()
                except Exception as exc:  # reported, never masked by an older error
                    self.round_errors += 1
                    self.last_error = repr(exc)
                    log.exception("transfer round failed")
        finally:
            self._close()

    def _busy(self) -> bool:
        """Something to poll: ops in flight, or the saves' own calls and copies."""
        return bool(self._inflight) or (self.saves is not None and self.saves.pending)

    def _drained(self) -> bool:
        with self._cond:
            empty = not self._queue and not self._inflight
        return empty or time.monotonic() >= (self._drain_until or 0)

    def _submit_queued(self) -> None:
        engine_saves: list[TransferOp] = []
        while True:
            with self._cond:
                if not self._queue:
                    break
                op = self._queue.popleft()
            adapter = self.health.adapter
            up = adapter is not None and adapter.is_healthy
            if op is AHEAD_END:  # reservations ahead (engine-driven saves), or their end
                self.intake.give_back()
                continue
            if not isinstance(op, TransferOp):
                if up:
                    self.intake.send(op)
                continue
            if not up:
                self._finish(op, False, "tier unavailable")
                continue
            if op.kind == "save" and self.intake is not None and self.intake.engine_driven():
                fut = self.intake.claim(op)
                if fut is not None:
                    self._started(op, fut)
                else:
                    engine_saves.append(op)
                continue
            try:
                spec = build_spec(op, self.shape)
                submit = (
                    adapter.submit_retrieve_request
                    if op.kind == "load"
                    else adapter.submit_store_request
                )
                fut = submit(op.lmc_id, spec, op.event)
            except Exception as exc:
                self._finish(op, False, f"refused: {exc!r}")
                continue
            if fut is None:
                self._finish(op, False, "adapter unhealthy at submit")
                continue
            op.reached_server = True
            op.mark_submitted(fut)
            with self._cond:
                self._inflight.append(op)
        for op, fut, error in self.intake.reserve(engine_saves) if engine_saves else ():
            if fut is None:
                self._finish(op, False, error)
            else:
                self._started(op, fut)

    def _started(self, op: TransferOp, fut) -> None:
        op.reached_server = True
        op.mark_submitted(fut)
        with self._cond:
            self._inflight.append(op)

    def _store_via_server(self, op: TransferOp):
        """The server's store of ``op`` (its future); raises when it cannot be sent."""
        adapter = self.health.adapter
        if adapter is None or not adapter.is_healthy:
            raise RuntimeError("tier unavailable")
        fut = adapter.submit_store_request(op.lmc_id, build_spec(op, self.shape), op.event)
        if fut is None:
            raise RuntimeError("adapter unhealthy at submit")
        return fut

    def _poll_round(self) -> None:
        now = time.monotonic()
        healthy = self.link.observe(now)
        recovered_at = self.link.recovered_at
        grace = 2 * self.cfg.heartbeat_s + 1.0
        server_dead = self.server_alive is not None and not self.server_alive()
        done = []
        for op in list(self._inflight):
            fut = op.future
            try:
                finished = bool(fut.query())
                ok = bool(fut.result()) if finished else False
            except Exception as exc:
                self._finish(op, False, f"transfer raised: {exc!r}")
                done.append(op)
                continue
            if finished:
                engine = isinstance(fut, EngineSave) and fut.server is None  # no store sent
                self._finish(
                    op, ok, "" if ok else (fut.error if engine else "") or "server returned False"
                )
                # a refused store of the server's (an engine-driven save's refusals are the
                # module's, not a sign of a lost registration)
                if op.kind == "save" and not op.was_late and not engine:
                    self.link.note_store(ok)
                done.append(op)
            elif op.state is OpState.IN_FLIGHT and now > op.deadline:
                if op.mark_late():
                    self.on_outcome(op)
            elif op.state is OpState.LATE and (
                server_dead
                or (
                    recovered_at is not None
                    and now > recovered_at + grace
                    and op.submitted_at < recovered_at
                )
            ):
                fail_future(fut)
                self._finish(op, False, "lost: the server that held it is gone")
                done.append(op)
        with self._cond:
            self._inflight = [op for op in self._inflight if op not in done]
        if self.saves is not None:
            self.saves.flush()  # this round's commits and aborts, one call each
        self.link.maybe_reregister(healthy)

    def _finish(self, op: TransferOp, ok: bool, error: str) -> None:
        if op.resolve(ok, error):
            self.on_outcome(op)

    def _close(self) -> None:
        """Give up on what is left (the server will not be asked again), then unregister."""
        with self._cond:
            left, self._inflight = self._inflight, []
            queued, self._queue = list(self._queue), deque()
        for op in queued:
            if isinstance(op, TransferOp):
                self._finish(op, False, "engine shutting down")
        if self.intake is not None:  # reservations nobody claims: aborted by saves.close
            self.intake.give_back()
        for op in left:
            fail_future(op.future)
            self._finish(op, False, "abandoned at shutdown")
        if self.saves is not None:
            try:
                self.saves.close()  # aborts what is reserved, unmaps
            except Exception:
                log.warning("closing engine-driven saves failed", exc_info=True)
        self.link.close()
