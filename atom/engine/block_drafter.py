"""Proposals from a block drafter (``atom.model_api.BlockDraftRuntime``: DeepSeek-V4.1's
DSpark), the engine side.

After each target forward, every sequence's committed span [start, end) of the step goes into
the drafter's state (its windows of target hidden: a function of committed positions only, so
a rejected draft leaves nothing behind and nothing to rewind); then each sequence that
continues gets one block draft from its last committed position, whose first ``want`` tokens
are its proposals. The drafter proposes at most ``draft_block_size`` tokens per step, so
``speculative_tokens`` may not exceed it (refused when the engine is built).
"""

from __future__ import annotations

import torch

from atom.engine.drafter import DraftItem
from atom.model_api import Span


class BlockDrafter:
    def __init__(self, runtime, speculative_tokens: int, block_size: int):
        if block_size < 1:
            raise ValueError("speculative decoding needs a runtime with a block drafter")
        if speculative_tokens > block_size:
            raise ValueError(
                f"speculative_tokens={speculative_tokens} exceeds the model's DSpark block "
                f"(dspark_block_size={block_size}: one draft proposes that many tokens); use "
                f"speculative_tokens <= {block_size}"
            )
        self.runtime, self.k, self.block_size = runtime, speculative_tokens, block_size
        self._no_blocks = torch.empty(0, dtype=torch.int64)

    def propose(self, items: list[DraftItem]) -> dict[int, list[int]]:
        """Fill the drafter's state with every item's committed span, then draft for the items
        that want proposals; returns their proposals by seq_id (``want`` of them)."""
        filled = [it for it in items if it.end > it.start]
        if filled:
            spans = [Span(it.start, it.end, it.seq.slot, self._no_blocks) for it in filled]
            residual = torch.cat([it.residual for it in filled])
            self.runtime.fill_draft_windows(residual, spans)
        wanting = [it for it in items if it.want > 0]
        if not wanting:
            return {}
        # the token at each item's end was sampled from its last committed position
        drafted = self.runtime.draft_blocks(
            [it.seq.tokens[it.end] for it in wanting],
            [it.end - 1 for it in wanting],
            [it.seq.slot for it in wanting],
        )
        return {it.seq.seq_id: ids[: it.want] for it, ids in zip(wanting, drafted)}
