"""The engine config's cross-field checks: settings that are valid alone but cannot go together
(``EngineConfig``'s model validator calls ``check_combinations`` once its fields are valid).

Each refusal names the values and a fix, as a ``ValueError`` (pydantic reports it with the
config's source). Checks that need the resolved model or device are ``EngineConfig.resolved``'s.
"""

from __future__ import annotations


def check_combinations(cfg) -> None:
    """Raise ``ValueError`` for the first pair of settings of ``cfg`` (an ``EngineConfig``
    whose fields passed their own checks) that cannot go together."""
    if cfg.model_overrides:  # refused here, naming the field, not when the model builds
        from atom.models.common.config import ConfigError
        from atom.models.registry import resolve_config

        try:
            resolve_config(cfg.model, cfg.model_overrides)
        except ConfigError as exc:
            raise ValueError(f"model_overrides {cfg.model_overrides}: {exc}") from None
    if cfg.num_blocks is not None and cfg.pool_memory_gb is not None:
        raise ValueError(
            f"num_blocks={cfg.num_blocks} and pool_memory_gb={cfg.pool_memory_gb} both "
            "size the pool; set only one"
        )
    if cfg.tensor_parallel_size > 1 and cfg.batch_invariant:
        raise ValueError(
            f"tensor_parallel_size={cfg.tensor_parallel_size} with batch_invariant=true: "
            "the ranks' partial sums are reduced in an order that depends on the batch; "
            "use tensor_parallel_size=1 or batch_invariant=false"
        )
    if cfg.tp_all_reduce == "one_shot" and cfg.tensor_parallel_size > 1 and cfg.device == "cpu":
        from atom.distributed.one_shot import one_shot_refusal

        raise ValueError(one_shot_refusal(cfg.device))
    if cfg.compile_glue and cfg.batch_invariant:
        raise ValueError(
            "compile_glue=true with batch_invariant=true: inductor picks reduction "
            "strategies per shape, so a token's bits could depend on its batch; use one of "
            "them"
        )
    if cfg.draft_adapter is not None:
        from pathlib import Path

        if not Path(cfg.draft_adapter).is_file():
            raise ValueError(
                f"draft_adapter={cfg.draft_adapter!r}: no such file (an adapter that "
                "tools/train_draft_adapter.py wrote)"
            )
        if cfg.tensor_parallel_size > 1:
            raise ValueError(
                f"draft_adapter with tensor_parallel_size={cfg.tensor_parallel_size}: "
                "adapters apply to a one-rank model; use tensor_parallel_size=1"
            )
    if cfg.block_size is not None and cfg.offload == "lmcache_mp":
        cfg.lmcache.resolved_chunk(cfg.block_size)
    if cfg.offload == "lmcache_mp":
        # engine_driven saves across ranks without rank collapse are refused (rank 0 only)
        collapse = cfg.tier_collapse()
        cfg.lmcache.load_path(cfg.tensor_parallel_size, collapse)
        cfg.lmcache.save_path(cfg.tensor_parallel_size, collapse)
    if cfg.block_size is not None and cfg.max_num_batched_tokens < cfg.block_size:
        raise ValueError(
            f"max_num_batched_tokens={cfg.max_num_batched_tokens} must be >= "
            f"block_size={cfg.block_size} (prefill chunks end on the block grid)"
        )
