"""Which spans of a target forward run as decode rows: a decode step's (one token, or a verify
span of several), never a prompt chunk (``Span.prefill``), whatever its length. Decode rows and
prefill rows may differ in the last bits, so a prompt's bits would otherwise depend on where its
chunks end: with drafts (k = 2) a 2-token tail chunk ran as verify rows and, on an H100, the
first token changed; under one chunk budget a 1-token tail chunk ran as a decode row and the
batch-invariant mode's outputs changed with the budget (on CPU in float32)."""

from __future__ import annotations

import pytest

from atom import LLM, SamplingParams
from atom.models.deepseek_v4.forward_plan import V4ForwardPlan
from atom.models.deepseek_v41.forward_plan import ForwardPlan
from tests.engine.test_batch_invariant import KW, prompts_of


def record_rows(plan, monkeypatch) -> list:
    """Each target forward's (positions it ran as decode rows, its spans), as it builds them
    (V4's draft-layer forwards build with ``ratios=[]`` and are left out)."""
    forwards = []
    build = plan.build.__func__

    def spy(cls, token_ids, spans, *args, **kw):
        got = build(cls, token_ids, spans, *args, **kw)
        if plan is ForwardPlan or kw.get("ratios"):
            rows = set() if got.decode is None else set(got.decode.pos.tolist())
            forwards.append((rows, list(spans)))
        return got

    monkeypatch.setattr(plan, "build", classmethod(spy))
    return forwards


@pytest.mark.parametrize(
    "preset, plan", [("v41-tiny-draft", ForwardPlan), ("v4-tiny", V4ForwardPlan)]
)
@pytest.mark.parametrize("length, budget", [(50, 64), (49, 48)])
def test_prompt_tails_prefill_and_verify_spans_run_as_rows(
    preset, plan, length, budget, monkeypatch
):
    """A prompt whose last chunk is 2 tokens (50 = 3 blocks + 2) or 1 token (49, the budget
    cutting at 48) with drafts (k = 2): the tail's positions are prefill rows; the verify
    spans of several tokens are decode rows."""
    forwards = record_rows(plan, monkeypatch)
    prompt = prompts_of([length], seed=3)[0]
    kw = dict(KW, max_num_seqs=2, max_num_batched_tokens=budget)
    llm = LLM(preset, **kw, speculative_tokens=2)
    out = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(out[0].token_ids) == 12
    tail = [(rows, spans) for rows, spans in forwards if any(sp.end == length for sp in spans)]
    assert tail and all(sp.prefill for _, spans in tail for sp in spans), tail
    assert all(not rows & set(range(48, length)) for rows, _ in tail), tail  # prefill rows
    verify = [
        rows
        for rows, spans in forwards
        for sp in spans
        if sp.num_tokens > 1 and sp.start > 0 and not sp.prefill
    ]
    assert verify, "no verify span of several tokens ran"
    assert all(len(rows) > 1 for rows in verify), verify  # decode rows, as before
    llm.shutdown()


@pytest.mark.parametrize("preset", ["v41-tiny", "v4-tiny"])
@pytest.mark.parametrize("invariant", [False, True])
def test_prompts_shorter_than_a_compressed_group_prefill(preset, invariant):
    """1-, 2- and 3-token prompts prefill (a 1-token prompt ran as a decode row before) with no
    compressed row to score yet; the batch-invariant mode crashed on such a prompt (an empty
    list of key chunks). Greedy outputs equal the oracle's."""
    from tests.engine.test_engine_oracle import assert_greedy_matches_oracle

    llm = LLM(preset, **dict(KW, batch_invariant=invariant, max_num_seqs=4))
    for prompt in prompts_of([1, 2, 3], seed=9):  # alone: no longer span in the forward
        [out] = llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
        assert_greedy_matches_oracle(llm.engine.runtime.model, prompt, out.token_ids)
    llm.shutdown()
