"""The seed workload: prompts that share one of a few long prefixes, each with a unique tail."""

from __future__ import annotations

import random
import statistics
from collections import Counter

from atom.outputs import RequestOutput


def shared_prefix_prompts(
    num_requests: int,
    num_prefixes: int,
    prefix_len: int,
    tail_len: int,
    seed: int = 0,
    vocab: int = 256,
) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [
        prefixes[i % num_prefixes] + [rng.randrange(vocab) for _ in range(tail_len)]
        for i in range(num_requests)
    ]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def summarize(outs: list[RequestOutput], wall_s: float, itls: list[float] | None = None) -> dict:
    ttft = [o.ttft_s for o in outs if o.ttft_s is not None]
    prompt = sum(o.prompt_tokens for o in outs)
    res = {
        "requests": len(outs),
        "wall_s": round(wall_s, 3),
        "req_per_s": round(len(outs) / wall_s, 4),
        "ttft_p50_ms": round(1000 * pct(ttft, 50), 1),
        "ttft_mean_ms": round(1000 * statistics.fmean(ttft), 1),
        "prompt_tokens": prompt,
        "hbm_hit_tokens": sum(o.hbm_hit_tokens for o in outs),
        "tier_hit_tokens": sum(o.tier_hit_tokens for o in outs),
        "computed_prompt_tokens": sum(o.computed_prompt_tokens for o in outs),
        "output_tokens": sum(len(o.token_ids) for o in outs),
        "preemptions": sum(o.preemptions for o in outs),
        "tier_tokens_recomputed": sum(o.tier_tokens_recomputed for o in outs),
        # each request in prompt order: "hbm/tier/computed"
        "by_request": [
            f"{o.hbm_hit_tokens}/{o.tier_hit_tokens}/{o.computed_prompt_tokens}" for o in outs
        ],
        # requests by where their prompt came from: "hbm/tier/computed" -> count
        "sources": dict(
            Counter(
                f"{o.hbm_hit_tokens}/{o.tier_hit_tokens}/{o.computed_prompt_tokens}" for o in outs
            ).most_common()
        ),
    }
    if itls:
        res["itl_p50_ms"] = round(1000 * pct(itls, 50), 2)
        res["itl_mean_ms"] = round(1000 * statistics.fmean(itls), 2)
    return res
