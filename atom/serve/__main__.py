"""python -m atom.serve --model v41-mini --offload lmcache_mp [--lmcache-url tcp://H:P]
[--config engine.yaml] [flags]

--lmcache-l2-adapter JSON (repeatable) puts an L2 (Redis, a shared directory) under the owned
server: replicas whose servers share one L2 share their prefixes (docs/SCALING.md).
Flags override the YAML file; --print-config shows the resolved config and exits. Without
--lmcache-url (and with --offload lmcache_mp) a local LMCache server is started, owned and
stopped on exit.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from atom.config import EngineConfig, EngineConfigError
from atom.kv_events.config import KVEventsConfig
from atom.models.common.config import ConfigError
from atom.serve import flags
from atom.tier.config import OffloadConfig

log = logging.getLogger("atom.serve")


def build_parser() -> argparse.ArgumentParser:
    """Every flag with its help (the config flags' choices and defaults from the models)."""
    ap = argparse.ArgumentParser(
        prog="python -m atom.serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", help="engine config YAML (flags override it)")
    flags.add_group(ap, "engine (EngineConfig)", EngineConfig, flags.ENGINE)
    ap.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="local prefix hits (default on; off: no local hits)",
    )
    ap.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay CUDA graphs for decode steps (default on; --no-cuda-graphs: eager)",
    )
    flags.add_group(ap, "the LMCache tier (lmcache: OffloadConfig)", OffloadConfig, flags.OFFLOAD)
    flags.add_group(ap, "KV cache events (kv_events)", KVEventsConfig, flags.KV_EVENTS)
    ap.add_argument(
        "--lmcache-l2-adapter",
        action="append",
        default=None,
        metavar="JSON",
        help="an L2 adapter under the owned LMCache server (repeatable), e.g. "
        '\'{"type": "resp", "host": "127.0.0.1", "port": 6379}\' or '
        '\'{"type": "fs", "base_path": "/shared/kv"}\'; replaces the YAML list',
    )
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on; default 127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="port to listen on; default 8000")
    ap.add_argument(
        "--served-model-name",
        default=None,
        help="the model name requests send and /v1/models lists (default: --model's)",
    )
    ap.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        help="max_tokens of a request that sends none (default: what fits max_model_len)",
    )
    ap.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds to let in-flight requests and pending saves finish on exit",
    )
    ap.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint but /health, /ping, "
        "/metrics and /version (401 otherwise); default: $ATOM_API_KEY, else no key",
    )
    ap.add_argument(
        "--max-log-len",
        type=int,
        default=200,
        help="characters (or token ids) of each prompt shown in the per-request log line",
    )
    ap.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="serve GET /tokenizer_info (vLLM's: the tokenizer config, special tokens and chat "
        "template as JSON); off by default, as in vLLM",
    )
    ap.add_argument("--disable-log-requests", action="store_true", help="no per-request log lines")
    ap.add_argument(
        "--log-interval",
        type=float,
        default=10.0,
        help="seconds between the engine's throughput log lines; default 10",
    )
    ap.add_argument(
        "--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR; default INFO"
    )
    ap.add_argument(
        "--print-config", action="store_true", help="print the resolved config as YAML and exit"
    )
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_config(args: argparse.Namespace) -> EngineConfig:
    overrides = flags.given(args, flags.ENGINE)
    if args.enable_prefix_caching is not None:
        overrides["enable_prefix_caching"] = args.enable_prefix_caching
    if args.cuda_graphs is not None:
        overrides["cuda_graphs"] = args.cuda_graphs
    lmcache = flags.given(args, flags.OFFLOAD)
    if getattr(args, "lmcache_l2_adapter", None):
        lmcache["l2_adapters"] = list(args.lmcache_l2_adapter)
    kv_events = flags.given(args, flags.KV_EVENTS)
    if args.config:
        base = EngineConfig.from_yaml(args.config)
        merged = base.model_dump(exclude_unset=True)
        merged.update(overrides)
        merged["lmcache"] = {**base.lmcache.model_dump(exclude_unset=True), **lmcache}
        if kv_events:
            file_events = base.kv_events.model_dump(exclude_unset=True) if base.kv_events else {}
            merged["kv_events"] = {**file_events, **kv_events}
        return EngineConfig.build(source=f"engine config {args.config} + flags", **merged)
    if lmcache:
        overrides["lmcache"] = lmcache
    if kv_events:
        overrides["kv_events"] = kv_events
    return EngineConfig.build(source="flags", **overrides)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = build_config(args)
        # what the engine checks when it is built (the model, the pool, the drafter), checked
        # now: a bad value is an `error:` line and exit 2, like a bad flag
        config.resolved()
        if args.print_config:
            import yaml

            print(yaml.safe_dump(config.resolved().model_dump(mode="json"), sort_keys=False))
            return 0
    except (EngineConfigError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from atom.serve.server import run_server

    return run_server(config, args)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
