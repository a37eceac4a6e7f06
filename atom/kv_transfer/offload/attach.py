"""Attach the LMCache MP tier to an engine: server (owned or given), pool sharing,
registration and lookup threads, and the scheduler-side connector.

Order matters: ``attach`` runs after the pool is allocated and before the model derives its
views from it (``runner.bind``): on CPU the pool's storage moves into shared memory here.
"""

from __future__ import annotations

import logging
import time

from atom.kv_transfer.offload.config import OffloadConfig, namespace, weights_identity
from atom.kv_transfer.offload.events import EventPool
from atom.kv_transfer.offload.lmcache_server import LMCacheServer, LMCacheServerError
from atom.kv_transfer.offload.lookup_thread import LookupThread
from atom.kv_transfer.offload.scheduler import OffloadConnector
from atom.kv_transfer.offload.transfer_thread import TransferThread
from atom.kv_transfer.offload.worker import SpecShape, share_pool, unlink_segment

log = logging.getLogger("atom.offload")


class LMCacheTier:
    """The tier as the engine holds it: the connector plus what must be torn down."""

    def __init__(
        self,
        *,
        config: OffloadConfig,
        model: str,
        seed: int,
        spec,
        block_size: int,
        pool,
        store,
        pool_tensor,
        device,
        metrics,
        notify_progress,
    ):
        import zmq

        self.cfg = config
        self.chunk = config.resolved_chunk(block_size)
        self.server: LMCacheServer | None = None
        url = config.url
        if url is None:
            self.server = LMCacheServer(chunk_size=self.chunk, l1_size_gb=config.l1_size_gb)
            try:
                t0 = time.monotonic()
                self.server.start(wait=True)
                log.info(
                    "owned LMCache server healthy at %s after %.1f s",
                    self.server.url,
                    time.monotonic() - t0,
                )
            except LMCacheServerError as exc:
                log.error("could not start the LMCache server (%s); serving without the tier", exc)
            url = self.server.url
        self.url = url
        self.world_size = config.world_size(tp_size=1, rank_replicated=True)
        self.namespace = namespace(
            model=model,
            revision=config.model_revision,
            spec=spec,
            weights=weights_identity(model, seed),
            chunk_size=self.chunk,
            world_size=self.world_size,
            speculative_tokens=0,
        )
        self.segment = share_pool(pool_tensor)
        self.ctx = zmq.Context()
        self.ctx.linger = 0
        shape = SpecShape(block_size, self.chunk, spec.units_per_image)
        self.transfers = TransferThread(
            url=url,
            namespace=self.namespace,
            world_size=self.world_size,
            pool=pool_tensor,
            shape=shape,
            config=config,
            zmq_context=self.ctx,
            on_outcome=self._post,
            server_alive=(lambda: self.server.running) if self.server is not None else None,
        )
        self.lookups = LookupThread(
            url=url,
            namespace=self.namespace,
            world_size=self.world_size,
            block_size=block_size,
            config=config,
            zmq_context=self.ctx,
            on_outcome=self._post,
        )
        self.connector = OffloadConnector(
            config=config,
            spec=spec,
            chunk_size=self.chunk,
            pool=pool,
            store=store,
            pool_tensor=pool_tensor,
            events=EventPool(device),
            transfers=self.transfers,
            lookups=self.lookups,
            metrics=metrics,
            notify_progress=notify_progress,
        )
        self.lookups.start()
        registered = self.transfers.start(wait_registered_s=config.rpc_timeout_s + 2)
        log.info(
            "LMCache tier %s: namespace %s, chunk %d tokens, %s",
            url,
            self.namespace,
            self.chunk,
            (
                "registered"
                if self.transfers.healthy
                else ("not reachable (retrying in the background)" if registered else "connecting")
            ),
        )

    def _post(self, op) -> None:
        self.connector.post(op)

    def health(self) -> dict:
        return {
            "attached": True,
            "url": self.url,
            "owned": self.server is not None,
            "healthy": self.transfers.note_health(),
            "namespace": self.namespace,
            "registrations": self.transfers.registrations,
            "recoveries": self.transfers.recoveries,
            "last_error": self.transfers.last_error,
            "since": self.transfers.since,  # wall time of the last up/down change
            "server_pid": self.server.pid if self.server is not None else None,
        }

    def release(self) -> None:
        """What must not outlive the process, when ``shutdown`` cannot finish in time: stop
        the owned server and unlink the pool's /dev/shm segment (both idempotent)."""
        try:
            unlink_segment(self.segment)
        except Exception:  # already unlinked
            pass
        if self.server is not None:
            self.server.stop(timeout_s=2.0)

    def shutdown(self, timeout_s: float) -> None:
        self.connector.shutdown(timeout_s)
        try:
            self.ctx.term()
        except Exception:
            log.warning("zmq context did not terminate cleanly", exc_info=True)
        unlink_segment(self.segment)
        if self.server is not None:
            self.server.stop()
