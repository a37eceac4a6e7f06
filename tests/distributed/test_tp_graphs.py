"""Graphs across ranks (CPU, gloo; rank 0 is this process, rank 1 a spawned one), through the
fake capture (``EagerBackend`` on every rank: "replay" re-runs the captured function, so the
forward's all-reduces run inside every capture and replay): TP=2 with graphs gives TP=2's eager
tokens, replays happen, and every rank ends holding the same pool and state bytes (captures
and replays paired up across the ranks). With drafts, the verify and draft forwards replay
span graphs on every rank as well."""

from __future__ import annotations

import pytest

from atom import LLM, SamplingParams
from atom.distributed import ranks
from atom.models.common.graphs import EagerBackend
from tests.distributed.test_tp_drafts import KW
from tests.engine.test_speculative import prompts_of

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def patch_fake_graphs(mp: pytest.MonkeyPatch) -> None:
    """TP engines built from here on replay fake graphs on every rank."""
    real = ranks.start_ranks

    def start(cfg, rank_ops=None):
        rt = real(cfg, rank_ops=rank_ops)
        assert rt.enable_decode_graphs(cfg.max_num_seqs, cfg.max_model_len, EagerBackend())
        return rt

    mp.setattr(ranks, "start_ranks", start)


def generate(model: str, prompts, **kw):
    llm = LLM(model, **{**KW, **kw})
    try:
        outs = llm.generate(prompts, GREEDY, on_step=lambda e: e.check_integrity())
        rt = llm.engine.runtime
        stats = rt.graph_stats() if rt.graph_stats is not None else {}
        return [o.token_ids for o in outs], stats, rt.rank_digests()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("model", ["v41-tiny", "v4-tiny"])
def test_tp2_graphs_give_the_eager_tokens_and_the_ranks_the_same_bytes(model):
    prompts = prompts_of([5, 21, 40, 17], seed=13)
    eager, none, _ = generate(model, prompts)
    assert not none or not any(v.get("replays") for v in none.values()), none
    with pytest.MonkeyPatch.context() as mp:
        patch_fake_graphs(mp)
        graphed, stats, digests = generate(model, prompts)
    assert graphed == eager
    assert stats["decode"]["replays"] > 0 and stats["decode"]["failed"] == 0, stats
    assert digests[0] == digests[1], digests


def test_tp2_drafts_replay_span_graphs_on_every_rank(monkeypatch):
    prompts = prompts_of([9, 33, 20], seed=6)
    plain, _, _ = generate("v41-tiny-draft", prompts)
    patch_fake_graphs(monkeypatch)
    spec, stats, digests = generate("v41-tiny-draft", prompts, speculative_tokens=2)
    assert spec == plain
    assert stats["verify"]["replays"] > 0 and stats["draft"]["replays"] > 0, stats
    assert not any(v["failed"] for v in stats.values()), stats
    assert digests[0] == digests[1], digests
