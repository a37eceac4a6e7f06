"""Build an engine from a config: resolve it, load the model, attach the tier if asked.

This is where the pieces that must not know each other meet: the engine (no model, no tier),
the model registry and the tier package (atom.tier); the ranks and the tier's per-rank ops.
"""

from __future__ import annotations

import logging

import torch

from atom import kernels
from atom.config import EngineConfig
from atom.engine.engine import LLMEngine
from atom.kernels import invariant
from atom.model_api import RuntimeCapabilities
from atom.models.common import glue_compile
from atom.models.common.moe import configure_grouped_mm
from atom.models.registry import load_runtime

log = logging.getLogger("atom.engine")


def build_engine(config: EngineConfig, attach_tier=None) -> LLMEngine:
    """An engine for ``config``; ``attach_tier`` overrides the tier the config asks for
    (tests attach fakes through it)."""
    cfg = config.resolved()
    torch.manual_seed(cfg.seed)
    kernels.configure(cfg.triton_kernels, cfg.triton_off, cfg.triton_on)
    configure_grouped_mm(cfg.moe_grouped_mm)
    invariant.configure(cfg.batch_invariant)
    glue_compile.configure(cfg.compile_glue)
    if cfg.batch_invariant:
        log.info(
            "batch-invariant mode: fixed-configuration GEMMs (row-tiled on CPU), a sync-free "
            "grouped MoE on CUDA (per-expert loop on CPU), chunked attention, ordered sums, only "
            "row-local Triton kernels (a request's bits do not depend on its batch or chunking)"
        )
    attach = attach_tier
    if attach is None and cfg.offload == "lmcache_mp":
        attach = _lmcache_tier(cfg)
    if cfg.tensor_parallel_size > 1:
        from atom.distributed.ranks import start_ranks
        from atom.tier.worker_side.rank_tier import RankTierOps

        # each rank makes the tier's ops rank 0 sends (a tier attached here, or by
        # ``attach_tier``), and with graphs captures and replays its own (CUDA only)
        ranks = start_ranks(cfg, rank_ops=RankTierOps)
        if decode_graphs_wanted(cfg):
            ranks.enable_decode_graphs(cfg.max_num_seqs, cfg.max_model_len)
        return LLMEngine(cfg, ranks, attach)
    runtime = load_runtime(
        cfg.model,
        dtype=getattr(torch, cfg.dtype),
        kv_dtype=cfg.kv_dtype,
        index_dtype=cfg.index_dtype,
        block_size=cfg.block_size,
        device=cfg.device,
        seed=cfg.seed,
        speculative_tokens=cfg.speculative_tokens,
        weight_dtype=cfg.weight_dtype,
        model_overrides=cfg.model_overrides,
        draft_adapter=cfg.draft_adapter,
    )
    graphs = decode_graphs_wanted(cfg)
    enable_graphs = RuntimeCapabilities.of(runtime).enable_decode_graphs
    if graphs and enable_graphs is not None:
        enable_graphs(cfg.max_num_seqs, cfg.max_model_len)  # CUDA only
    return LLMEngine(cfg, runtime, attach)


def decode_graphs_wanted(cfg: EngineConfig) -> bool:
    """Whether the engine replays CUDA graphs for decode forwards (``cuda_graphs``; with
    drafts, for the verify and draft forwards too: ``span_graphs``). In the batch-invariant
    mode only where its sync-free MoE runs (the fixed-configuration Triton kernel: Triton must
    import; elsewhere its per-expert loop reads expert counts on the host); with drafts too
    (replays equal eager runs bit for bit: tests/gpu/test_batch_invariant_cuda.py). A capture
    that meets a host sync anyway (quantized experts run the loop) fails, is logged, and that
    bucket runs eagerly."""
    if not cfg.cuda_graphs:
        return False
    if cfg.batch_invariant:
        from atom.kernels import triton_importable

        return triton_importable()
    return True


def _lmcache_tier(cfg: EngineConfig):
    """The attach hook of the LMCache MP tier (on every rank of a tensor-parallel engine)."""
    from atom.tier.attach import LMCacheTier

    def attach(engine: LLMEngine) -> LMCacheTier:
        rank_channels = RuntimeCapabilities.of(engine.runtime).rank_channels
        return LMCacheTier(
            config=cfg.lmcache,
            model=cfg.model,
            seed=cfg.seed,
            spec=engine.spec,
            block_size=cfg.block_size,
            store=engine.store,
            pool_tensor=engine.runner.pool,
            device=cfg.device,
            metrics=engine.metrics,
            notify_progress=engine.notify_progress,
            ranks=rank_channels() if rank_channels is not None else None,
            weight_dtype=cfg.weight_dtype,
            batch_invariant=cfg.batch_invariant,
            draft_adapter=cfg.draft_adapter,
        )

    return attach
