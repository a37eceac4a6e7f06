"""Which spans of a target forward run as decode rows: a verify span of several tokens does;
a prompt chunk of the same length never does, so a prompt's bits do not depend on whether the
engine speculates (on CUDA a prompt's 2-token tail chunk, computed as verify rows with k = 2,
came out in other bits than the prefill without drafts, and the first token changed)."""

from __future__ import annotations

import pytest

from atom import LLM, SamplingParams
from atom.models.deepseek_v4.forward_plan import V4ForwardPlan
from atom.models.deepseek_v41.forward_plan import ForwardPlan
from tests.engine.test_batch_invariant import KW, prompts_of


@pytest.mark.parametrize(
    "preset, plan", [("v41-tiny-draft", ForwardPlan), ("v4-tiny", V4ForwardPlan)]
)
def test_a_prompt_tail_of_verify_length_prefills_and_verify_spans_run_as_rows(
    preset, plan, monkeypatch
):
    forwards = []  # each target forward: (positions it ran as decode rows, its spans)
    build = plan.build.__func__

    def spy(cls, token_ids, spans, *args, **kw):
        got = build(cls, token_ids, spans, *args, **kw)
        if plan is ForwardPlan or kw.get("verify_only"):  # not V4's draft-layer forwards
            rows = set() if got.decode is None else set(got.decode.pos.tolist())
            forwards.append((rows, list(spans)))
        return got

    monkeypatch.setattr(plan, "build", classmethod(spy))
    prompt = prompts_of([50], seed=3)[0]  # 3 blocks of 16, then a tail of 2 tokens
    llm = LLM(preset, **dict(KW, max_num_seqs=2, max_num_batched_tokens=64), speculative_tokens=2)
    out = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(out[0].token_ids) == 12
    tail = [rows for rows, spans in forwards if any(sp.end == 50 for sp in spans)]
    assert tail, "no forward computed the prompt's last token"
    assert all(not rows & {48, 49} for rows in tail), tail  # prefill rows
    verify = [rows for rows, spans in forwards for sp in spans if sp.verify and sp.num_tokens > 1]
    assert verify, "no verify span of several tokens ran"
    assert all(len(rows) > 1 for rows in verify), verify  # decode rows, as before
    llm.shutdown()
