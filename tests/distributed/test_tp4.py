"""Four ranks (CPU, gloo; rank 0 is this process, ranks 1-3 spawned ones), both families, on
their tiny presets widened to 4 attention heads and 4 output groups through ``model_overrides``
(the presets have 2 heads, which 4 ranks cannot split):

- with graphs on every rank (the fake capture, ``EagerBackend``: replays re-run the captured
  forward, its all-reduces included), TP=4 gives one rank's greedy tokens (up to a near-tie,
  reported), replays happen, and the four ranks hold the same pool and state bytes;
- with drafts (scripted to be accepted, the model's own drafter running on every rank) and
  graphs, TP=4 gives TP=4's plain tokens in fewer steps, verify and draft graphs replayed;
- the tier at TP=4, rank collapse on and off, against a real LMCache server: pass 2 (a fresh
  engine) resumes at the ceiling on every rank and equals pass 1, every rank loads each hit,
  rank 0 alone stores with collapse and every rank without, and no read lock is left behind.
"""

from __future__ import annotations

import pytest

from atom import LLM, SamplingParams
from atom.tier.server.lmcache_server import LMCacheServer
from tests.distributed.test_tp_drafts import KW as DRAFT_KW
from tests.distributed.test_tp_graphs import patch_fake_graphs
from tests.distributed.test_tp_tier import cleared, l1_bytes
from tests.engine.test_speculative import ScriptedDrafter, prompts_of, truth_of
from tests.gpu.test_decode_graphs_cuda import assert_same_greedy
from tests.offload.test_two_pass import ceiling

WIDE = {"num_attention_heads": 4, "o_groups": 4}
KW = {**DRAFT_KW, "tensor_parallel_size": 4, "model_overrides": WIDE}
ONE_RANK = {**KW, "tensor_parallel_size": 1}
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)


def run(llm: LLM, prompts, params=GREEDY):
    """(outputs, engine stats, graph stats, rank digests), the engine shut down after."""
    try:
        outs = llm.generate(prompts, params, on_step=lambda e: e.check_integrity())
        rt = llm.engine.runtime
        graphs = rt.graph_stats() if rt.graph_stats is not None else {}
        return outs, llm.engine.stats(), graphs, rt.rank_digests()
    finally:
        llm.shutdown()


def test_four_ranks_refuse_the_preset_as_it_is_before_any_rank_starts():
    """Without the overrides the preset has 2 heads: refused naming the field."""
    with pytest.raises(Exception, match="num_attention_heads=2"):
        LLM("v41-tiny", **{**KW, "model_overrides": {}})


@pytest.mark.parametrize("model", ["v41-tiny-draft", "v4-tiny"])
def test_tp4_with_graphs_and_drafts_gives_one_ranks_tokens(model, monkeypatch):
    prompts = prompts_of([5, 21, 40, 17], seed=13)
    one = LLM(model, **ONE_RANK).generate(prompts, GREEDY)
    patch_fake_graphs(monkeypatch)
    plain, plain_stats, graphs, digests = run(LLM(model, **KW), prompts)
    # split reductions change the last bits: a token may differ only at a near-tie of one
    # rank's top two, in at most one sequence
    assert_same_greedy(plain, one, eps=1e-3, most=1)
    assert graphs["decode"]["replays"] > 0 and graphs["decode"]["failed"] == 0, graphs
    assert len(digests) == 4 and len(set(digests)) == 1, digests

    llm = LLM(model, speculative_tokens=3, **KW)
    # the drafter runs on every rank; its proposals are replaced by the plain run's
    # continuation with a wrong token every 5 positions, so drafts are accepted and rejected
    llm.engine.drafter = ScriptedDrafter(
        llm.engine.drafter, truth_of(prompts, plain), lambda p: p % 5 == 0
    )
    spec, stats, graphs, digests = run(llm, prompts)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert stats["speculative"]["acceptance_rate"] > 0.5, stats["speculative"]
    assert stats["steps"] < plain_stats["steps"]
    assert graphs["verify"]["replays"] > 0 and graphs["draft"]["replays"] > 0, graphs
    assert not any(v["failed"] for v in graphs.values()), graphs
    assert len(set(digests)) == 1, digests


TIER_PROMPTS = prompts_of([40, 77, 100, 64], seed=3)
TIER_GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


def tier_pass(server: LMCacheServer, collapse: str):
    llm = LLM(
        "v41-tiny",
        offload="lmcache_mp",
        lmcache={"url": server.url, "tp_rank_collapse": collapse},
        **{**KW, "num_blocks": 64},
    )
    try:
        return llm.generate(TIER_PROMPTS, TIER_GREEDY), llm.engine.tier.health()
    finally:
        llm.shutdown()  # every rank's saves drain before it returns


@pytest.mark.parametrize("collapse", ["true", "false"])
def test_tp4_two_pass_resumes_from_the_tier_on_every_rank(collapse):
    block = KW["block_size"]
    server = LMCacheServer(chunk_size=block, l1_size_gb=0.2, shared_l1=True)
    server.start(wait=True)
    try:
        out1, health1 = tier_pass(server, collapse)
        stored = l1_bytes(server)
        out2, health2 = tier_pass(server, collapse)
        left, frees = cleared(server)
        assert frees == 0, "a read lock was released twice"
    finally:
        server.stop()
    for p, a, b in zip(TIER_PROMPTS, out1, out2):
        assert a.token_ids == b.token_ids
        assert b.tier_hit_tokens == ceiling(len(p)), (len(p), b.tier_hit_tokens)
    ranks = health2["tensor_parallel"]["ranks"]
    assert len(ranks) == 4
    hits = sum(o.tier_hit_tokens > 0 for o in out2)
    assert [r["parts"]["load"] for r in ranks] == [hits] * 4
    assert all(r["failed"] == {"load": 0, "save": 0} for r in ranks), ranks
    assert len({r["bytes"]["load"] for r in ranks}) == 1 and ranks[0]["bytes"]["load"] > 0
    saves = [r["bytes"]["save"] for r in health1["tensor_parallel"]["ranks"]]
    # one copy (rank 0's) with collapse, one per rank without: the server holds 4x as much
    per_rank = saves[0]
    assert saves == ([per_rank, 0, 0, 0] if collapse == "true" else [per_rank] * 4), saves
    assert stored > 0 and left == 0, (stored, left)
    print(f"collapse={collapse}: stored {stored:.0f} B; ranks {ranks}")
