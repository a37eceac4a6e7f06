"""Sampling: greedy, or temperature with top-k / top-p, repeatable per request with a seed."""

from __future__ import annotations

import torch

from atom.engine.sequence import Sequence


class Sampler:
    def __init__(self, seed: int):
        self.seed = seed
        self._gens: dict[int, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits float32 [len(seqs), V] -> one token per sequence."""
        logits = logits.float().cpu()
        out = logits.argmax(-1).tolist()
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.greedy:
                continue
            row = logits[i] / p.temperature
            if p.top_k:
                kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            probs = torch.softmax(row, -1)
            if p.top_p < 1.0:
                sorted_p, order = torch.sort(probs, descending=True)
                keep = torch.cumsum(sorted_p, 0) - sorted_p < p.top_p
                mask = torch.zeros_like(probs, dtype=torch.bool)
                mask[order[keep]] = True
                probs = torch.where(mask, probs, torch.zeros_like(probs))
                probs = probs / probs.sum()
            out[i] = int(torch.multinomial(probs, 1, generator=self._gen(seq)))
        return out

    def _gen(self, seq: Sequence) -> torch.Generator:
        gen = self._gens.get(seq.seq_id)
        if gen is None:
            seed = seq.params.seed if seq.params.seed is not None else self.seed + seq.seq_id
            gen = self._gens[seq.seq_id] = torch.Generator().manual_seed(seed)
        return gen

    def forget(self, seq: Sequence) -> None:
        self._gens.pop(seq.seq_id, None)
