"""Speculative decoding with sampled draft proposals: the speculative sampling rule
(``speculative_accept``: accept x ~ q with probability min(1, p(x) / q(x)), else sample
normalize(max(0, p - q))) emits tokens distributed as p and accepts with probability
sum_x min(p(x), q(x)); ``Sampler.propose`` draws from the target's own transform of the draft
logits; in the engine (v41-tiny-draft, real draft layers), sampling requests' outputs with
sampled drafts follow the distribution they have without drafts, every draft is verified
against the q it was drawn from, sampled proposals are accepted more often than argmax
(one-hot) ones, and greedy requests in the same batches keep their plain outputs.

Statistics are computed here (no scipy): chi-square statistics against 99.9% quantiles, at
fixed seeds, so every run is the same run.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from atom import LLM, SamplingParams
from atom.engine.drafter import Proposal, proposal_q
from atom.engine.sampler import Sampler, adjust_logits, sampling_probs, speculative_accept
from atom.engine.sequence import Sequence

# chi-square 99.9% quantiles by degrees of freedom
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 9: 27.877}


def chi2_999(dof: int) -> float:
    """The chi-square 99.9% quantile: the table, past it Wilson-Hilferty (within 1% there)."""
    if dof in CHI2_999:
        return CHI2_999[dof]
    z, c = 3.0902, 2.0 / (9 * dof)
    return dof * (1 - c + z * math.sqrt(c)) ** 3


# ---- the rule alone ---------------------------------------------------------------------------

DRAWS = 20_000


def _vec(xs):
    t = torch.tensor(xs, dtype=torch.float32)
    return t / t.sum()


def _one_hot(i, n=6):
    t = torch.zeros(n)
    t[i] = 1.0
    return t


RULE_CASES = {
    "q differs from p": (
        _vec([0.40, 0.25, 0.15, 0.10, 0.06, 0.04]),
        _vec([0.10, 0.10, 0.20, 0.30, 0.15, 0.15]),
    ),
    "q has mass where p is 0": (
        _vec([0.5, 0.3, 0.2, 0.0, 0.0, 0.0]),
        _vec([0.1, 0.1, 0.2, 0.3, 0.2, 0.1]),
    ),
    "p has mass where q is 0": (
        _vec([0.2, 0.2, 0.2, 0.2, 0.1, 0.1]),
        _vec([0.6, 0.4, 0.0, 0.0, 0.0, 0.0]),
    ),
    "q close to p": (
        _vec([0.30, 0.25, 0.20, 0.12, 0.08, 0.05]),
        _vec([0.28, 0.27, 0.19, 0.13, 0.07, 0.06]),
    ),
    "q one-hot": (_vec([0.40, 0.25, 0.15, 0.10, 0.06, 0.04]), _one_hot(1)),
    "q one-hot where p is 0": (_vec([0.5, 0.3, 0.2, 0.0, 0.0, 0.0]), _one_hot(4)),
}


def _check_emitted_is_p(counts: torch.Tensor, p: torch.Tensor, what) -> None:
    expected = p.double() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, (what, "a token p excludes was emitted", counts.tolist())
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    assert chi2 < chi2_999(dof), (what, chi2, dof, counts.tolist(), expected.tolist())


def _check_rate(accepted: int, n: int, rate: float, what) -> None:
    if rate in (0.0, 1.0):
        assert accepted == round(rate * n), (what, accepted, n)
        return
    se = math.sqrt(rate * (1 - rate) / n)
    assert abs(accepted / n - rate) < 4 * se, (what, accepted / n, rate, se)


@pytest.mark.parametrize("case", list(RULE_CASES))
def test_the_rule_emits_p_and_accepts_with_the_overlap(case):
    """x ~ q (its own generator), then the rule (the verify stream): the emitted token's
    distribution is p (chi-square), the acceptance rate sum_x min(p(x), q(x))."""
    p, q = RULE_CASES[case]
    draft_gen, verify_gen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    counts, accepted = torch.zeros(6, dtype=torch.float64), 0
    for _ in range(DRAWS):
        x = int(torch.multinomial(q, 1, generator=draft_gen))
        tok, ok = speculative_accept(p, x, q, verify_gen)
        assert not ok or tok == x
        counts[tok] += 1
        accepted += ok
    _check_emitted_is_p(counts, p, case)
    _check_rate(accepted, DRAWS, float(torch.minimum(p, q).sum()), case)


@pytest.mark.parametrize("draft", [0, 3, 5])
def test_a_one_hot_proposal_without_q_is_the_same_rule(draft):
    """q None (an argmax draft): accepted with probability p(draft), the token distributed as
    p, whether p likes the draft, not much, or excludes it."""
    p = _vec([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
    gen = torch.Generator().manual_seed(3 + draft)
    counts, accepted = torch.zeros(6, dtype=torch.float64), 0
    for _ in range(DRAWS):
        tok, ok = speculative_accept(p, draft, None, gen)
        counts[tok] += 1
        accepted += ok
    _check_emitted_is_p(counts, p, draft)
    _check_rate(accepted, DRAWS, float(p[draft]), draft)


def test_the_bonus_position_samples_p_and_q_equal_to_p_always_accepts():
    p = _vec([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
    gen = torch.Generator().manual_seed(4)
    counts = torch.zeros(6, dtype=torch.float64)
    for _ in range(DRAWS):
        tok, ok = speculative_accept(p, None, None, gen)
        assert not ok
        counts[tok] += 1
    _check_emitted_is_p(counts, p, "bonus")
    for x in range(6):  # u < p(x) / q(x) = 1: nothing is ever rejected
        assert all(speculative_accept(p, x, p, gen) == (x, True) for _ in range(200))


def test_a_zero_residual_samples_p():
    """max(0, p - q) is 0 everywhere (q >= p: here an unnormalised q, as rounding can make
    one): a rejection samples p instead of an all-zero distribution."""
    p = _vec([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
    q = 2 * p  # accepts with probability 1/2, and every rejection meets a zero residual
    draft_gen, gen = torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)
    counts, accepted = torch.zeros(6, dtype=torch.float64), 0
    for _ in range(DRAWS):
        x = int(torch.multinomial(q, 1, generator=draft_gen))
        tok, ok = speculative_accept(p, x, q, gen)
        counts[tok] += 1
        accepted += ok
    _check_emitted_is_p(counts, p, "zero residual")
    _check_rate(accepted, DRAWS, 0.5, "zero residual")


def test_verify_uses_q_for_sampling_and_ignores_it_for_greedy():
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    q = _one_hot(5)  # a draft p barely likes, drawn with certainty: rarely accepted
    seq = Sequence([1], SamplingParams(temperature=1.0, seed=7))
    p = sampling_probs(row, seq.params)
    sampler, accepted = Sampler(0), 0
    for _ in range(4000):
        accepted += sampler.verify(row, seq, 5, q)[1]
    _check_rate(accepted, 4000, float(p[5]), "verify")
    q = _vec([0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    greedy = Sequence([1], SamplingParams())
    assert sampler.verify(row, greedy, 0, q) == (0, True)
    assert sampler.verify(row, greedy, 5, q) == (0, False)


def test_propose_draws_from_the_targets_transform_with_the_chain_counted():
    """q is the target's p at the drafted position: penalties and min_tokens over the prompt,
    the output and the tokens drafted before it, then temperature, top-k, top-p; the draws
    come from a stream seeded by the request's seed, not the verify stream."""
    row = torch.randn(300, generator=torch.Generator().manual_seed(0)) * 3
    params = SamplingParams(
        max_tokens=20,
        temperature=0.7,
        top_k=40,
        top_p=0.9,
        seed=11,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.2,
        min_tokens=5,
        stop_token_ids=(int(row.argmax()),),
    )
    prompt, out, ahead = [1, 2, 2, 5], [5, 9], [9, 7]

    def seq_of(p, tokens):
        seq = Sequence(prompt, p)
        seq.tokens += tokens
        return seq

    seq, whole = seq_of(params, out), seq_of(params, out + ahead)
    sampler = Sampler(0)
    tok, q = sampler.propose(row, seq, ahead)
    want = sampling_probs(adjust_logits(row, whole), params)
    assert torch.equal(q, want) and q[int(row.argmax())] == 0  # min_tokens masks the stop id
    assert q[int(tok)] > 0 and int((q > 0).sum()) <= 40
    # reproducible from the seed, on a stream of its own
    draws = [int(tok)] + [int(sampler.propose(row, seq, ahead)[0]) for _ in range(19)]
    again = Sampler(0)
    assert draws == [int(again.propose(row, seq, ahead)[0]) for _ in range(20)]
    other = seq_of(SamplingParams(**{**params.model_dump(), "seed": 12}), out)
    assert draws != [int(Sampler(0).propose(row, other, ahead)[0]) for _ in range(20)]
    fresh = Sampler(0)
    assert fresh.draft_generator(seq, row.device).initial_seed() != fresh._gen(seq).initial_seed()
    sampler.forget(seq)
    assert seq.seq_id not in sampler._draft_gens


def test_a_proposal_keeps_q_only_while_it_is_the_same_list():
    q = torch.rand(2, 6)
    prop = Proposal([3, 4], q)
    assert prop == [3, 4] and proposal_q(prop) is q
    assert proposal_q([3, 4]) is None and proposal_q(list(prop)) is None
    assert proposal_q(Proposal([3])) is None


# ---- the engine ------------------------------------------------------------------------------

MODEL = "v41-tiny-draft"
KW = dict(
    block_size=16,
    num_blocks=160,
    max_num_seqs=16,
    max_num_batched_tokens=256,
    dtype="float32",
    kv_dtype="fp32",
    index_dtype="fp32",
    device="cpu",
)
N = 240  # sampling requests, 120 per group
GROUPS = {
    # near-uniform p and q over the whole vocabulary: they overlap, so sampled drafts are
    # often accepted (and argmax ones hardly ever: p at q's argmax is about 1 / vocab)
    "t1": dict(temperature=1.0),
    # q's top 3 hardly ever meet p's: q has its mass where p is 0 (the residual does the work);
    # few tokens, so their frequencies compare; the penalty is in both transforms
    "t1-top3-rep": dict(temperature=1.0, top_k=3, repetition_penalty=1.2),
}
GREEDY = [
    SamplingParams(max_tokens=10, ignore_eos=True),
    SamplingParams(max_tokens=10, ignore_eos=True, repetition_penalty=1.3),
]


def _workload():
    """(prompts, params, group of each request or None for greedy): the two sampling groups
    interleaved (one prompt each, seeds 0..N-1), a greedy request before every 20th."""
    rng = random.Random(0)
    group_prompt = {g: [rng.randrange(256) for _ in range(9 + 2 * n)] for n, g in enumerate(GROUPS)}
    prompts, params, groups = [], [], []
    names = list(GROUPS)
    for s in range(N):
        if s % 20 == 0:
            prompts.append([rng.randrange(256) for _ in range(rng.randrange(5, 30))])
            params.append(GREEDY[(s // 20) % 2])
            groups.append(None)
        g = names[s % 2]
        prompts.append(group_prompt[g])
        params.append(SamplingParams(max_tokens=4, ignore_eos=True, seed=s, **GROUPS[g]))
        groups.append(g)
    return prompts, params, groups


def _spy(llm) -> dict:
    """Record what the sampling requests' verifies decide: each position's p and token, the
    drafts verified and accepted. With sampled proposals (``llm``'s drafter has a sampler)
    also record every proposal and check every verify of one: its q is the one the draft was
    drawn from (same position, same token); and accumulate sum min(p, q), the expected
    acceptances (and their variance)."""
    sampler = llm.engine.sampler
    sampled = llm.engine.drafter.sampler is not None
    rec = dict(verified=0, accepted=0, expected=0.0, variance=0.0, emitted=[])
    drawn: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}
    propose, verify = sampler.propose, sampler.verify

    def spy_propose(row, seq, ahead):
        tok, q = propose(row, seq, ahead)
        drawn[(seq.seq_id, len(seq.tokens) + len(ahead))] = (int(tok), q.clone())
        return tok, q

    def spy_verify(row, seq, draft, q=None):
        if seq.params.greedy:
            return verify(row, seq, draft, q)
        p = sampling_probs(adjust_logits(row.float().cpu(), seq), seq.params)
        tok, ok = verify(row, seq, draft, q)
        rec["emitted"].append((p, tok))
        if draft is None:
            return tok, ok
        rec["verified"] += 1
        rec["accepted"] += ok
        if sampled:
            was, want = drawn[(seq.seq_id, len(seq.tokens))]
            assert q is not None and was == draft and torch.equal(q, want.cpu())
            a = float(torch.minimum(p, q).sum())
            rec["expected"] += a
            rec["variance"] += a * (1 - a)
        else:
            assert q is None
        return tok, ok

    sampler.propose, sampler.verify = spy_propose, spy_verify
    return rec


def _pit_chi2(emitted: list[tuple[torch.Tensor, int]], bins: int = 10) -> float:
    """Each (p, token) -> u = P(tokens before it) + V p(token), tokens ordered by p descending
    and V uniform (a fixed generator): u is uniform on [0, 1) and independent across positions
    exactly when every token was drawn from its p given the ones before it. Returns the
    chi-square statistic of u's histogram (``bins`` - 1 degrees of freedom)."""
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(bins, dtype=torch.float64)
    for p, tok in emitted:
        order = torch.argsort(p, descending=True, stable=True)
        rank = int((order == tok).nonzero())
        before = float(p[order[:rank]].sum())
        u = before + float(torch.rand((), generator=gen)) * float(p[tok])
        counts[min(int(u * bins), bins - 1)] += 1
    expected = len(emitted) / bins
    return float(((counts - expected) ** 2 / expected).sum())


def _two_sample_chi2(a: list[int], b: list[int], min_count: int = 10) -> tuple[float, int]:
    """Two-sample chi-square of two token samples of equal size: tokens drawn fewer than
    ``min_count`` times in both together are pooled into one category."""
    n = max(a + b) + 1
    ca = torch.bincount(torch.tensor(a), minlength=n).double()
    cb = torch.bincount(torch.tensor(b), minlength=n).double()
    keep = (ca + cb) >= min_count
    ca = torch.cat([ca[keep], ca[~keep].sum()[None]])
    cb = torch.cat([cb[keep], cb[~keep].sum()[None]])
    tot = ca + cb
    used = tot > 0
    ca, cb, tot = ca[used], cb[used], tot[used]
    ea, eb = tot * ca.sum() / tot.sum(), tot * cb.sum() / tot.sum()
    chi2 = float(((ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb).sum())
    return chi2, int(used.sum()) - 1


@pytest.fixture(scope="module")
def runs():
    """The workload without drafts, with sampled drafts and with argmax drafts."""
    prompts, params, groups = _workload()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (the conftest's fixture is per test; this one per module)
    try:
        plain = LLM(MODEL, **KW).generate(prompts, params)
        llm = LLM(MODEL, speculative_tokens=2, **KW)
        rec = _spy(llm)
        spec = llm.generate(prompts, params, on_step=lambda e: e.check_integrity())
        one_hot = LLM(MODEL, speculative_tokens=2, **KW)
        one_hot.engine.drafter.sampler = None  # argmax proposals for every request
        argmax_rec = _spy(one_hot)
        argmax = one_hot.generate(prompts, params)
    finally:
        torch.set_num_threads(threads)
    return dict(
        groups=groups, plain=plain, spec=spec, argmax=argmax, rec=rec, argmax_rec=argmax_rec
    )


def test_sampled_outputs_with_drafts_follow_the_plain_distribution(runs):
    """Tokens 2 and 3 of each request of group t1-top3-rep (the first ones decided by a
    verify: token 1 comes from the prefill) have the same distribution with drafts, sampled or
    argmax, as without (two-sample chi-square over the tokens drawn 10 times or more, the
    rest pooled). Group t1's tokens spread over the whole vocabulary, too thin for
    frequencies; every token a verify decided, in both groups, is checked against the p it was
    drawn from instead (probability integral transform: uniform)."""
    groups = runs["groups"]
    idx = [i for i, g in enumerate(groups) if g == "t1-top3-rep"]
    for pos in (1, 2):
        base = [runs["plain"][i].token_ids[pos] for i in idx]
        for arm in ("spec", "argmax"):
            got = [runs[arm][i].token_ids[pos] for i in idx]
            chi2, dof = _two_sample_chi2(base, got)
            assert dof >= 3 and chi2 < chi2_999(dof), (pos, arm, chi2, dof)
    for arm in ("rec", "argmax_rec"):
        emitted = runs[arm]["emitted"]
        assert len(emitted) >= 2 * N
        assert _pit_chi2(emitted) < chi2_999(9), arm
    # the drafts changed the runs: the same seeds, other random streams
    assert any(a.token_ids != b.token_ids for a, b in zip(runs["spec"], runs["plain"]))


def test_every_sampled_draft_is_verified_against_its_q_and_accepted_at_the_overlap(runs):
    """Every verified draft of a sampling request was drawn by ``Sampler.propose`` and came to
    verify with that q (checked in the spy); the accepted ones match sum min(p, q) over the
    verified ones, and sampled proposals are accepted far more often than argmax ones."""
    rec, argmax = runs["rec"], runs["argmax_rec"]
    assert rec["verified"] > N and argmax["verified"] > N, (rec, argmax)
    assert abs(rec["accepted"] - rec["expected"]) < 4 * math.sqrt(rec["variance"]) + 1, rec
    rate, argmax_rate = (r["accepted"] / r["verified"] for r in (rec, argmax))
    # random draft layers: q and p are both near uniform over the vocabulary (group t1), so
    # they overlap, while p at q's argmax is about 1 / vocab
    assert rate > 0.2 and rate > argmax_rate + 0.15, (rec, argmax)


def test_greedy_requests_beside_sampled_ones_keep_their_plain_outputs(runs):
    greedy = [i for i, g in enumerate(runs["groups"]) if g is None]
    assert len(greedy) == N // 20
    for i in greedy:
        assert runs["spec"][i].token_ids == runs["plain"][i].token_ids
        assert runs["argmax"][i].token_ids == runs["plain"][i].token_ids


def test_sampled_drafts_are_reproducible_from_the_seeds():
    prompts, params, _ = _workload()
    prompts, params = prompts[:24], params[:24]
    a = LLM(MODEL, speculative_tokens=2, **KW).generate(prompts, params)
    b = LLM(MODEL, speculative_tokens=2, **KW).generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
