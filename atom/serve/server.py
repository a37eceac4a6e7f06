"""Wire the engine, its loop, the HTTP app and uvicorn together; drain and shut down in order,
within ``--drain-timeout``.

SIGTERM/SIGINT starts a drain: the listening socket stays open, new generation requests get
503, /health answers "draining", and in-flight requests get until ``drain_timeout - reserve``
to finish (then they end with finish_reason "abort"). The rest of the budget goes to stopping
the engine, pending tier saves, unregistering and stopping the owned LMCache server. If that
overruns (a hung tier), the owned server is killed, the pool's /dev/shm segment unlinked and
the process exits at the deadline anyway. A second signal ends the drain at once.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import signal
import threading
import time

import uvicorn

from atom.builder import build_engine
from atom.config import EngineConfig
from atom.serve.app import ServerState, build_app
from atom.serve.engine_loop import EngineLoop
from atom.serve.http_protocol import OpenAIH11Protocol
from atom.tier.server.lmcache_server import remove_dead_leftovers
from atom.tokenizer import load_tokenizer

log = logging.getLogger("atom.serve")


def shutdown_reserve(drain_timeout: float) -> float:
    """The part of the drain budget kept for the engine and tier shutdown."""
    return min(10.0, drain_timeout / 2)


def freeze_startup_heap() -> int:
    """Collect once, then put every object alive now (the model's modules, the graphs, the
    imports: hundreds of thousands) out of the cyclic collector's reach (``gc.freeze``), so a
    full collection while serving scans only what serving allocated since. A built v41-mini
    engine's full collection took 29-43 ms on a 2-core CPU host, under 0.01 ms once frozen,
    and a full collection stalls the step thread for its whole length. Frozen objects are
    still freed by reference counting; this process serves one engine until it exits, so none
    of them becomes cyclic garbage. Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def run_server(config: EngineConfig, args: argparse.Namespace) -> int:
    remove_dead_leftovers()  # /dev/shm segments and owned-server dirs of dead predecessors
    engine = build_engine(config)
    cfg, spec = engine.config, engine.spec
    tokenizer = load_tokenizer(cfg.model)
    loop = EngineLoop(engine, log_interval_s=args.log_interval)
    name = args.served_model_name or cfg.model
    state = ServerState(
        loop,
        tokenizer,
        name,
        args.default_max_tokens,
        engine.tier_health,
        api_key=getattr(args, "api_key", None) or os.environ.get("ATOM_API_KEY") or None,
        max_log_len=getattr(args, "max_log_len", 200),
        log_requests=not getattr(args, "disable_log_requests", False),
        max_model_len=cfg.max_model_len,
        tokenizer_info_endpoint=getattr(args, "enable_tokenizer_info_endpoint", False),
    )
    tier = engine.tier_health()
    log.info(
        "atom serving %s on http://%s:%d | device=%s dtype=%s | PAGE block %d tokens = %d B, "
        "image %d B (%d units) | pool %d blocks (%.2f GiB) | tier: %s",
        name,
        args.host,
        args.port,
        cfg.device,
        cfg.dtype,
        cfg.block_size,
        spec.block_bytes,
        spec.state_bytes,
        spec.units_per_image,
        cfg.num_blocks,
        cfg.num_blocks * spec.block_bytes / 2**30,
        (
            "off"
            if not tier.get("attached")
            else f"{tier.get('url')} ({'healthy' if tier.get('healthy') else 'UNREACHABLE'}"
            f"{', owned' if tier.get('owned') else ''})"
        ),
    )
    log.info(
        "froze %d objects of the started server for the garbage collector", freeze_startup_heap()
    )
    tier_obj = getattr(engine, "tier", None)  # kept: released by force if shutdown overruns
    overran = threading.Event()
    watching = threading.Event()

    def watch_tier() -> None:
        """Look at the tier's health every second, so that an idle server logs an outage (and
        the recovery) when it happens, not at the next request or /health."""
        while not watching.wait(1.0):
            try:
                engine.tier_health()
            except Exception:
                log.debug("tier health check failed", exc_info=True)

    if tier_obj is not None:
        threading.Thread(target=watch_tier, name="atom-tier-watch", daemon=True).start()

    def on_shutdown() -> None:
        watching.set()
        budget = server.remaining()
        log.info(
            "shutting down (%.1f s left of --drain-timeout): %d requests still in flight are "
            "aborted",
            budget,
            loop.in_flight,
        )

        if not engine.tier_health().get("healthy", True):
            _quiet_dead_tier()

        def work() -> None:
            try:
                loop.stop()
                engine.shutdown(timeout_s=max(0.0, budget / 2))
            except Exception:
                log.exception("shutdown failed")

        worker = threading.Thread(target=work, name="atom-shutdown", daemon=True)
        worker.start()
        worker.join(max(0.0, budget - 0.5))
        if worker.is_alive():
            overran.set()
            log.error(
                "shutdown did not finish within --drain-timeout %.0f s; stopping the owned "
                "LMCache server and exiting without waiting for the tier",
                args.drain_timeout,
            )
            if tier_obj is not None:
                tier_obj.release()
        log.info("shutdown complete")

    app = build_app(state, on_shutdown)
    server = _Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level.lower(),
            timeout_graceful_shutdown=max(1, int(args.drain_timeout)),
            access_log=False,
            http=OpenAIH11Protocol,  # HTTP/1.0 streams unchunked; malformed requests get JSON
        ),
        state,
        args.drain_timeout,
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.handle_exit)  # drain, then exit 0 (not re-raised)
    try:
        server.run()
    finally:
        if loop.thread is None:  # never started: the engine still owns resources
            engine.shutdown(timeout_s=args.drain_timeout)
    if overran.is_set():
        logging.shutdown()
        os._exit(0)  # threads stuck on the dead tier must not hold the exit past the budget
    return 0


class _OneLine(logging.Filter):
    """A dead tier's expected failures (unregister timing out) as one line, not a traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            record.msg = f"{record.getMessage()} ({type(exc).__name__}: {exc})"
            record.args, record.exc_info, record.exc_text = None, None, None
        return True


def _quiet_dead_tier() -> None:
    for name in ("lmcache.integration.atom.multi_process_adapter", "atom.offload"):
        logging.getLogger(name).addFilter(_OneLine())


class _Server(uvicorn.Server):
    """Drains on the first signal instead of closing the listener (see the module docstring).
    uvicorn would also re-raise the captured signal after a graceful shutdown, so the process
    would exit by SIGTERM; here a drained shutdown exits 0 and the handlers are ours."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float):
        super().__init__(config)
        self.state, self.drain_timeout = state, drain_timeout
        self.drain_started: float | None = None
        self._aborting = False

    def remaining(self) -> float:
        if self.drain_started is None:
            return self.drain_timeout
        return max(0.0, self.drain_started + self.drain_timeout - time.monotonic())

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def handle_exit(self, sig: int, frame) -> None:
        if self.drain_started is None:
            self.drain_started = time.monotonic()
            self.state.draining = True
            log.info(
                "%s: draining %d requests (new ones get 503; up to %.0f s)",
                signal.Signals(sig).name,
                self.state.active_http,
                self.drain_timeout - shutdown_reserve(self.drain_timeout),
            )
        else:
            log.info("%s again: ending the drain now", signal.Signals(sig).name)
            self._end_drain()

    def _end_drain(self) -> None:
        if self.state.active_http and not self._aborting:
            # end what is still running (finish_reason "abort") so its responses complete
            self._aborting = True
            threading.Thread(target=self.state.loop.stop, name="atom-abort", daemon=True).start()
        self.config.timeout_graceful_shutdown = max(0.5, min(2.0, self.remaining() / 4))
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain_started is not None and not self.should_exit:
            reserve = shutdown_reserve(self.drain_timeout)
            if self.state.active_http == 0 or self.remaining() <= reserve:
                if self.state.active_http:
                    log.warning("drain time is up: aborting %d requests", self.state.active_http)
                self._end_drain()
        return await super().on_tick(counter)
