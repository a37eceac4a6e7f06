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
from atom.models.common.config import ConfigError

log = logging.getLogger("atom.serve")

# flag -> EngineConfig field (None: same name with dashes as underscores)
ENGINE_FLAGS: dict[str, type] = {
    "model": str,
    "model-overrides": str,  # JSON object of model config fields
    "block-size": int,
    "num-blocks": int,
    "pool-memory-gb": float,
    "max-num-seqs": int,
    "max-num-batched-tokens": int,
    "max-model-len": int,
    "checkpoint-interval": int,
    "device": str,
    "dtype": str,
    "kv-dtype": str,
    "index-dtype": str,
    "weight-dtype": str,  # auto | bf16 | fp8
    "seed": int,
    "offload": str,
    "speculative-tokens": int,
    "draft-adapter": str,  # a trained draft layer's adapter file
    "tensor-parallel-size": int,
    "tp-all-reduce": str,  # group | one_shot
    "triton-kernels": str,  # true | false
    "triton-off": str,  # name[,name]
    "triton-on": str,  # name[,name]
    "moe-grouped-mm": str,  # true | false
    "batch-invariant": str,  # true | false
    "compile-glue": str,  # true | false
}
OFFLOAD_FLAGS: dict[str, tuple[str, type]] = {
    "lmcache-url": ("url", str),
    "lmcache-l1-gb": ("l1_size_gb", float),
    "lmcache-chunk-size": ("chunk_size", int),
    "lmcache-lookup-timeout": ("lookup_timeout_s", float),
    "lmcache-transfer-timeout": ("transfer_timeout_s", float),
    "lmcache-rpc-timeout": ("rpc_timeout_s", float),
    "lmcache-load-mode": ("load_mode", str),
    "lmcache-save-mode": ("save_mode", str),
    "lmcache-load-copy": ("load_copy", str),
    "lmcache-load-streams": ("load_streams", int),
    "lmcache-tp-rank-collapse": ("tp_rank_collapse", str),
    "model-revision": ("model_revision", str),
    "l2-store-policy": ("l2_store_policy", str),
    "l2-prefetch-policy": ("l2_prefetch_policy", str),
    "lmcache-metrics-url": ("metrics_url", str),
}
# flag -> KVEventsConfig field (docs/SCALING.md); --kv-events-endpoint turns the events on
KV_EVENTS_FLAGS: dict[str, tuple[str, type]] = {
    "kv-events-endpoint": ("endpoint", str),
    "kv-events-replay-endpoint": ("replay_endpoint", str),
    "kv-events-topic": ("topic", str),
    "kv-events-encoding": ("encoding", str),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m atom.serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", help="engine config YAML (flags override it)")
    for flag, kind in ENGINE_FLAGS.items():
        ap.add_argument(f"--{flag}", type=kind, default=None)
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay CUDA graphs for decode steps (default on; --no-cuda-graphs: eager)",
    )
    for flag, (_, kind) in OFFLOAD_FLAGS.items():
        ap.add_argument(f"--{flag}", type=kind, default=None)
    for flag, (_, kind) in KV_EVENTS_FLAGS.items():
        ap.add_argument(f"--{flag}", type=kind, default=None)
    ap.add_argument(
        "--lmcache-l2-adapter",
        action="append",
        default=None,
        metavar="JSON",
        help="an L2 adapter under the owned LMCache server (repeatable), e.g. "
        '\'{"type": "resp", "host": "127.0.0.1", "port": 6379}\' or '
        '\'{"type": "fs", "base_path": "/shared/kv"}\'; replaces the YAML list',
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default=None)
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
    ap.add_argument("--log-interval", type=float, default=10.0)
    ap.add_argument("--log-level", default="INFO")
    ap.add_argument(
        "--print-config", action="store_true", help="print the resolved config as YAML and exit"
    )
    return ap.parse_args(argv)


def build_config(args: argparse.Namespace) -> EngineConfig:
    overrides = {}
    for flag in ENGINE_FLAGS:
        value = getattr(args, flag.replace("-", "_"))
        if value is not None:
            overrides[flag.replace("-", "_")] = value
    if args.enable_prefix_caching is not None:
        overrides["enable_prefix_caching"] = args.enable_prefix_caching
    if args.cuda_graphs is not None:
        overrides["cuda_graphs"] = args.cuda_graphs
    lmcache = {}
    for flag, (field, _) in OFFLOAD_FLAGS.items():
        value = getattr(args, flag.replace("-", "_"))
        if value is not None:
            lmcache[field] = value
    if getattr(args, "lmcache_l2_adapter", None):
        lmcache["l2_adapters"] = list(args.lmcache_l2_adapter)
    kv_events = {}
    for flag, (field, _) in KV_EVENTS_FLAGS.items():
        value = getattr(args, flag.replace("-", "_"), None)
        if value is not None:
            kv_events[field] = value
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
