"""The transfer thread's link to the LMCache server: the worker adapter's life and health.

One ``AdapterLink`` per transfer thread, used on that thread (``note_health`` also from any
thread). It registers the pool (``ensure``: with a fixed backoff after failures, logged once
per outage), tells the rounds whether the tier serves and since when it is back
(``observe``), and registers afresh after a run of refused saves while "healthy" (a restart
the heartbeat missed: ``note_store``, ``maybe_reregister``). Every registration, recovery
and re-registration goes through ``WorkerHealth`` (``health``), whose ``epoch`` the scheduler
side reads and whose hooks the probes of the server's module listen to.

``since`` (wall time of the last up/down change) and ``last_error`` are what /health shows;
the transfer thread's own round errors are recorded in ``last_error`` too.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from atom.tier.config import OffloadConfig
from atom.tier.operations import WorkerHealth
from atom.tier.worker_side.backoff import ConnectBackoff
from atom.tier.worker_side.layout import SpecShape, group_infos, kv_caches

log = logging.getLogger("atom.offload")

REFUSALS_BEFORE_REREGISTER = 3


class AdapterLink:
    def __init__(
        self,
        *,
        url: str,
        namespace: str,
        world_size: int,
        worker_id: int,
        pool: torch.Tensor,
        shape: SpecShape,
        config: OffloadConfig,
        zmq_context,
    ):
        self.url, self.namespace, self.world_size = url, namespace, world_size
        self.worker_id, self.pool, self.shape, self.cfg = worker_id, pool, shape, config
        self.ctx = zmq_context
        self.health = WorkerHealth()
        self.registered = threading.Event()  # set once the first attempt is over
        self.last_error = ""
        self.since = time.time()  # wall time of the last up/down change (or of the start)
        self.recovered_at: float | None = None  # monotonic: healthy again (or registered anew)
        self._old_adapters: list = []
        self._backoff = ConnectBackoff(config.heartbeat_s)
        self._was_healthy = False
        self._refusals = 0
        self._unreachable = self._outage = False  # since the last registration: failed, down
        self._seen_up = self._reported_up = False
        self._health_lock = threading.Lock()

    def retry_in(self) -> float:
        """Seconds until the next registration attempt (the idle thread's wait)."""
        return self._backoff.wait_s()

    # ---- registration -------------------------------------------------------------------

    def connect(self):
        """A new worker adapter with the pool registered (raises if the server refuses)."""
        from lmcache.integration.atom import AtomMPParallelConfig, AtomMPWorkerAdapter

        adapter = AtomMPWorkerAdapter(
            self.url,
            self.ctx,
            self.namespace,
            self.shape.block_size,
            AtomMPParallelConfig(world_size=self.world_size, worker_id=self.worker_id, tp_size=1),
            mq_timeout=self.cfg.rpc_timeout_s,
            heartbeat_interval=self.cfg.heartbeat_s,
            transfer_mode="lmcache_driven",
        )
        adapter.register_kv_caches(
            kv_caches(self.pool, self.shape.units_per_image),
            engine_group_infos=group_infos(
                self.shape.block_size, self.shape.chunk_size, self.shape.units_per_image
            ),
        )
        return adapter

    def ensure(self, stopping: bool) -> None:
        """Register if there is no adapter and the backoff allows it (never while stopping)."""
        if self.health.adapter is not None or stopping or not self._backoff.ready():
            return
        try:
            self.health.adapter = self.connect()
        except Exception as exc:
            self._backoff.failed()
            if self._reported_up or not self.last_error:
                self.since = time.time()
            self.last_error = f"registration failed: {exc!r}"
            if self._was_healthy or self.health.registrations == 0:
                log.warning(
                    "LMCache tier at %s unavailable (%s); serving without it, retrying",
                    self.url,
                    exc,
                )
            self._was_healthy = False
            self._unreachable = True
            self.registered.set()  # the first attempt is over, whatever its outcome
            return
        self.health.registered(after_failures=self._unreachable)
        self._refusals, self._unreachable = 0, False
        self.registered.set()
        log.info("registered the pool with LMCache at %s (namespace %s)", self.url, self.namespace)

    def note_store(self, ok: bool) -> None:
        """A store of the server's answered (a refusal counts towards re-registering)."""
        self._refusals = 0 if ok else self._refusals + 1

    def maybe_reregister(self, healthy: bool) -> None:
        """A silent de-registration (refused saves while 'healthy'): register afresh."""
        if not healthy or self._refusals < REFUSALS_BEFORE_REREGISTER:
            return
        log.warning("LMCache refused %d saves in a row; re-registering", self._refusals)
        self._old_adapters.append(self.health.adapter)
        self.health.adapter = None
        self.recovered_at = time.monotonic()
        self._backoff.reset()
        self.ensure(stopping=False)

    # ---- health ---------------------------------------------------------------------------

    def observe(self, now: float) -> bool:
        """A round's view: whether the tier serves now; a recovery after an outage (or a first
        sight of it healthy since registering) is recorded and sets ``recovered_at``."""
        healthy = self.health.healthy
        self._outage |= self._was_healthy and not healthy
        if healthy and not self._was_healthy and self.health.registrations > 0:
            self.recovered_at = now
            self.health.recovered(after_outage=self._outage)
            self._outage = False
        self.note_health()
        self._was_healthy = healthy
        return healthy

    def note_health(self) -> bool:
        """The tier's health; logs and records (``since``, ``last_error``) when it went down or
        came back. Any thread may call it: the rounds do, and so do /health and the server's
        watcher, which see an outage of an idle tier (the transfer thread blocks when idle)."""
        healthy = self.health.healthy
        with self._health_lock:
            if healthy != self._reported_up:
                if healthy and not self._seen_up and not self.last_error:
                    self.since = time.time()  # the first registration: up since now
                else:
                    self._changed(healthy)
                self._seen_up = self._seen_up or healthy
                self._reported_up = healthy
        return healthy

    def _changed(self, up: bool) -> None:
        self.since = time.time()
        if up:
            log.info(
                "LMCache tier at %s is back (registration %d)", self.url, self.health.registrations
            )
        else:
            if self.health.adapter is not None or not self.last_error:
                self.last_error = "heartbeat failed: the server stopped answering"
            log.warning("LMCache tier at %s is down: %s", self.url, self.last_error)

    def close(self) -> None:
        """Unregister: every adapter this link made is shut down."""
        for adapter in [*self._old_adapters, self.health.adapter]:
            if adapter is None:
                continue
            try:
                adapter.shutdown()
            except Exception:
                log.warning("LMCache worker adapter shutdown failed", exc_info=True)
        self._old_adapters = []
        self.health.adapter = None
