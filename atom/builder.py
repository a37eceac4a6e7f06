"""Build an engine from a config: resolve it, load the model, attach the tier if asked.

This is where the pieces that must not know each other meet: the engine (no model, no tier),
the model registry and the offload package.
"""

from __future__ import annotations

import logging

import torch

from atom.config import EngineConfig
from atom.engine.engine import LLMEngine
from atom.models.registry import load_runtime

log = logging.getLogger("atom")


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
    """Whether the engine replays decode graphs: ``cuda_graphs``, unless drafts are on (every
    decode forward then verifies drafts and returns residuals, so it runs eagerly; on CUDA
    that is said in a warning, as it can cost more than the drafts save)."""
    if cfg.cuda_graphs and cfg.speculative_tokens and str(cfg.device).startswith("cuda"):
        log.warning(
            "speculative_tokens=%d: decode runs eagerly (verify and draft forwards have no CUDA "
            "graphs yet), which on a launch-bound GPU model can cost more than the drafts save "
            "(README, speculative decoding); speculative_tokens: 0 keeps decode graphs",
            cfg.speculative_tokens,
        )
    return bool(cfg.cuda_graphs and not cfg.speculative_tokens)


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
