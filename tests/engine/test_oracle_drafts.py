"""benchmarks/oracle_drafts.py: drafts of a chosen acceptance over the real draft layers. At
acceptance 1 every draft is accepted, at 0 none is, in between the first draft of each verify
is accepted about that often; outputs equal plain decoding's in every case."""

import pytest

from atom import LLM, SamplingParams
from benchmarks.oracle_drafts import OracleDrafter

from .test_speculative import KW

PROMPTS = [[(11 * i + 3 * j) % 256 for j in range(24 + 5 * i)] for i in range(4)]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def run(acceptance: float, truth: dict, k: int = 2) -> tuple[list, dict]:
    llm = LLM("v41-tiny-draft", speculative_tokens=k, **KW)
    llm.engine.drafter = OracleDrafter(llm.engine.drafter, truth, acceptance, seed=5)
    outs = llm.generate(PROMPTS, GREEDY)
    return [o.token_ids for o in outs], llm.engine.stats()["speculative"]


def test_acceptance_follows_the_oracle_and_outputs_stay_exact():
    plain = [o.token_ids for o in LLM("v41-tiny-draft", **KW).generate(PROMPTS, GREEDY)]
    truth = {tuple(p): p + o for p, o in zip(PROMPTS, plain)}
    rates = {}
    for a in (0.0, 0.6, 1.0):
        outs, spec = run(a, truth)
        assert outs == plain, a
        rates[a] = spec["acceptance_rate"]
        assert spec["draft_tokens"] > 0
    assert rates[1.0] == 1.0 and rates[0.0] == 0.0
    assert 0.25 < rates[0.6] < 0.75  # first drafts at ~0.6, second ones at ~0.36
    with pytest.raises(ValueError, match="acceptance must be in"):
        OracleDrafter(LLM("v41-tiny-draft", speculative_tokens=1, **KW).engine.drafter, truth, 1.5)
