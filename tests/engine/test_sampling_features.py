"""Sampling features against the oracle: logprobs, prompt logprobs, penalties, min_tokens.

Logprobs are the model's raw log-softmax; the oracle (``reference_forward``, a full recompute)
gives the logits every position should have. fp32 on the CPU: values agree within 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from atom import LLM, SamplingParams
from atom.engine.sampler import adjust_logits
from atom.engine.sequence import Sequence
from atom.models.deepseek_v41.reference import reference_forward

TOL = 1e-4


@pytest.fixture(scope="module")
def llm():
    return LLM(
        "v41-tiny",
        block_size=16,
        num_blocks=64,
        max_num_seqs=4,
        max_num_batched_tokens=24,  # prompts run in several chunks
        dtype="float32",
        kv_dtype="fp32",
        index_dtype="fp32",
        device="cpu",
    )


def prompt_of(n: int, salt: int) -> list[int]:
    g = torch.Generator().manual_seed(salt)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def oracle_logprobs(llm, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(reference_forward(llm.engine.runtime.model, ids).float(), -1)


def check_top(rec, row: torch.Tensor, k: int) -> None:
    assert len(rec.top) == k
    want = torch.topk(row, k).values.tolist()
    got = [lp for _, lp in rec.top]
    assert got == pytest.approx(want, abs=TOL)
    for tid, lp in rec.top:  # ids may swap at near-ties; each must carry its own value
        assert lp == pytest.approx(float(row[tid]), abs=TOL)


def test_logprobs_and_prompt_logprobs_match_the_oracle(llm):
    prompt = prompt_of(45, 1)
    other = prompt_of(30, 2)
    params = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    # a request without logprobs in the same steps: its output is the one it has alone
    alone = llm.generate([other], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids
    out, plain = llm.generate(
        [prompt, other], [params, SamplingParams(max_tokens=5, ignore_eos=True)]
    )
    assert plain.token_ids == alone and plain.logprobs is None and plain.prompt_logprobs is None
    ids = prompt + out.token_ids
    lp = oracle_logprobs(llm, ids[:-1])
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        rec = out.prompt_logprobs[j]
        assert rec.token_id == prompt[j]
        assert rec.logprob == pytest.approx(float(lp[j - 1, prompt[j]]), abs=TOL)
        assert rec.rank == int((lp[j - 1] > lp[j - 1, prompt[j]]).sum()) + 1
        check_top(rec, lp[j - 1], 2)
    assert len(out.logprobs) == 5
    for k, rec in enumerate(out.logprobs):
        pos = len(prompt) - 1 + k
        assert rec.token_id == out.token_ids[k]
        assert rec.logprob == pytest.approx(float(lp[pos, rec.token_id]), abs=TOL)
        assert rec.rank == 1  # greedy
        check_top(rec, lp[pos], 3)


def test_prompt_logprobs_compute_the_whole_prompt(llm):
    prompt = prompt_of(64, 3)
    first = llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    cached = llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    assert cached.hbm_hit_tokens > 0, "the prompt was not cached: the test proves nothing"
    p = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    out = llm.generate([prompt], p)[0]
    assert out.hbm_hit_tokens == 0 and out.computed_prompt_tokens == len(prompt)
    assert out.token_ids == first.token_ids
    lp = oracle_logprobs(llm, prompt)
    got = [r.logprob for r in out.prompt_logprobs[1:]]
    want = [float(lp[j - 1, prompt[j]]) for j in range(1, len(prompt))]
    assert got == pytest.approx(want, abs=TOL)
    assert all(r.top == () for r in out.prompt_logprobs[1:])


def test_greedy_unchanged_by_zero_penalties_and_logprobs(llm):
    prompts = [prompt_of(20 + i, 10 + i) for i in range(3)]
    base = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    same = llm.generate(
        prompts,
        SamplingParams(
            max_tokens=6,
            ignore_eos=True,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            repetition_penalty=1.0,
            min_tokens=0,
            logprobs=5,
        ),
    )
    assert [o.token_ids for o in same] == [o.token_ids for o in base]


def penalized(row: torch.Tensor, tokens: list[int], n_prompt: int, p: SamplingParams):
    """The penalties written out with Python loops (the reference for adjust_logits)."""
    row = row.clone()
    for t in set(tokens):
        if p.repetition_penalty != 1.0:
            r = p.repetition_penalty
            row[t] = row[t] / r if row[t] > 0 else row[t] * r
    out = tokens[n_prompt:]
    for t in set(out):
        row[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return row


@pytest.mark.parametrize(
    "pen",
    [
        dict(repetition_penalty=1.8),
        dict(repetition_penalty=0.6),
        dict(frequency_penalty=1.5),
        dict(presence_penalty=2.0),
        dict(frequency_penalty=-0.5, presence_penalty=0.7, repetition_penalty=1.3),
    ],
)
def test_greedy_penalties_follow_their_definition(llm, pen):
    """Teacher forcing: each output token is the argmax of the oracle's logits there, with the
    penalties applied over the tokens before it (prompt + output for repetition, output for
    frequency and presence)."""
    # repeated tokens, so penalties bite; salt 22: a prompt whose plain greedy output repeats
    # tokens with this model (salt 20's stopped repeating when V4.1 followed the published code)
    prompt = prompt_of(24, 22) + [7] * 6
    p = SamplingParams(max_tokens=10, ignore_eos=True, **pen)
    out = llm.generate([prompt], p)[0].token_ids
    plain = llm.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids
    logits = reference_forward(llm.engine.runtime.model, prompt + out[:-1]).float()
    for k, tok in enumerate(out):
        ctx = prompt + out[:k]
        want = int(penalized(logits[len(prompt) - 1 + k], ctx, len(prompt), p).argmax())
        assert tok == want, f"token {k}: engine {tok}, penalized oracle {want}"
    if pen.get("repetition_penalty", 1) > 1 or pen.get("frequency_penalty", 0) > 0:
        assert out != plain, "the penalty changed nothing: the test proves nothing"


def test_adjust_logits_matches_the_loop_definition():
    g = torch.Generator().manual_seed(0)
    row = torch.randn(300, generator=g) * 3
    prompt, out = [1, 2, 2, 5, 299], [5, 5, 9, 1, 9, 9]
    p = SamplingParams(
        max_tokens=20, repetition_penalty=1.7, frequency_penalty=0.4, presence_penalty=-0.3
    )
    seq = Sequence(prompt, p)
    seq.tokens += out
    assert torch.allclose(adjust_logits(row, seq), penalized(row, seq.tokens, len(prompt), p))
    assert adjust_logits(row, Sequence(prompt, SamplingParams())) is row  # nothing applies


def test_seeded_sampling_with_penalties_is_reproducible(llm):
    prompt = prompt_of(18, 30)

    def run(seed):
        p = SamplingParams(
            max_tokens=8,
            temperature=1.0,
            seed=seed,
            ignore_eos=True,
            repetition_penalty=1.4,
            frequency_penalty=0.5,
            presence_penalty=0.5,
        )
        return llm.generate([prompt], p)[0].token_ids

    a, b, c = run(11), run(11), run(12)
    assert a == b
    assert a != c


def test_min_tokens_suppresses_eos_and_stop_token_ids(llm):
    prompt = prompt_of(20, 40)
    eng = llm.engine
    greedy = llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))[0].token_ids
    first = greedy[0]

    def run(params, eos=None):
        seq = eng.add_request(list(prompt), params, eos_token_id=eos)
        eng.run_until(lambda: seq.is_finished)
        return seq

    # without min_tokens the first greedy token ends the request (as EOS or a stop id)
    assert run(SamplingParams(max_tokens=8), eos=first).output == [first]
    assert run(SamplingParams(max_tokens=8, stop_token_ids=(first,))).output == [first]
    for params, eos in [
        (SamplingParams(max_tokens=6, min_tokens=3), first),
        (SamplingParams(max_tokens=6, min_tokens=3, stop_token_ids=(first,)), None),
    ]:
        seq = run(params, eos)
        assert len(seq.output) >= 3
        assert first not in seq.output[:3]
        if seq.finish_reason == "stop":
            assert seq.output[-1] == first and len(seq.output) > 3


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(presence_penalty=2.5), "[-2, 2]"),
        (dict(frequency_penalty=float("nan")), "[-2, 2]"),
        (dict(repetition_penalty=0.0), "> 0"),
        (dict(min_tokens=-1), "min_tokens=-1"),
        (dict(max_tokens=4, min_tokens=5), "min_tokens=5 must be <= max_tokens=4"),
        (dict(logprobs=21), "[0, 20]"),
        (dict(prompt_logprobs=-1), "[0, 20]"),
    ],
)
def test_bad_sampling_params_are_refused(kw, needle):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kw)
    assert needle in str(err.value)
