"""DeepSeek-V4 through the tier, with the real LMCache server: pass 1 fills the tier, a fresh
engine with an empty pool replays the prompts and resumes from the tier with identical outputs.
Nothing in the tier or the engine knows the model: it publishes a StateSpec like V4.1."""

from __future__ import annotations

from atom import SamplingParams
from atom.tier.config import namespace

from .conftest import BLOCK
from .test_two_pass import ceiling, prompts_of, record_logits, tier

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
V4 = "v4-tiny"


def test_v4_two_pass_resumes_from_tier_with_identical_outputs(lmcache_server, make_llm):
    prompts = prompts_of([40, 77, 16, 129, 63, 64], seed=5)
    first = make_llm(V4, **tier(lmcache_server))
    out1 = first.generate(prompts, GREEDY, on_step=lambda e: e.check_integrity())
    first.shutdown()  # stores drain before it returns
    second = make_llm(V4, **tier(lmcache_server))
    out2 = second.generate(prompts, GREEDY, on_step=lambda e: e.check_integrity())
    for p, a, b in zip(prompts, out1, out2):
        assert a.token_ids == b.token_ids
        assert b.hbm_hit_tokens == 0
        assert b.tier_hit_tokens == ceiling(len(p)), (len(p), b.tier_hit_tokens)
        assert b.tier_hit_tokens + b.computed_prompt_tokens == len(p)


def test_v4_request_alone_resumed_from_tier_is_bit_identical(lmcache_server, make_llm):
    prompt = prompts_of([5 * BLOCK + 7], seed=6)[0]
    one = dict(max_num_seqs=1, max_num_batched_tokens=BLOCK)  # the same chunking both times
    first = make_llm(V4, **tier(lmcache_server), **one)
    logits1 = record_logits(first)
    out1 = first.generate([prompt], GREEDY)[0]
    first.shutdown()
    second = make_llm(V4, **tier(lmcache_server), **one)
    logits2 = record_logits(second)
    out2 = second.generate([prompt], GREEDY)[0]
    assert out2.tier_hit_tokens == 5 * BLOCK and out2.computed_prompt_tokens == 7
    assert out1.token_ids == out2.token_ids
    n = len(logits2)
    assert n == GREEDY.max_tokens  # the 7-token tail, then the decode steps
    for a, b in zip(logits1[-n:], logits2):
        assert (a == b).all()


def test_v4_and_v41_never_share_tier_objects(lmcache_server, make_llm):
    """Same prompts, same server: V4.1 finds nothing V4 stored (the namespace hashes the
    layout id), and the two namespaces differ."""
    prompts = prompts_of([3 * BLOCK + 1], seed=7)
    v4 = make_llm(V4, **tier(lmcache_server))
    v4.generate(prompts, GREEDY)
    v4.shutdown()
    v41 = make_llm("v41-tiny", **tier(lmcache_server))
    out = v41.generate(prompts, GREEDY)[0]
    assert out.tier_hit_tokens == 0
    kw = dict(model="m", revision="", chunk_size=BLOCK, world_size=1)
    spec4, spec41 = v4.engine.spec, v41.engine.spec
    assert namespace(spec=spec4, **kw) != namespace(spec=spec41, **kw)
