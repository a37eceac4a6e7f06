"""Speculative decoding across ranks (CPU, gloo; rank 0 is this process, rank 1 a spawned one):
with each drafter the models have (V4.1's draft layers, V4.1's DSpark stages, V4's MTP block),
TP=2 with drafts gives TP=2's plain greedy tokens, accepted drafts included, in fewer steps,
and every rank ends holding the same pool and state bytes (the draft state included: the
drafters run on every rank, fed the residual rows rank 0 broadcasts)."""

from __future__ import annotations

import pytest

from atom import LLM, SamplingParams
from tests.engine.test_speculative import ScriptedDrafter, prompts_of, truth_of

KW = dict(
    block_size=16,
    num_blocks=48,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    dtype="float32",
    kv_dtype="fp32",
    index_dtype="fp32",
    device="cpu",
    tensor_parallel_size=2,
)
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("model", ["v41-tiny-draft", "v41-tiny-dspark", "v4-tiny"])
def test_tp2_drafts_give_tp2_plain_tokens_and_the_ranks_hold_the_same_bytes(model):
    prompts = prompts_of([5, 21, 40], seed=11)
    plain_llm = LLM(model, **KW)
    try:
        plain = plain_llm.generate(prompts, GREEDY)
        plain_steps = plain_llm.engine.stats()["steps"]
    finally:
        plain_llm.shutdown()
    llm = LLM(model, speculative_tokens=3, **KW)
    try:
        # the real drafter runs on every rank; its proposals are then replaced by the plain
        # run's continuation with a wrong token every 5 positions, so drafts are accepted
        llm.engine.drafter = ScriptedDrafter(
            llm.engine.drafter, truth_of(prompts, plain), lambda p: p % 5 == 0
        )
        spec = llm.generate(prompts, GREEDY, on_step=lambda e: e.check_integrity())
        stats = llm.engine.stats()
        digests = llm.engine.runtime.rank_digests()
    finally:
        llm.shutdown()
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert stats["speculative"]["acceptance_rate"] > 0.5, stats["speculative"]
    assert stats["steps"] < plain_steps
    assert len(digests) == 2 and digests[0] == digests[1], digests


def test_tp2_real_drafts_equal_plain_tokens():
    """The drafter's own proposals (rarely right with random weights): verify rejects them
    on every rank alike, and the tokens are the plain run's."""
    prompts = prompts_of([9, 33], seed=4)
    outs = []
    for k in (0, 2):
        llm = LLM("v41-tiny-draft", speculative_tokens=k, **KW)
        try:
            outs.append([o.token_ids for o in llm.generate(prompts, GREEDY)])
            if k:
                stats = llm.engine.stats()["speculative"]
                assert stats["verify_spans"] > 0 and stats["draft_tokens"] > 0, stats
                digests = llm.engine.runtime.rank_digests()
                assert digests[0] == digests[1], digests
        finally:
            llm.shutdown()
    assert outs[0] == outs[1]


def test_tp2_drafts_resume_from_one_collapsed_copy_in_the_tier():
    """Pass 2 (a fresh TP=2 engine with drafts, an empty pool) resumes every prompt from the
    tier at the ceiling, from rank 0's one copy (the images carry the draft state), and gives
    pass 1's tokens; the ranks hold the same bytes after both passes. Each rank copies the
    loads itself out of the server's shared-memory L1 (engine-driven, with rank collapse)."""
    from atom.tier.server.lmcache_server import LMCacheServer
    from tests.offload.test_engine_driven import mapped
    from tests.offload.test_two_pass import ceiling

    prompts = prompts_of([40, 77, 64], seed=8)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    server = LMCacheServer(chunk_size=KW["block_size"], l1_size_gb=0.2, shared_l1=True)
    server.start(wait=True)
    passes = []
    try:
        for _ in range(2):
            llm = LLM(
                "v41-tiny-draft",
                speculative_tokens=2,
                offload="lmcache_mp",
                lmcache={"url": server.url, "tp_rank_collapse": "true"},
                **{**KW, "num_blocks": 64},
            )
            try:
                if passes:
                    mapped(llm)  # else pass 2's hits load through the server
                outs = llm.generate(prompts, params)
                passes.append((outs, llm.engine.runtime.rank_digests()))
                ranks = llm.engine.tier.health()["tensor_parallel"]["ranks"]
            finally:
                llm.shutdown()
    finally:
        server.stop()
    (first, d1), (second, d2) = passes
    assert d1[0] == d1[1] and d2[0] == d2[1]
    assert [r["loads"]["copied"] for r in ranks] == [len(prompts)] * 2, ranks
    for p, a, b in zip(prompts, first, second):
        assert a.token_ids == b.token_ids
        assert b.tier_hit_tokens == ceiling(len(p)) > 0, (len(p), b.tier_hit_tokens)
