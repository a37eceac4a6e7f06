"""Speculative decoding with DSpark (v41-tiny-dspark: two stages drafting blocks of 3): greedy
outputs equal plain decoding and the oracle, with the stages' own drafts and with scripted
ones (the stages still run and fill their windows), under preemption; the drafts the engine
proposes are the reference draft's; speculative_tokens beyond the block is refused."""

from __future__ import annotations

import pytest

from atom import LLM
from atom.config import EngineConfigError
from atom.models.deepseek_v41.dspark import draft_block
from atom.models.deepseek_v41.reference import reference_with_hidden

from .test_engine_oracle import assert_greedy_matches_oracle
from .test_speculative import GREEDY, KW, prompts_of, run, truth_of

MODEL = "v41-tiny-dspark"


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_dspark_equals_plain_and_oracle(k):
    prompts = prompts_of([5, 17, 33, 40])
    _, plain = run(prompts, GREEDY, model=MODEL)
    llm, spec = run(prompts, GREEDY, k=k, model=MODEL)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = llm.engine.stats()["speculative"]
    assert stats["verify_spans"] > 0 and stats["draft_tokens"] >= stats["verify_spans"]
    for p, o in zip(prompts, spec):
        assert_greedy_matches_oracle(llm.engine.runtime.model, p, o.token_ids)


def test_scripted_drafts_are_accepted_in_fewer_steps_and_under_preemption():
    prompts = prompts_of([40, 33, 47, 20, 38, 45], seed=3)
    base, plain = run(prompts, GREEDY, model=MODEL)
    truth = truth_of(prompts, plain)
    llm, spec = run(prompts, GREEDY, k=3, truth=truth, model=MODEL)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = llm.engine.stats()["speculative"]
    assert stats["acceptance_rate"] > 0.5 and stats["tokens_per_verify"] > 1.5, stats
    assert llm.engine.stats()["steps"] < base.engine.stats()["steps"]
    tight = dict(num_blocks=16, max_num_seqs=6)
    llm, spec = run(prompts, GREEDY, k=3, truth=truth, model=MODEL, **tight)
    assert llm.engine.stats()["preemptions"] > 0, "the pool did not force preemption"
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_the_engines_proposals_are_the_reference_drafts():
    """Every proposal the engine makes (chunked prefill, verify steps, two sequences in a
    batch) is the reference draft from the same committed tokens."""
    prompts = prompts_of([21, 35], seed=5)
    llm = LLM(MODEL, speculative_tokens=3, **KW)
    rt = llm.engine.runtime
    seen = []
    inner = rt.draft_blocks

    def spy(tokens, positions, slots):
        got = inner(tokens, positions, slots)
        by_slot = {s.slot: s for s in llm.engine.scheduler.running}
        for tok, p, slot, ids in zip(tokens, positions, slots, got):
            seen.append((list(by_slot[slot].tokens[: p + 1]), tok, ids))
        return got

    rt.draft_blocks = spy
    llm.generate(prompts, GREEDY)
    assert len(seen) > 10
    model = rt.model
    for committed, tok, ids in seen[:: max(1, len(seen) // 8)]:
        _, hidden = reference_with_hidden(model, committed)
        assert ids == draft_block(model, hidden, tok, len(committed) - 1)[0]


def test_speculative_tokens_beyond_the_block_is_refused():
    with pytest.raises(EngineConfigError, match=r"speculative_tokens=4.*dspark_block_size.*<= 3"):
        LLM(MODEL, speculative_tokens=4, **KW)


def test_verify_graphs_hand_the_stages_their_hidden(fake_engine_graphs):
    """With (fake) span graphs the verify forwards replay a graph whose residual is the
    stages' target hidden: outputs and proposals as without graphs."""
    prompts = prompts_of([17, 40], seed=6)
    _, plain = run(prompts, GREEDY, model=MODEL)
    llm, spec = run(prompts, GREEDY, k=3, truth=truth_of(prompts, plain), model=MODEL)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    rt = fake_engine_graphs[-1]
    assert rt.span_graphs.replays["verify"] > 5 and not rt.span_graphs.failed
