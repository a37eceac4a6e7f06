"""Two passes against the real LMCache server: pass 1 fills the tier, a fresh engine with an
empty pool replays the prompts and must resume from the tier with identical outputs."""

from __future__ import annotations

import torch

from atom import SamplingParams
from atom.tier.server.lmcache_server import probe

from .conftest import BLOCK

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def ceiling(n: int, interval_blocks: int = 1) -> int:
    """The largest stored image boundary a prompt of n tokens can resume from."""
    step = BLOCK * interval_blocks
    return (n - 1) // step * step


def tier(server, **extra):
    return dict(offload="lmcache_mp", lmcache={"url": server.url, **extra})


def record_logits(llm):
    """Wrap the runtime's forward to keep every step's logits (float32, exact)."""
    seen = []
    rt = llm.engine.runtime
    inner = rt.forward

    def forward(ids, spans):
        out = inner(ids, spans)
        seen.append(out.clone())
        return out

    rt.forward = forward
    return seen


def test_two_pass_resumes_from_tier_with_identical_outputs(lmcache_server, make_llm):
    prompts = prompts_of([40, 77, 100, 129, 16, 200, 63, 64])
    first = make_llm(**tier(lmcache_server))
    out1 = first.generate(prompts, GREEDY, on_step=lambda e: e.check_integrity())
    first.shutdown()  # stores drain before it returns
    second = make_llm(**tier(lmcache_server))
    out2 = second.generate(prompts, GREEDY, on_step=lambda e: e.check_integrity())
    got = sum(o.tier_hit_tokens for o in out2)
    ceil = sum(ceiling(len(p)) for p in prompts)
    assert got >= 0.99 * ceil, f"tier hit {got} of ceiling {ceil}"
    for p, a, b in zip(prompts, out1, out2):
        assert a.token_ids == b.token_ids
        assert b.hbm_hit_tokens == 0 and b.computed_prompt_tokens >= 1
        assert b.tier_hit_tokens + b.computed_prompt_tokens == len(p)


def test_request_alone_resumed_from_tier_is_bit_identical(lmcache_server, make_llm):
    prompt = prompts_of([5 * BLOCK + 7], seed=3)[0]
    one = dict(max_num_seqs=1, max_num_batched_tokens=BLOCK)  # the same chunking both times
    first = make_llm(**tier(lmcache_server), **one)
    logits1 = record_logits(first)
    out1 = first.generate([prompt], GREEDY)[0]
    first.shutdown()
    second = make_llm(**tier(lmcache_server), **one)
    logits2 = record_logits(second)
    out2 = second.generate([prompt], GREEDY)[0]
    assert out2.tier_hit_tokens == 5 * BLOCK and out2.computed_prompt_tokens == 7
    assert out1.token_ids == out2.token_ids
    # pass 2 ran the tail chunk and the decode steps only: they match pass 1's last steps
    n = len(logits2)
    assert n == 1 + GREEDY.max_tokens - 1
    for a, b in zip(logits1[-n:], logits2):
        assert torch.equal(a, b)


def test_the_lmcache_server_fixture_is_healthy(lmcache_server):
    assert probe(lmcache_server.url, 2.0)
