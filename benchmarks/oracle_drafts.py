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
    wrong token wraps (it is the right one + 1). Every draw is made here, once: a step's
    replacement is a few list lookups per request (what a step costs is what the benchmark
    measures, so the oracle's own work must stay out of it)."""

    def __init__(self, drafter, truth: dict, acceptance: float, seed: int = 0, vocab: int = 256):
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
        self.inner, self.truth, self.acceptance = drafter, truth, acceptance
        self.seed, self.vocab = seed, vocab
        self.runtime, self.k = drafter.runtime, drafter.k
        # per prompt: each position's draft token (the true one, or the true one + 1)
        self._drafts = {}
        for i, (prompt, full) in enumerate(truth.items()):
            rng = random.Random((seed * 1_000_003 + i) * 1_000_033)
            self._drafts[prompt] = [
                t if rng.random() < acceptance else (t + 1) % vocab for t in full
            ]
        self._by_seq: dict[int, list[int] | None] = {}  # seq_id -> its prompt's drafts
        if hasattr(drafter, "propose_device"):  # draft layers: greedy steps walk on the device
            self.propose_device = drafter.propose_device

    def right(self, prompt: tuple, position: int) -> bool:
        """Whether the draft at ``position`` of ``prompt``'s sequence is the true token."""
        return self._drafts[prompt][position] == self.truth[prompt][position]

    def propose(self, items):
        return self._replace(items, self.inner.propose(items))

    def finish_device(self, items, drafts, chains, accepted):
        return self._replace(items, self.inner.finish_device(items, drafts, chains, accepted))

    def _replace(self, items, out: dict) -> dict:
        """``out`` (proposals by seq_id) with each proposal replaced as the class doc says."""
        for it in items:
            if not it.want:
                continue
            sid = it.seq.seq_id
            if sid not in self._by_seq:
                self._by_seq[sid] = self._drafts.get(tuple(it.seq.prompt))
            drafts = self._by_seq[sid]
            if drafts is not None:
                n = len(it.seq.tokens)
                out[sid] = drafts[n : n + it.want]
        return out
