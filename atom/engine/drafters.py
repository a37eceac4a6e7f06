"""Which drafter a speculative engine runs: the runtime's block drafter (DSpark) or its draft
layers, or a clear error when the runtime cannot decode speculatively."""

from __future__ import annotations

from atom.config import EngineConfig
from atom.engine.block_drafter import BlockDrafter
from atom.engine.drafter import Drafter
from atom.engine.sampler import Sampler
from atom.model_api import ModelRuntime, RuntimeCapabilities, block_draft_size, draft_layers


def make_drafter(
    cfg: EngineConfig, runtime: ModelRuntime, sampler: Sampler | None = None
) -> Drafter | BlockDrafter:
    """The runtime's drafter (its DSpark block drafter, or its draft layers), or a clear error
    when it cannot decode speculatively. ``sampler`` (the engine's) samples sampling requests'
    drafts from the draft layers' q (``Drafter``); the block drafter proposes its argmax
    blocks for every request (verified as one-hot proposals)."""
    block, layers = block_draft_size(runtime), draft_layers(runtime)
    if not block and layers < 1:
        raise ValueError(
            f"speculative_tokens={cfg.speculative_tokens}: model {cfg.model!r} has no drafter "
            "(no draft layers, num_nextn_predict_layers=0, and no DSpark stages); use a model "
            "with one or speculative_tokens=0"
        )
    # verify spans re-run the target's positions after rejected drafts, whatever drafts
    if not RuntimeCapabilities.of(runtime).rewinds_on_rejection:
        raise ValueError(
            f"speculative_tokens={cfg.speculative_tokens}: model {cfg.model!r} cannot re-run "
            "positions after rejected drafts (its state has no rewind); use speculative_tokens=0"
        )
    if block:
        return BlockDrafter(runtime, cfg.speculative_tokens, block)
    return Drafter(runtime, cfg.speculative_tokens, layers, sampler)
