"""Attach the LMCache MP tier to an engine: server (owned or given), pool sharing,
registration and lookup threads, and the scheduler-side connector.

Order matters: ``attach`` runs after the pool is allocated and before the model derives its
views from it (``runner.bind``): on CPU the pool's storage moves into shared memory here.
"""

from __future__ import annotations

import logging
import time
from functools import partial

from atom.engine.connector import Outcome
from atom.tier.config import OffloadConfig, namespace, weights_identity
from atom.tier.operations import SettledOps
from atom.tier.policy import TierPolicy
from atom.tier.scheduler_side.planner import OffloadConnector
from atom.tier.server.admin import clear_server
from atom.tier.server.l2 import L2Status, ServerMetrics
from atom.tier.server.lmcache_server import LMCacheServer, LMCacheServerError
from atom.tier.server.supervisor import ServerSupervisor
from atom.tier.tier_metrics import worker_gauges
from atom.tier.worker_side.events import EventPool
from atom.tier.worker_side.layout import SpecShape, share_pool, unlink_segment
from atom.tier.worker_side.local_load import LocalLoads
from atom.tier.worker_side.locator import Locator, Mappings
from atom.tier.worker_side.lookup_thread import LookupThread
from atom.tier.worker_side.transfer_thread import TransferThread

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
        store,
        pool_tensor,
        device,
        metrics,
        notify_progress,
        ranks=None,
        weight_dtype: str = "bf16",
        batch_invariant: bool = False,
        draft_adapter: str | None = None,
    ):
        """``ranks``: a tensor-parallel engine's ``RankChannels`` (None with one rank): every
        rank then registers its own pool and moves its own part of each transfer.
        ``weight_dtype``: the resolved ``EngineConfig.weight_dtype`` (FP8 weights compute other
        bytes, so they key other objects); ``batch_invariant``: the engine's
        ``EngineConfig.batch_invariant`` (its objects are kept apart, computed in other bits)."""
        import zmq

        self.cfg = config
        self.chunk = config.resolved_chunk(block_size)
        self.tp_size = ranks.world_size if ranks is not None else 1
        replicated = ranks.rank_replicated if ranks is not None else True
        self.rank_collapse = config.rank_collapse(self.tp_size, replicated)
        self.policy = TierPolicy.of(config, self.tp_size, self.rank_collapse)
        self.load_mode, why = config.load_path(self.tp_size, self.rank_collapse)
        log.info("tier loads: %s (%s)", self.load_mode, why)
        self.save_mode, why = config.save_path(self.tp_size, self.rank_collapse)
        log.info("tier saves: %s (%s)", self.save_mode, why)
        self.server: LMCacheServer | None = None
        url = config.url
        if url is None:
            self.server = LMCacheServer(
                chunk_size=self.chunk,
                l1_size_gb=config.l1_size_gb,
                l2_adapters=config.l2_adapters,
                l2_store_policy=config.l2_store_policy,
                l2_prefetch_policy=config.l2_prefetch_policy,
                shared_l1="engine_driven" in (self.load_mode, self.save_mode),
            )
            try:
                t0 = time.monotonic()
                self.server.start(wait=True)
                log.info(
                    "owned LMCache server healthy at %s after %.1f s",
                    self.server.url,
                    time.monotonic() - t0,
                )
            except LMCacheServerError as exc:
                log.error(
                    "could not start the LMCache server (%s); serving without the tier until "
                    "a restart succeeds",
                    exc,
                )
            url = self.server.url
        elif config.l2_adapters:
            log.warning(
                "lmcache.l2_adapters describe the external server at %s; atom does not configure "
                "its L2 (start that server with the matching --l2-adapter flags)",
                url,
            )
        self.url = url
        self.l2 = L2Status(config.l2_adapters, owned=self.server is not None)
        self.server_metrics = ServerMetrics(
            self.server.metrics_url if self.server is not None else config.metrics_url
        )
        self.world_size = 1 if self.rank_collapse else self.tp_size  # in the keys
        self.namespace = namespace(
            model=model,
            revision=config.model_revision,
            spec=spec,
            weights=weights_identity(model, seed, weight_dtype, batch_invariant, draft_adapter),
            chunk_size=self.chunk,
            world_size=self.world_size,
            tp_size=self.tp_size,
            rank_collapse=self.rank_collapse,
        )
        self.segment = share_pool(pool_tensor)
        # the threads post the ops they settle here; the connector takes them in ``update``
        settled = SettledOps(notify_progress)
        self.ctx = zmq.Context()
        self.ctx.linger = 0
        shape = SpecShape(block_size, self.chunk, spec.units_per_image)
        self.mappings = self.locator = local = None
        if self.policy.engine_copies:
            self.mappings = Mappings(pool_tensor.device)
            self.locator = self._locator_class()(
                url=url,
                zmq_context=self.ctx,
                namespace=self.namespace,
                world_size=self.world_size,
                chunk=self.chunk,
                mappings=self.mappings,
            )
            local = LocalLoads(
                spec, pool_tensor, self.chunk, config.load_streams, copier=config.load_copy
            )
        self.saves = None
        if self.policy.engine_saves:
            from atom.tier.worker_side.local_save import EngineSaves

            self.saves = EngineSaves(
                url=url,
                zmq_context=self.ctx,
                namespace=self.namespace,
                world_size=self.world_size,
                worker_id=0,
                pool=pool_tensor,
                block_size=block_size,
                chunk_size=self.chunk,
                units_per_image=spec.units_per_image,
                rpc_timeout_s=config.rpc_timeout_s,
                transfer_timeout_s=config.transfer_timeout_s,
            )
        transfers = TransferThread(
            url=url,
            namespace=self.namespace,
            world_size=self.world_size,
            pool=pool_tensor,
            shape=shape,
            config=config,
            zmq_context=self.ctx,
            on_outcome=settled.post,
            server_alive=self._server_alive if self.server is not None else None,
            saves=self.saves,
        )
        if self.locator is not None:  # (the saves' hook is the transfer thread's own)
            transfers.health.on_server_change.append(self.locator.server_changed)
        self.transfers = transfers
        if ranks is not None:
            from atom.tier.worker_side.rank_tier import RankTierSpec
            from atom.tier.worker_side.tier_ranks import RankedTransfers

            fields = ("transfer_timeout_s", "heartbeat_s", "rpc_timeout_s", "lookup_timeout_s")
            self.transfers = RankedTransfers(
                local=transfers,  # rank 0's part; its outcomes go to the fan-in
                ranks=ranks,
                spec=RankTierSpec(
                    url=url,
                    namespace=self.namespace,
                    key_world=self.world_size,
                    collapse=self.rank_collapse,
                    shape=shape,
                    offload=config.model_dump(include=set(fields)),
                    pool_shape=tuple(pool_tensor.shape),
                    pool_dtype=str(pool_tensor.dtype),
                    engine_loads=self.policy.engine_copies,
                ),
                on_outcome=settled.post,
            )
        self.lookups = LookupThread(
            url=url,
            namespace=self.namespace,
            world_size=self.world_size,
            block_size=block_size,
            config=config,
            zmq_context=self.ctx,
            on_outcome=settled.post,
            locator=self.locator,
            # with one copy for every rank, one read lock per loading rank: each rank's
            # retrieve releases one; an engine-driven load's single free releases them all
            readers=self.tp_size if self.rank_collapse else 1,
        )
        self.connector = OffloadConnector(
            config=config,
            spec=spec,
            chunk_size=self.chunk,
            images=store,
            pool_tensor=pool_tensor,
            events=EventPool(device),
            transfers=self.transfers,
            lookups=self.lookups,
            metrics=metrics,
            notify_progress=notify_progress,
            local=local,
            mappings=self.mappings,
            policy=self.policy,
            settled=settled,
        )
        self._l2_metrics(metrics)
        worker_gauges(metrics, self.lookups, transfers, self.saves)
        tier_metrics = self.connector.tier_metrics  # where loads and saves report their phases
        if local is not None:
            local.on_phases = partial(tier_metrics.load_phases.observe_by, "phase")
        if self.saves is not None:
            self.saves.on_phases = partial(tier_metrics.save_phases.observe_by, "phase")
            # across ranks (rank collapse: rank 0 alone saves) the copy is told as the op's
            self.saves.on_copied = settled.post if ranks is None else self.transfers.copied
        self.supervisor: ServerSupervisor | None = None
        if self.server is not None:
            self.supervisor = ServerSupervisor(
                self.server, on_restart=self._server_restarted
            ).start()
            metrics.gauge(
                "tier_server_restarts_total",
                "Times the owned LMCache server was restarted after it died.",
                lambda: self.supervisor.restarts,
                kind="counter",
            )
        self.lookups.start()
        if self.saves is not None:
            self.saves.start_probe(config.rpc_timeout_s)
        # across ranks a rank's first registration can time out (on CUDA the server opens
        # another device's memory) and is retried: wait for the retry too
        wait_s = config.rpc_timeout_s + 2 if ranks is None else 3 * config.rpc_timeout_s + 10
        registered = self.transfers.start(wait_registered_s=wait_s)
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

    def _locator_class(self) -> type[Locator]:
        """Who locates a hit: ``Locator`` (rank 0's objects: one rank, or ranks sharing one
        copy), or across ranks without rank collapse ``RankLocator`` (every rank's objects)."""
        if self.world_size == 1:
            return Locator
        from atom.tier.worker_side.rank_locator import RankLocator

        return RankLocator

    def _server_alive(self) -> bool:
        """Whether the owned server's process is up: as the supervisor last saw it (it polls
        the process every 0.5 s), so the step thread's check is no system call (a waitpid
        there cost 0.2-0.5 ms a load on a 2-core host); asked now without a supervisor."""
        sup, server = getattr(self, "supervisor", None), self.server  # (set after the threads)
        if sup is not None and sup.supervising:
            return server.proc is not None and server.proc.returncode is None
        return server.running

    def _server_restarted(self) -> None:
        """The supervisor restarted the owned server (on its thread), maybe before the tier
        noticed the outage: the probes of its module ask the new process again."""
        for path in (self.locator, self.saves):
            if path is not None:
                path.server_changed("the owned LMCache server was restarted")

    def _l2_metrics(self, m) -> None:
        """LMCache's own L2 counters, read from its Prometheus endpoint when /metrics renders."""
        if self.server_metrics.url is None:
            return
        names = {
            "l2_store_completed_objects": "lmcache_mp_l2_store_completed_objects_chunks_total",
            "l2_store_submitted_objects": "lmcache_mp_l2_store_submitted_objects_chunks_total",
            "l2_prefetch_lookup_objects": "lmcache_mp_l2_prefetch_lookup_objects_chunks_total",
            "l2_prefetch_loaded_objects": "lmcache_mp_l2_prefetch_load_completed_chunks_total",
            "l2_lookup_hit_tokens": "lmcache_mp_lookup_hit_l2_tokens_total",
            "l2_prefetch_failures": "lmcache_mp_l2_prefetch_failure_total",
        }
        for short, src in names.items():
            m.gauge(
                f"tier_{short}_total",
                f"LMCache's {src} (from its Prometheus endpoint; absent while unreachable).",
                lambda src=src: self.server_metrics.totals().get(src, {}),
                kind="counter",
            )
        m.gauge(
            "tier_server_metrics_up",
            "1 when LMCache's Prometheus endpoint answered the last read.",
            self.server_metrics.read_up,
        )

    def clear(self) -> None:
        """Empty the server's L1 (see ``admin.clear_server``); what this engine knew the tier
        held is forgotten, so what it computes is stored again."""
        clear_server(self.url, self.ctx, self.cfg.rpc_timeout_s)
        self.connector.tier_lost()

    def health(self) -> dict:
        return {
            "attached": True,
            "url": self.url,
            "owned": self.server is not None and self.server.owned,
            "healthy": self.transfers.note_health(),
            "namespace": self.namespace,
            "registrations": self.transfers.registrations,
            "recoveries": self.transfers.recoveries,
            "last_error": self.transfers.last_error,
            "since": self.transfers.since,  # wall time of the last up/down change
            "server_pid": self.server.pid if self.server is not None else None,
            "server_restarts": self.supervisor.restarts if self.supervisor is not None else 0,
            "server_last_exit": self.supervisor.last_exit if self.supervisor is not None else "",
            "l2": self.l2.entries(),
            "l2_store_policy": self.cfg.l2_store_policy if self.cfg.l2_adapters else None,
            "l2_prefetch_policy": self.cfg.l2_prefetch_policy if self.cfg.l2_adapters else None,
            "server_metrics_url": self.server_metrics.url,
            "load_mode": self._load_mode(),
            "save_mode": self._save_mode(),
            "tensor_parallel": self._tensor_parallel(),
        }

    def _tensor_parallel(self) -> dict | None:
        if self.tp_size == 1:
            return None
        return {
            "size": self.tp_size,
            "rank_collapse": self.rank_collapse,
            "ranks": self.transfers.rank_health(),
        }

    def _load_mode(self) -> str:
        """engine_driven when loads are copied by the engine (lmcache_driven: by the server;
        the resolved ``load_mode``, logged at attach with its reason)."""
        if self.locator is None:
            return "lmcache_driven"
        return self.locator.mode

    def _save_mode(self) -> str:
        """engine_driven when saves are copied by the engine (lmcache_driven: by the server;
        the resolved ``save_mode``, logged at attach with its reason)."""
        if self.saves is None:
            if self.tp_size > 1 and not self.rank_collapse:
                return "lmcache_driven (engine-driven saves need rank collapse)"
            return "lmcache_driven"
        return self.saves.mode

    def release(self) -> None:
        """What must not outlive the process, when ``shutdown`` cannot finish in time: stop
        the owned server and unlink the pool's /dev/shm segment (both idempotent)."""
        others = getattr(self.transfers, "rank_segments", lambda: [])()
        for name in [self.segment, *others]:  # other ranks' too: their exit may skip cleanup
            try:
                unlink_segment(name)
            except Exception:  # already unlinked
                pass
        if self.supervisor is not None:
            self.supervisor.stop(timeout_s=1.0)
        if self.server is not None:
            self.server.stop(timeout_s=2.0)

    def shutdown(self, timeout_s: float) -> list[Outcome]:
        """Drain and detach (``OffloadConnector.shutdown``), stop what this tier owns; returns
        the connector's last outcomes, for the engine to apply."""
        if self.supervisor is not None:
            self.supervisor.stop()  # the server is stopped on purpose below
        outcomes = self.connector.shutdown(timeout_s)
        if self.mappings is not None:
            self.mappings.close_all()  # after the lookup thread stopped (it maps them)
        try:
            self.ctx.term()
        except Exception:
            log.warning("zmq context did not terminate cleanly", exc_info=True)
        unlink_segment(self.segment)
        if self.server is not None:
            self.server.stop()
        return outcomes
