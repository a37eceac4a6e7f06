"""The server's config flags: each sets one field of a config model (``EngineConfig``, its
``lmcache`` section ``OffloadConfig``, or ``kv_events`` ``KVEventsConfig``) and says in
``--help`` what it sets, its choices and its default. Choices and defaults are read from the
models' fields, so the help cannot drift from what the config accepts; each flag carries only
its one line of meaning. ``test_flags`` checks that every flag names a real field.

A flag the user does not give stays ``None`` (argparse's default), so the YAML file's value,
or else the model's default, applies: the default shown is the model's.
"""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import dataclass

from pydantic import BaseModel
from pydantic_core import PydanticUndefined


@dataclass(frozen=True)
class Flag:
    name: str  # --NAME
    field: str  # the model's field it sets
    kind: type  # what argparse parses the value as (the model validates it)
    what: str  # what it sets, one line


def _f(name: str, kind: type, what: str, field: str | None = None) -> Flag:
    return Flag(name, field or name.replace("-", "_"), kind, what)


ENGINE = (
    _f("model", str, "a preset name (v41-mini, v41-bench, v4-tiny, ...) or a checkpoint directory"),
    _f("model-overrides", str, "JSON object of model config fields replaced before validation"),
    _f("block-size", int, "tokens per PAGE block (default: the model's; 256 for real shapes)"),
    _f("num-blocks", int, "the PAGE pool as a block count (else --pool-memory-gb, 1 GiB)"),
    _f("pool-memory-gb", float, "the PAGE pool as a memory budget in GiB"),
    _f("max-num-seqs", int, "requests running at once"),
    _f("max-num-batched-tokens", int, "tokens one step may compute, over all requests"),
    _f("max-model-len", int, "longest prompt + output (default: the model's context length)"),
    _f("checkpoint-interval", int, "prefill chunks never cross this many blocks"),
    _f("device", str, "auto, cpu, cuda or cuda:N"),
    _f("dtype", str, "compute dtype"),
    _f("kv-dtype", str, "latent KV dtype in the pool"),
    _f("index-dtype", str, "indexer keys' dtype in the pool"),
    _f(
        "weight-dtype",
        str,
        "FP8-stored linears kept as FP8 or dequantized (auto: as stored on GPU)",
    ),
    _f("seed", int, "seed of a preset's random weights and of sampling"),
    _f("offload", str, "lmcache_mp: offload the prefix cache to an LMCache MP server"),
    _f("speculative-tokens", int, "drafts verified per decode step (0: off; up to 5)"),
    _f("draft-adapter", str, "a trained draft layer's adapter file (tools/train_draft_adapter.py)"),
    _f("tensor-parallel-size", int, "ranks the model is split over (one process each)"),
    _f("tp-all-reduce", str, "how the ranks sum partial outputs (one_shot: CUDA, opt-in)"),
    _f("triton-kernels", str, "true | false: the Triton kernels (CUDA only)"),
    _f("triton-off", str, "Triton kernels to turn off, comma-separated"),
    _f("triton-on", str, "opt-in Triton kernels to turn on, comma-separated"),
    _f("moe-grouped-mm", str, "true | false: routed experts as grouped GEMMs (CUDA bf16, sm90+)"),
    _f("batch-invariant", str, "true | false: bits independent of batch and chunking (slower)"),
    _f(
        "compile-glue",
        str,
        "true | false: torch.compile the glue inside CUDA graphs (experimental)",
    ),
)

OFFLOAD = (
    _f("lmcache-url", str, "tcp://HOST:PORT of an LMCache MP server (default: start one)", "url"),
    _f("lmcache-l1-gb", float, "the owned server's L1 in GiB", "l1_size_gb"),
    _f(
        "lmcache-chunk-size", int, "LMCache chunk in tokens (default: the block size)", "chunk_size"
    ),
    _f("lmcache-lookup-timeout", float, "seconds before a lookup is no answer", "lookup_timeout_s"),
    _f(
        "lmcache-transfer-timeout",
        float,
        "seconds before a load or save is late",
        "transfer_timeout_s",
    ),
    _f(
        "lmcache-rpc-timeout",
        float,
        "seconds a blocking call to the server may take",
        "rpc_timeout_s",
    ),
    _f(
        "lmcache-load-mode",
        str,
        "who copies loads: the engine from the server's L1, or the server",
        "load_mode",
    ),
    _f(
        "lmcache-save-mode",
        str,
        "who copies saves: the engine into L1 space the server reserves, "
        "or the server (auto: the engine on one rank or with rank collapse)",
        "save_mode",
    ),
    _f(
        "lmcache-load-copy",
        str,
        "engine-driven loads on a GPU: copy engines or one kernel",
        "load_copy",
    ),
    _f(
        "lmcache-load-streams",
        int,
        "copy streams engine-driven loads alternate between",
        "load_streams",
    ),
    _f(
        "lmcache-tp-rank-collapse",
        str,
        "ranks share one stored copy (auto: where they hold the same bytes)",
        "tp_rank_collapse",
    ),
    _f("model-revision", str, "the weights' revision, part of the tier's namespace"),
    _f("l2-store-policy", str, "LMCache --l2-store-policy of the owned server"),
    _f("l2-prefetch-policy", str, "LMCache --l2-prefetch-policy of the owned server"),
    _f(
        "lmcache-metrics-url",
        str,
        "an external server's Prometheus endpoint, for /metrics",
        "metrics_url",
    ),
)

KV_EVENTS = (
    _f(
        "kv-events-endpoint",
        str,
        "publish prefix-cache events (vLLM's format) on this ZMQ endpoint, e.g. tcp://*:5557",
        "endpoint",
    ),
    _f(
        "kv-events-replay-endpoint",
        str,
        "ZMQ endpoint that replays buffered batches",
        "replay_endpoint",
    ),
    _f("kv-events-topic", str, "first frame of every message", "topic"),
    _f("kv-events-encoding", str, "map (vLLM's newer layout) or array", "encoding"),
)


def choices(model: type[BaseModel], field: str) -> tuple[str, ...] | None:
    """The values a ``Literal`` field (or an optional one) accepts, else None."""
    ann = model.model_fields[field].annotation
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        ann = args[0] if len(args) == 1 else ann
    if typing.get_origin(ann) is typing.Literal:
        return tuple(str(a) for a in typing.get_args(ann))
    return None


def default_text(model: type[BaseModel], field: str) -> str | None:
    """The field's default as a user would write it; None when the field has none (or its
    default is None or empty: the flag's line says what applies then)."""
    default = model.model_fields[field].default
    if default is PydanticUndefined or default is None or default in ("", [], {}):
        return None
    if isinstance(default, bool):
        return str(default).lower()
    return str(default)


def help_of(model: type[BaseModel], flag: Flag) -> str:
    parts = [flag.what]
    options = choices(model, flag.field)
    if options:
        parts.append("one of " + ", ".join(options))
    default = default_text(model, flag.field)
    if default is not None:
        parts.append(f"default {default}")
    return "; ".join(parts)


def add_group(ap: argparse.ArgumentParser, title: str, model, flags) -> None:
    group = ap.add_argument_group(title)
    for flag in flags:
        group.add_argument(
            f"--{flag.name}", type=flag.kind, default=None, help=help_of(model, flag)
        )


def given(args: argparse.Namespace, flags) -> dict:
    """{field: value} of the flags the user gave."""
    out = {}
    for flag in flags:
        value = getattr(args, flag.name.replace("-", "_"), None)
        if value is not None:
            out[flag.field] = value
    return out
