"""A paged-forward harness: one pool, some state slots, and chunk schedules to run."""

from __future__ import annotations

import torch

from atom.model_api import Span
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.runtime import V41Runtime


class Harness:
    def __init__(
        self,
        model: DeepseekV41ForCausalLM,
        block_size: int,
        num_blocks: int = 96,
        num_slots: int = 6,
    ):
        self.rt = V41Runtime(model, block_size=block_size)
        spec = self.rt.spec
        self.pool = torch.zeros(spec.pool_shape(num_blocks), dtype=spec.pool_dtype)
        self.slot_bytes = torch.zeros(num_slots, spec.state_bytes, dtype=torch.uint8)
        self.rt.bind(self.pool, self.slot_bytes)
        self.block_size = block_size
        self._next_block = 0

    def blocks(self, n: int) -> torch.Tensor:
        ids = torch.arange(self._next_block, self._next_block + n)
        self._next_block += n
        return ids

    def step(self, work: list[tuple[list[int], int, int, int, torch.Tensor]]) -> torch.Tensor:
        """work: (all token ids of the sequence, start, end, slot, block table) per sequence;
        returns last-token logits [len(work), V]."""
        ids = torch.cat([torch.as_tensor(t[s:e]) for t, s, e, _, _ in work])
        spans = [Span(s, e, slot, table) for _, s, e, slot, table in work]
        return self.rt.forward(ids, spans)

    def run_chunks(self, tokens, bounds, slot, table, all_logits=False) -> torch.Tensor:
        """Run one sequence through consecutive chunks ending at ``bounds``."""
        outs, start = [], 0
        for end in bounds:
            ids = torch.as_tensor(tokens[start:end])
            span = Span(start, end, slot, table)
            outs.append(
                self.rt.model.forward_paged(ids, [span], self.rt.kv, self.rt.slots, all_logits)
            )
            start = end
        return torch.cat(outs)


def prefill_then_decode(
    model: DeepseekV41ForCausalLM, seqs: list[list[int]], prefill: int = 5, steps: int = 3
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence i prefilled to ``prefill + i`` tokens (one forward for all), then ``steps``
    decode forwards of one token each for every sequence, in a fresh pool of two blocks a
    sequence (block size 32). Returns (the pool's bytes, the decode steps' logits [steps,
    len(seqs), V]): what a kernel's on/off comparison checks."""
    h = Harness(model, block_size=32, num_slots=len(seqs) + 1)
    tables = [h.blocks(2) for _ in seqs]
    h.step([(s, 0, prefill + i, 1 + i, tables[i]) for i, s in enumerate(seqs)])
    logits = [
        h.step([(s, p + i, p + i + 1, 1 + i, tables[i]) for i, s in enumerate(seqs)])
        for p in range(prefill, prefill + steps)
    ]
    return h.pool.clone(), torch.stack(logits)
