"""Build an engine from a config: resolve it, load the model, attach the tier if asked.

This is where the pieces that must not know each other meet: the engine (no model, no tier),
the model registry and the offload package.
"""

from __future__ import annotations

import torch

from atom.config import EngineConfig
from atom.engine.engine import LLMEngine
from atom.models.registry import load_runtime


def build_engine(config: EngineConfig, attach_tier=None) -> LLMEngine:
    """An engine for ``config``; ``attach_tier`` overrides the tier the config asks for
    (tests attach fakes through it)."""
    cfg = config.resolved()
    torch.manual_seed(cfg.seed)
    attach = attach_tier
    if attach is None and cfg.offload == "lmcache_mp":
        attach = _lmcache_tier(cfg)
    if cfg.tensor_parallel_size > 1:
        from atom.distributed.ranks import start_ranks

        # every rank runs every forward eagerly (no decode graphs across ranks yet)
        return LLMEngine(cfg, start_ranks(cfg), attach)
    runtime = load_runtime(
        cfg.model,
        dtype=getattr(torch, cfg.dtype),
        kv_dtype=cfg.kv_dtype,
        index_dtype=cfg.index_dtype,
        block_size=cfg.block_size,
        device=cfg.device,
        seed=cfg.seed,
        speculative_tokens=cfg.speculative_tokens,
    )
    graphs = decode_graphs_wanted(cfg)
    if graphs and hasattr(runtime, "enable_decode_graphs"):
        runtime.enable_decode_graphs(cfg.max_num_seqs, cfg.max_model_len)  # CUDA only
    return LLMEngine(cfg, runtime, attach)


def decode_graphs_wanted(cfg: EngineConfig) -> bool:
    """Whether the engine replays CUDA graphs for decode forwards (``cuda_graphs``; with
    drafts, for the verify and draft forwards too: ``span_graphs``)."""
    return bool(cfg.cuda_graphs)


def _lmcache_tier(cfg: EngineConfig):
    """The attach hook of the LMCache MP tier (on every rank of a tensor-parallel engine)."""
    from atom.kv_transfer.offload.attach import LMCacheTier

    def attach(engine: LLMEngine) -> LMCacheTier:
        tier_ranks = getattr(engine.runtime, "tier_ranks", None)
        return LMCacheTier(
            config=cfg.lmcache,
            model=cfg.model,
            seed=cfg.seed,
            spec=engine.spec,
            block_size=cfg.block_size,
            pool=engine.pool,
            store=engine.store,
            pool_tensor=engine.runner.pool,
            device=cfg.device,
            metrics=engine.metrics,
            notify_progress=engine.notify_progress,
            ranks=tier_ranks() if tier_ranks is not None else None,
        )

    return attach
