"""The engine config: one pydantic model, from keyword arguments or a YAML file.

Every error names the field, the bad value and what is allowed. ``resolved()`` fills the
``auto`` fields from the model and the device so ``--print-config`` shows what will run.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from atom.config_cross import check_combinations
from atom.config_errors import EngineConfigError, format_validation_error
from atom.kv_events.config import KVEventsConfig
from atom.tier.config import OffloadConfig

__all__ = ["EngineConfig", "EngineConfigError", "OffloadConfig"]


# the strings pydantic reads as a bool
_BOOL_WORDS = frozenset({"0", "1", "true", "false", "t", "f", "yes", "no", "y", "n", "on", "off"})


class EngineConfig(BaseModel):
    # protected_namespaces: the field model_overrides starts with pydantic's "model_"
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    model: str = "v41-mini"
    # fields of the model's config (a preset's, or the checkpoint's config.json) replaced
    # before it is validated, as vLLM's hf_overrides: e.g. {"num_hidden_layers": 4} for a
    # shorter random-weight preset. They enter the layout id (and so the tier's namespace);
    # a checkpoint's weights must still fit the overridden shapes. A JSON string is read too
    model_overrides: dict[str, Any] = {}
    block_size: int | None = None  # None: the model preset's block size (256 for real shapes)
    num_blocks: int | None = None  # the PAGE pool as a block count ...
    pool_memory_gb: float | None = None  # ... or as a memory budget (default 1 GiB)
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    checkpoint_interval: int = 1  # prefill chunks never cross this many blocks
    enable_prefix_caching: bool = True  # False: no local hits (and no images without a tier)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    kv_dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    index_dtype: Literal["auto", "fp8", "bf16", "fp32"] = "auto"
    # the linear weights a checkpoint stores as FP8 (block-scaled E4M3): fp8 keeps them so and
    # computes FP8 GEMMs (inputs quantized per block), bf16 dequantizes them to ``dtype`` at
    # load, auto is as stored on a GPU (fp8 where the model's quantization_config says fp8,
    # with or without tensor parallelism: the ranks split the FP8 weights and FP4 experts
    # with their scales) and bf16 on CPU (the dequantized reference path). fp8 on a
    # checkpoint stored unquantized quantizes its linears at load (online quantization)
    weight_dtype: Literal["auto", "bf16", "fp8"] = "auto"
    seed: int = 0
    # decode steps replay CUDA graphs captured per batch size (CUDA only; a runtime without
    # them ignores it); False runs every forward eagerly, for debugging
    cuda_graphs: bool = True
    # the Triton kernels (CUDA only; atom/kernels): False runs the torch expression of every
    # one; triton_off names kernels to turn off, triton_on the opt-in ones to turn on
    # (none at present: atom.kernels.OPT_IN); a comma-separated string is a list
    triton_kernels: bool = True
    triton_off: list[str] = []
    triton_on: list[str] = []
    # the MoE's routed experts as grouped GEMMs (torch._grouped_mm: CUDA bf16, sm90+; no host
    # sync); False runs the per-expert loop there (one host sync per layer). Same math, other
    # roundings in bf16 (atom/models/common/moe.py)
    moe_grouped_mm: bool = True
    # batch-invariant arithmetic (atom/kernels/invariant.py): each token's logits and KV bytes
    # depend only on its own tokens, not on the other requests of its batch nor on how its
    # prompt was chunked, so a tier-resumed request computes bit for bit what recomputation
    # computes. Costs speed (row-tiled GEMMs, the per-expert MoE, no Triton kernels); one rank
    # only. Its tier objects are kept apart from the default mode's (other bits)
    batch_invariant: bool = False
    # compiled glue (atom/models/common/glue_compile.py): inside captured decode and span
    # graphs (CUDA) the small functions between a layer's GEMMs run through torch.compile, so
    # a graph replays fused kernels; compiled once at start (a progress line in the log).
    # Other roundings in bf16; not with batch_invariant. Off by default (experimental)
    compile_glue: bool = False
    # speculative decoding with the model's own drafter (draft layers, or DSpark stages):
    # drafts verified per decode step
    # (0 = off; up to 5). The state gains rows for them, so it is part of the tier namespace
    speculative_tokens: int = 0
    # a trained draft layer kept as a small file (tools/train_draft_adapter.py): the draft
    # layer is made a copy of the target's last layer plus the file's low-rank deltas and small
    # tensors, without shipping the layer (None: the model's own draft layer)
    draft_adapter: str | None = None
    # tensor parallelism: ranks (one process each; this one is rank 0) the model is split over
    tensor_parallel_size: int = 1
    # seconds every rank has to join the group at start (and to connect for the first
    # collective); a rank that exits before fails the start at once, naming the cause
    tensor_parallel_start_timeout_s: float = 30.0
    # how the ranks sum a forward's partial outputs: "group" (NCCL on CUDA, gloo on CPU) or
    # "one_shot" (CUDA only, opt-in: small ones in one kernel, atom/distributed/one_shot.py)
    tp_all_reduce: Literal["group", "one_shot"] = "group"
    offload: Literal["none", "lmcache_mp"] = "none"
    lmcache: OffloadConfig = OffloadConfig()  # the tier's settings (with offload=lmcache_mp)
    # publish HBM prefix-cache events in vLLM's format on ZMQ (None: off); docs/SCALING.md
    kv_events: KVEventsConfig | None = None

    @field_validator(
        "max_num_seqs", "max_num_batched_tokens", "checkpoint_interval", "tensor_parallel_size"
    )
    @classmethod
    def _positive(cls, v: int, info) -> int:
        if v < 1:
            raise ValueError(f"must be >= 1, got {v}")
        return v

    @field_validator(
        "triton_kernels", "moe_grouped_mm", "batch_invariant", "compile_glue", mode="before"
    )
    @classmethod
    def _switch(cls, v: Any) -> Any:
        # what pydantic reads as a bool passes on; anything else is told what to write
        if isinstance(v, bool) or (isinstance(v, (int, float)) and v in (0, 1)):
            return v
        if isinstance(v, str) and v.lower() in _BOOL_WORDS:
            return v
        raise ValueError("use true or false")

    @field_validator("triton_off", "triton_on", mode="before")
    @classmethod
    def _kernel_names(cls, v: Any) -> list[str]:
        from atom.kernels import KERNELS

        names = [n.strip() for n in v.split(",") if n.strip()] if isinstance(v, str) else v
        unknown = sorted(set(names) - KERNELS) if isinstance(names, list) else None
        if unknown:
            raise ValueError(f"unknown kernels {unknown}; allowed: {', '.join(sorted(KERNELS))}")
        return names

    @field_validator("model_overrides", mode="before")
    @classmethod
    def _overrides(cls, v: Any) -> Any:
        if isinstance(v, str):  # the command line's --model-overrides JSON
            try:
                v = json.loads(v) if v.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"not valid JSON ({exc}); write an object, e.g. '{{\"num_hidden_layers\": 4}}'"
                ) from None
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise ValueError(f"must be a mapping of model config fields, got {type(v).__name__}")
        return v

    @field_validator("speculative_tokens")
    @classmethod
    def _drafts(cls, v: int) -> int:
        if not 0 <= v <= 5:
            raise ValueError(f"must be in [0, 5] (0 turns speculative decoding off), got {v}")
        return v

    @field_validator("num_blocks", "block_size", "max_model_len")
    @classmethod
    def _positive_or_none(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"must be >= 1 (or omitted), got {v}")
        return v

    @field_validator("tensor_parallel_start_timeout_s")
    @classmethod
    def _seconds(cls, v: float) -> float:
        if not (v > 0 and v < float("inf")):
            raise ValueError(f"must be a positive number of seconds, got {v}")
        return v

    @field_validator("pool_memory_gb")
    @classmethod
    def _memory(cls, v: float | None) -> float | None:
        if v is not None and not v > 0:
            raise ValueError(f"must be > 0 GiB (or omitted), got {v}")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit()):
            return v
        raise ValueError("allowed: auto, cpu, cuda, cuda:N")

    @model_validator(mode="after")
    def _cross(self) -> EngineConfig:
        check_combinations(self)  # settings that cannot go together (atom/config_cross.py)
        return self

    def tier_collapse(self) -> bool:
        """Whether the tier's ranks share one stored copy (``OffloadConfig.rank_collapse``;
        the split models' tier bytes are the same on every rank)."""
        if self.tensor_parallel_size == 1:
            return False
        from atom.distributed.split_models import TIER_BYTES_REPLICATED

        return self.lmcache.rank_collapse(self.tensor_parallel_size, TIER_BYTES_REPLICATED)

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def build(cls, source: str = "engine config", **values: Any) -> EngineConfig:
        try:
            return cls(**values)
        except ValidationError as exc:
            raise EngineConfigError(format_validation_error(exc, source)) from None

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> EngineConfig:
        """Load a YAML file; ``overrides`` (e.g. command-line flags) win over the file."""
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except FileNotFoundError:
            raise EngineConfigError(f"engine config file not found: {path}") from None
        except yaml.YAMLError as exc:
            raise EngineConfigError(f"{path} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise EngineConfigError(f"{path} must hold a mapping of fields, got {type(data)}")
        return cls.build(source=f"engine config {path}", **{**data, **overrides})

    # ---- resolution ---------------------------------------------------------------------

    def resolve_model(self) -> tuple[Any, Path | None]:
        """(the model's config with ``model_overrides`` applied, its checkpoint directory or
        None for a preset): what every rank builds."""
        from atom.models.registry import resolve_config

        return resolve_config(self.model, self.model_overrides)

    def resolved(self) -> EngineConfig:
        """A copy with every ``auto``/None field decided (device, dtypes, block and pool size,
        max_model_len), as the engine will run it."""
        import torch

        from atom.models.common.fp8_linear import stored_fp8
        from atom.models.common.geometry import GeometryError
        from atom.models.registry import default_block_size, pool_geometry

        model_cfg, _ = self.resolve_model()
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise EngineConfigError(f"device={device!r}: CUDA is not available; use device=cpu")
        on_gpu = device.startswith("cuda")
        dtype = self.dtype if self.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
        kv = (
            self.kv_dtype
            if self.kv_dtype != "auto"
            else ("bf16" if dtype == "bfloat16" else "fp32")
        )
        block = self.block_size or default_block_size(self.model)
        index = self.index_dtype
        if index == "auto":
            index = "fp8" if on_gpu else kv
        drafts = self.speculative_tokens
        block_drafts = getattr(model_cfg, "dspark_block_size", 0) * bool(
            getattr(model_cfg, "dspark_stages", 0)
        )
        if drafts and not (getattr(model_cfg, "num_nextn_predict_layers", 0) or block_drafts):
            raise EngineConfigError(
                f"speculative_tokens={drafts}: model {self.model!r} has no drafter (no draft "
                "layers, num_nextn_predict_layers=0, and no DSpark stages); use a model with "
                "one (e.g. v41-tiny-draft, v41-tiny-dspark) or speculative_tokens=0"
            )
        if self.draft_adapter:
            from atom.models.registry import family

            if not family(model_cfg).draft_adapter:
                raise EngineConfigError(
                    f"draft_adapter={self.draft_adapter!r}: model {self.model!r} is a "
                    f"{model_cfg.model_type} model, whose family has no draft adapters "
                    "(deepseek_v41 has)"
                )
            if not getattr(model_cfg, "num_nextn_predict_layers", 0):
                raise EngineConfigError(
                    f"draft_adapter={self.draft_adapter!r}: model {self.model!r} has no draft "
                    "layer to adapt (num_nextn_predict_layers=0); use a model with one (e.g. "
                    "v41-bench-draft)"
                )
        if block_drafts and drafts > block_drafts:
            raise EngineConfigError(
                f"speculative_tokens={drafts}: model {self.model!r} drafts with DSpark, whose "
                f"block proposes {block_drafts} tokens (dspark_block_size); use "
                f"speculative_tokens <= {block_drafts}"
            )
        geometry = partial(
            pool_geometry, model_cfg, kv_dtype=kv, block_size=block, speculative_tokens=drafts
        )
        try:
            geo = geometry(index_dtype=index)
        except GeometryError as exc:
            if self.index_dtype != "auto":
                raise EngineConfigError(f"index_dtype={index!r}: {exc}") from None
            index = kv
            try:
                geo = geometry(index_dtype=index)
            except GeometryError as exc2:
                raise EngineConfigError(f"block_size={block}: {exc2}") from None
        num_blocks = self.num_blocks
        if num_blocks is None:
            budget = (self.pool_memory_gb or 1.0) * 2**30
            num_blocks = int(budget // geo.block_bytes)
        units = geo.units_per_image
        if num_blocks < 2 + units:
            raise EngineConfigError(
                f"num_blocks={num_blocks}: the pool needs at least {2 + units} blocks of "
                f"{geo.block_bytes} B (one image takes {units}); raise num_blocks or "
                "pool_memory_gb"
            )
        max_len = min(
            self.max_model_len or model_cfg.max_position_embeddings,
            model_cfg.max_position_embeddings,
        )
        weights = self.weight_dtype
        if weights == "auto":  # the same at any tensor_parallel_size: ranks split FP8 and FP4
            weights = "fp8" if stored_fp8(model_cfg) and on_gpu else "bf16"
        if self.max_num_batched_tokens < block:
            raise EngineConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"block_size={block} (prefill chunks end on the block grid)"
            )
        lmcache = self.lmcache
        if self.offload == "lmcache_mp":
            try:
                self.lmcache.resolved_chunk(block)
            except ValueError as exc:
                raise EngineConfigError(str(exc)) from None
            # auto decided: loads engine_driven (on one rank and across ranks, with rank
            # collapse or without); saves engine_driven on one rank or with rank collapse
            collapse = self.tier_collapse()
            load_mode, _ = lmcache.load_path(self.tensor_parallel_size, collapse)
            save_mode, _ = lmcache.save_path(self.tensor_parallel_size, collapse)
            lmcache = lmcache.model_copy(update=dict(load_mode=load_mode, save_mode=save_mode))
        return self.model_copy(
            update=dict(
                device=device,
                dtype=dtype,
                kv_dtype=kv,
                index_dtype=index,
                weight_dtype=weights,
                block_size=block,
                num_blocks=num_blocks,
                pool_memory_gb=None,
                max_model_len=max_len,
                lmcache=lmcache,
            )
        )
