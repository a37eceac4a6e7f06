"""Drafts of a chosen acceptance, for measuring what speculative decoding does on a model whose
own drafter is untrained (a preset's random draft layer).

``OracleDrafter`` wraps the engine's drafter: the real draft layers still run (so every step
pays what a trained drafter's step would), then each proposal is replaced by the token greedy
decoding produces there (``truth``: the plain run's outputs) with probability ``acceptance``,
by a wrong token otherwise, decided per (prompt, position) from ``seed`` so that every run and
every k sees the same draws. Greedy outputs still equal plain decoding's (the verify rule
rejects the wrong tokens); the measured acceptance is about ``acceptance`` for the first draft
and its powers for the later ones of a chain (a draft after a rejected one is not verified).
"""

from __future__ import annotations

import random


class OracleDrafter:
    """``truth``: prompt (tuple) -> prompt + the plain run's output tokens; ``vocab``: where a
    wrong token wraps (it is the right one + 1)."""

    def __init__(self, drafter, truth: dict, acceptance: float, seed: int = 0, vocab: int = 256):
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
        self.inner, self.truth, self.acceptance = drafter, truth, acceptance
        self.seed, self.vocab = seed, vocab
        self.runtime, self.k = drafter.runtime, drafter.k
        self._index = {prompt: i for i, prompt in enumerate(truth)}
        if hasattr(drafter, "propose_device"):  # draft layers: greedy steps walk on the device
            self.propose_device = drafter.propose_device

    def right(self, prompt: tuple, position: int) -> bool:
        """Whether the draft at ``position`` of ``prompt``'s sequence is the true token."""
        key = (self.seed * 1_000_003 + self._index[prompt]) * 1_000_033 + position
        return random.Random(key).random() < self.acceptance

    def propose(self, items):
        return self._replace(items, self.inner.propose(items))

    def finish_device(self, items, drafts, chains, accepted):
        return self._replace(items, self.inner.finish_device(items, drafts, chains, accepted))

    def _replace(self, items, out: dict) -> dict:
        """``out`` (proposals by seq_id) with each proposal replaced as the class doc says."""
        for it in items:
            prompt = tuple(it.seq.prompt)
            if not it.want or prompt not in self.truth:
                continue
            full, n = self.truth[prompt], len(it.seq.tokens)
            tokens = full[n : n + it.want]
            out[it.seq.seq_id] = [
                t if self.right(prompt, n + j) else (t + 1) % self.vocab
                for j, t in enumerate(tokens)
            ]
        return out
