"""OffloadConfig and the namespace every stored object is keyed under.

The namespace hashes every field that moves a stored byte: model name and revision, the pool
layout id (which covers every geometry field, sliding_window and candidate_block_size
included, the KV and index dtypes, the block size and the speculative config), the chunk
size, the tensor-parallel size, rank collapse and the world size in the keys. Deployments
that differ in any of them never share an object; deployments that agree always do. Nothing
per-process (device, paths, pids, ports) enters it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Literal

import xxhash
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from atom.config_errors import EngineConfigError, format_validation_error
from atom.model_api import StateSpec
from atom.tier.server import l2

NAMESPACE_FORMAT = "atom.offload.ns/2"


class OffloadConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str | None = None  # tcp://host:port of an LMCache MP server; None: start one
    chunk_size: int | None = None  # LMCache chunk in tokens; None: the block size
    lookup_timeout_s: float = 5.0  # a lookup not answered by then is "no answer"
    transfer_timeout_s: float = 10.0  # a load or save not terminal by then is late
    tp_rank_collapse: Literal["auto", "true", "false"] = "auto"
    model_revision: str = ""
    l1_size_gb: float = 2.0  # the owned server's L1 (with url=None)
    heartbeat_s: float = 1.0  # adapter heartbeat; also how fast an outage is noticed
    rpc_timeout_s: float = 3.0  # bound on adapter RPCs that block (construction, register)
    save: bool = True
    load: bool = True
    # who copies a load into the pool (``load_path``). engine_driven: the server's L1 lives in
    # /dev/shm, the lookup's answer says where a hit's objects sit, and the engine copies them
    # into its pool itself (falls back to the server's retrieve where it cannot: a server
    # without the locate module, on another host, or an answer older than located_max_age_s);
    # across ranks every rank copies its own part (with rank collapse the one shared copy,
    # without it its own objects, located by rank 0's lookup for every rank).
    # lmcache_driven: the server copies every load. auto: engine_driven (EngineConfig.resolved,
    # so --print-config, shows the mode). Saves follow save_mode.
    load_mode: Literal["auto", "engine_driven", "lmcache_driven"] = "auto"
    # how an engine-driven load copies on a GPU. copy_engine: the copy engines, one
    # cudaMemcpyBatchAsync call per load (one call per run where the runtime lacks it).
    # kernel: one kernel launch per load that reads the registered L1 bytes over the bus
    # (atom/kernels/host_gather.py; needs Triton; a run not 16-byte aligned falls back to the
    # copy engines). Ignored on CPU.
    load_copy: Literal["copy_engine", "kernel"] = "copy_engine"
    # copy streams an engine-driven load's copies alternate between (copy_engine, on a GPU):
    # one run each in turn. A burst of 16 loads on an H100 reached 94% of a plain copy's
    # bandwidth with 1 (one batched call per load) and 90% with 2, in two runs of five rounds
    # each (benchmarks/results/transfer_h100_load_modes_ade40a7_r*.md); under serving, loads
    # were 1.5-1.7x a copy at p50 with 1 and 1.6-1.8x with 2. So 1. Ignored on CPU
    load_streams: int = 1
    # who copies a save out of the pool (``save_path``). engine_driven: the server module
    # reserves space in the server's shared-memory L1 (atom.reserve), the engine copies the
    # save's objects into it itself and commits them (atom.commit); a reserve refused, a server
    # without the module (or on another host), the segment not mapped yet: that save is the
    # server's store. lmcache_driven: the server copies every save (its store). auto:
    # engine_driven with one rank and across ranks with rank collapse (rank 0 alone saves),
    # lmcache_driven across ranks without it. The default stays lmcache_driven: under serving on
    # one H100 engine-driven saves held their blocks a tenth as long, but decode ITL p50 was
    # 2-7% higher with them in each of three pairs (benchmarks/results/gpu_gate.md, bd8cbf3).
    save_mode: Literal["auto", "engine_driven", "lmcache_driven"] = "lmcache_driven"
    # a located answer older than this is loaded through the server, which checks the objects
    # are still there (the server's read locks lapse after its --l1-read-ttl-seconds, 300 s)
    located_max_age_s: float = 120.0
    # L2 under the owned server's L1 (atom.tier.server.l2): a list of LMCache adapter
    # specs, e.g. {"type": "fs", "base_path": "/shared/kv"} or {"type": "resp", "host": "redis",
    # "port": 6379}; servers sharing one L2 share their objects. With url set they describe the
    # external server's L2 (for /health) and configure nothing.
    l2_adapters: tuple[dict[str, Any], ...] = ()
    l2_store_policy: Literal[l2.STORE_POLICIES] = "default"  # lmcache --l2-store-policy
    l2_prefetch_policy: Literal[l2.PREFETCH_POLICIES] = "default"  # lmcache --l2-prefetch-policy
    # LMCache's Prometheus endpoint (http://host:port/metrics) of an external server, for its
    # L2 metrics in atom's /metrics; the owned server's is known
    metrics_url: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _redact(cls, data: Any) -> Any:
        # errors echo the value they reject: never a secret
        if isinstance(data, dict) and data.get("l2_adapters"):
            data = {**data, "l2_adapters": l2.redacted(data["l2_adapters"])}
        return data

    @field_validator("l2_adapters", mode="before")
    @classmethod
    def _l2(cls, v: Any) -> tuple[dict[str, Any], ...]:
        return l2.validate_adapters(v)

    @field_validator("metrics_url")
    @classmethod
    def _metrics_url(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"https?://[^/\s]+(/\S*)?", v):
            raise ValueError("use http://HOST:PORT/metrics")
        return v

    @field_validator(
        "lookup_timeout_s",
        "transfer_timeout_s",
        "l1_size_gb",
        "heartbeat_s",
        "rpc_timeout_s",
        "located_max_age_s",
    )
    @classmethod
    def _positive(cls, v: float) -> float:
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"must be a positive number of seconds/GiB, got {v}")
        return v

    @field_validator("load_streams")
    @classmethod
    def _streams(cls, v: int) -> int:
        if not 1 <= v <= 4:
            raise ValueError(f"must be 1 to 4 copy streams, got {v}")
        return v

    @field_validator("chunk_size")
    @classmethod
    def _chunk(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"must be >= 1 (or omitted for the block size), got {v}")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        m = re.fullmatch(r"(tcp://)?([^:/]+):(\d+)", v)
        if not m:
            raise ValueError("use tcp://HOST:PORT (or HOST:PORT)")
        return f"tcp://{m.group(2)}:{m.group(3)}"

    @classmethod
    def build(cls, values: dict[str, Any] | None) -> OffloadConfig:
        try:
            return cls(**(values or {}))
        except ValidationError as exc:
            raise EngineConfigError(format_validation_error(exc, "lmcache config")) from None

    def resolved_chunk(self, block_size: int) -> int:
        chunk = self.chunk_size or block_size
        if chunk % block_size:
            raise ValueError(
                f"lmcache.chunk_size={chunk} must be a multiple of block_size={block_size}"
            )
        return chunk

    def load_path(self, tp_size: int, collapse: bool = False) -> tuple[str, str]:
        """(load mode, why) for an engine of ``tp_size`` ranks, ``collapse``: whether its ranks
        share one stored copy (``rank_collapse``). ``auto`` resolves to engine_driven: on one
        rank the engine copies each located hit; across ranks every rank copies its own part
        (with rank collapse the one copy rank 0's lookup located, without it the rank's own
        objects, which rank 0's lookup locates for every rank in the same call)."""
        mode = "engine_driven" if self.load_mode == "auto" else self.load_mode
        if mode == "lmcache_driven":
            why = "lmcache.load_mode=lmcache_driven: the server copies every load"
            if tp_size > 1:
                why += " (every rank's part is the server's retrieve)"
        elif tp_size > 1 and collapse:
            why = (
                f"tensor_parallel_size={tp_size} with rank collapse: every rank copies the one "
                "located copy out of the server's shared-memory L1 into its own pool, through "
                "the server where rank 0 cannot (/health tier.load_mode)"
            )
        elif tp_size > 1:
            why = (
                f"tensor_parallel_size={tp_size} without rank collapse: every rank copies its "
                "own objects, located by rank 0's lookup for every rank, out of the server's "
                "shared-memory L1 into its own pool, through the server where rank 0 cannot "
                "(/health tier.load_mode)"
            )
        else:
            why = (
                "one rank: the engine copies each located hit out of the server's shared-memory "
                "L1 itself, through the server where it cannot (/health tier.load_mode)"
            )
        if not self.load:
            why = f"lmcache.load=false: nothing is loaded ({why})"
        return mode, why

    def save_path(self, tp_size: int, collapse: bool = False) -> tuple[str, str]:
        """(save mode, why) for an engine of ``tp_size`` ranks, ``collapse``: whether its ranks
        share one stored copy (``rank_collapse``). ``auto`` resolves to engine_driven on one
        rank and across ranks with rank collapse (rank 0 alone saves, from its own pool, as one
        rank does); without collapse every rank stores its own objects, which only the server's
        stores do, so ``engine_driven`` is refused there."""
        mode = self.save_mode
        if mode == "engine_driven" and tp_size > 1 and not collapse:
            raise EngineConfigError(
                f"lmcache.save_mode=engine_driven with tensor_parallel_size={tp_size} without "
                "rank collapse: engine-driven saves copy rank 0's pool only, and without "
                "collapse every rank stores its own objects; set lmcache.tp_rank_collapse "
                "(auto or true, for a model whose ranks hold the same tier bytes), or use "
                "save_mode auto (lmcache_driven without collapse) or lmcache_driven"
            )
        if mode == "auto":
            mode = "engine_driven" if tp_size == 1 or collapse else "lmcache_driven"
        if mode == "lmcache_driven":
            why = "lmcache.save_mode=lmcache_driven: the server copies every save"
            if tp_size > 1 and self.save_mode == "auto":
                why = (
                    f"tensor_parallel_size={tp_size} without rank collapse: every rank stores "
                    "its own objects, each part the server's store"
                )
        elif tp_size > 1:
            why = (
                f"tensor_parallel_size={tp_size} with rank collapse: rank 0 copies each save "
                "(the one copy every rank loads) into space the server reserved in its "
                "shared-memory L1 and commits it, through the server where it cannot "
                "(/health tier.save_mode)"
            )
        else:
            why = (
                "one rank: the engine copies each save into space the server reserved in its "
                "shared-memory L1 and commits it, through the server where it cannot "
                "(/health tier.save_mode)"
            )
        if not self.save:
            why = f"lmcache.save=false: nothing is saved ({why})"
        return mode, why

    def rank_collapse(self, tp_size: int, rank_replicated: bool) -> bool:
        """Whether a tensor-parallel engine stores one copy (rank 0's) that every rank loads.

        ``true``, or ``auto`` for a model whose PAGE blocks and images hold the same bytes on
        every rank (``rank_replicated``; DeepSeek-V4.1: its latent KV and per-request state
        are computed whole on every rank). ``true`` for a model whose bytes differ per rank is
        refused: every rank would load rank 0's bytes."""
        if tp_size == 1:
            return False
        if self.tp_rank_collapse == "true" and not rank_replicated:
            raise EngineConfigError(
                f"lmcache.tp_rank_collapse=true with tensor_parallel_size={tp_size}: this "
                "model's tier bytes differ per rank, so one copy cannot serve every rank "
                "(use auto or false)"
            )
        return self.tp_rank_collapse == "true" or (
            self.tp_rank_collapse == "auto" and rank_replicated
        )

    def world_size(self, tp_size: int, rank_replicated: bool) -> int:
        """Ranks that enter the keys: 1 when the ranks share one copy (rank collapse)."""
        return 1 if self.rank_collapse(tp_size, rank_replicated) else tp_size


def model_identity(model: str) -> str:
    """A model's name as it enters the namespace: a preset name, or a directory's basename
    (not its path: two hosts with the same checkpoint in different places share objects)."""
    p = Path(model)
    return p.resolve().name if p.is_dir() else model


def weights_identity(
    model: str,
    seed: int,
    weight_dtype: str = "bf16",
    batch_invariant: bool = False,
    draft_adapter: str | None = None,
) -> str:
    """What distinguishes one set of weights from another under the same model name: the seed
    of a preset's random weights, or the safetensors headers of a directory (tensor names,
    dtypes, shapes and offsets; values are not read: ``model_revision`` names those), and
    ";weights=fp8" when the FP8-stored linears compute in FP8 (``weight_dtype``), whose KV
    differs from the dequantized model's, and ";arith=batch_invariant" in the batch-invariant
    mode (``EngineConfig.batch_invariant``), whose bits differ from the default mode's: a
    resumed request of that mode must load only what that mode computed; ";draft=" and a hash
    of the file's bytes with a draft adapter (``EngineConfig.draft_adapter``: the images' draft
    rings are that draft's)."""
    p = Path(model)
    tail = _precision(weight_dtype, batch_invariant) + _draft(draft_adapter)
    if not p.is_dir():
        return f"seed={seed}" + tail
    h = xxhash.xxh3_128()
    for f in sorted(p.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(min(n, 1 << 26)))
    return "safetensors=" + h.hexdigest() + tail


def _draft(draft_adapter: str | None) -> str:
    if not draft_adapter:
        return ""
    return ";draft=" + xxhash.xxh3_64(Path(draft_adapter).read_bytes()).hexdigest()


def _precision(weight_dtype: str, batch_invariant: bool) -> str:
    fp8 = ";weights=fp8" if weight_dtype == "fp8" else ""
    return fp8 + (";arith=batch_invariant" if batch_invariant else "")


def namespace(
    *,
    model: str,
    revision: str,
    spec: StateSpec,
    weights: str = "",
    chunk_size: int,
    world_size: int,
    tp_size: int = 1,
    rank_collapse: bool = False,
) -> str:
    """The LMCache ``model_name`` every key carries: readable prefix + hash of the layout (the
    model publishes every byte-moving field of its state, drafts included, in ``spec``)."""
    fields = {
        "format": NAMESPACE_FORMAT,
        "model": model_identity(model),
        "revision": revision,
        "weights": weights,
        "layout_id": spec.layout_id,
        "block_size": spec.block_size,
        "block_bytes": spec.block_bytes,
        "state_bytes": spec.state_bytes,
        "units_per_image": spec.units_per_image,
        "chunk_size": chunk_size,
        "world_size": world_size,
        "tensor_parallel_size": tp_size,
        "rank_collapse": rank_collapse,
        "speculative_tokens": spec.speculative_tokens,
    }
    try:
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except ValueError as exc:
        raise EngineConfigError(f"namespace fields cannot be hashed stably: {exc}") from None
    digest = xxhash.xxh3_128_hexdigest(canonical.encode())[:20]
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", model_identity(model))[:48]
    return f"atom-{safe}#{digest}"
