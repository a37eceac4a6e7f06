"""Shared-prefix tree workloads with lengths around block boundaries."""

from __future__ import annotations

import random


def prefix_tree_prompts(n: int, block: int, seed: int, vocab: int = 256) -> list[list[int]]:
    """n prompts grown as a tree: each new prompt extends a random earlier prompt's prefix (or
    starts a root), with total lengths drawn from 1, B-1, B, B+1 and multiples of B (+-1)."""
    rng = random.Random(seed)
    lengths = [
        1,
        block - 1,
        block,
        block + 1,
        2 * block,
        2 * block + 1,
        3 * block - 1,
        3 * block,
        4 * block + 3,
    ]
    prompts: list[list[int]] = []
    for _ in range(n):
        length = rng.choice(lengths)
        if prompts and rng.random() < 0.75:
            parent = rng.choice(prompts)
            keep = min(len(parent), rng.choice([block, 2 * block, len(parent), length]))
            base = parent[:keep]
        else:
            base = []
        tail = [rng.randrange(vocab) for _ in range(max(0, length - len(base)))]
        prompts.append((base + tail)[:length])
    return prompts
