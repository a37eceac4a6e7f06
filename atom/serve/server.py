"""Wire the engine, its loop, the HTTP app and uvicorn together; shut down in order."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal

import uvicorn

from atom.builder import build_engine
from atom.config import EngineConfig
from atom.serve.app import ServerState, build_app
from atom.serve.engine_loop import EngineLoop
from atom.tokenizer import load_tokenizer

log = logging.getLogger("atom.serve")


def run_server(config: EngineConfig, args: argparse.Namespace) -> int:
    engine = build_engine(config)
    cfg, spec = engine.config, engine.spec
    tokenizer = load_tokenizer(cfg.model)
    loop = EngineLoop(engine, log_interval_s=args.log_interval)
    name = args.served_model_name or cfg.model
    state = ServerState(loop, tokenizer, name, args.default_max_tokens, engine.tier_health)
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

    def on_shutdown() -> None:
        log.info("shutting down: %d requests still in flight are aborted", loop.in_flight)
        loop.stop()
        engine.shutdown(timeout_s=args.drain_timeout)
        log.info("shutdown complete")

    app = build_app(state, on_shutdown)
    server = _Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level.lower(),
            timeout_graceful_shutdown=int(args.drain_timeout),
            access_log=False,
        )
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.handle_exit)  # drain, then exit 0 (not re-raised)
    try:
        server.run()
    finally:
        if loop.thread is None:  # never started: the engine still owns resources
            engine.shutdown(timeout_s=args.drain_timeout)
    return 0


class _Server(uvicorn.Server):
    """uvicorn re-raises the captured signal after a graceful shutdown, so the process would
    exit by SIGTERM; here a drained shutdown exits 0 and the handlers are ours."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield
