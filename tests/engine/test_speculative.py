"""Speculative decoding with the model's draft layers: greedy outputs equal plain decoding (and
the oracle), accepted drafts included, across block boundaries, under preemption, with
penalties and logprobs; images only at committed boundaries; draft rows never a hit.

The random-weight draft layers of v41-tiny-draft rarely agree with the target, so most tests
also run a scripted drafter: the real draft layers still run (their rings and cursors advance
exactly as in production), then their proposals are replaced by the true continuation with a
wrong token at chosen positions, so every acceptance length occurs.
"""

from __future__ import annotations

import random

import pytest
import torch

from atom import LLM, SamplingParams
from atom.config import EngineConfigError
from atom.engine.sampler import Sampler, sampling_probs
from atom.engine.sequence import Sequence

from .test_engine_oracle import assert_greedy_matches_oracle

BLOCK = 16
KW = dict(
    block_size=BLOCK,
    num_blocks=64,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    dtype="float32",
    kv_dtype="fp32",
    index_dtype="fp32",
    device="cpu",
)
MODEL = "v41-tiny-draft"


def prompts_of(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


class ScriptedDrafter:
    """The real drafter runs (draft layers or DSpark stages); its proposals are then replaced
    by ``truth`` (prompt -> the plain run's tokens) with a wrong token wherever
    ``wrong(position)`` holds (prompts not in ``truth`` keep the drafter's own proposals)."""

    def __init__(self, drafter, truth: dict, wrong):
        self.inner, self.truth, self.wrong = drafter, truth, wrong
        self.runtime, self.k = drafter.runtime, drafter.k
        if hasattr(drafter, "propose_device"):  # draft layers: greedy steps walk on the device
            self.propose_device = drafter.propose_device

    def propose(self, items):
        return self._replace(items, self.inner.propose(items))

    def finish_device(self, items, drafts, chains, accepted):
        return self._replace(items, self.inner.finish_device(items, drafts, chains, accepted))

    def _replace(self, items, out):
        for it in items:
            if it.want and tuple(it.seq.prompt) in self.truth:  # else: the layers' own
                full, n = self.truth[tuple(it.seq.prompt)], len(it.seq.tokens)
                out[it.seq.seq_id] = [
                    (t + 1) % 256 if self.wrong(n + j) else t
                    for j, t in enumerate(full[n : n + it.want])
                ]
        return out


def run(prompts, params, k=0, truth=None, wrong=lambda p: p % 7 == 0, model=MODEL, **kw):
    llm = LLM(model, speculative_tokens=k, **{**KW, **kw})
    if truth is not None:
        llm.engine.drafter = ScriptedDrafter(llm.engine.drafter, truth, wrong)
    outs = llm.generate(prompts, params, on_step=lambda e: e.check_integrity())
    return llm, outs


def truth_of(prompts, outs):
    return {tuple(p): p + o.token_ids for p, o in zip(prompts, outs)}


GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


# both families' draft layers: V4.1's, and V4's MTP block (v4-tiny), whose state rewinds over
# rejected drafts through rings of k more rows (``deepseek_v4.geometry``)
FAMILIES = [MODEL, "v4-tiny"]


@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize("k", [2, 5])
def test_greedy_speculative_equals_plain_and_oracle_with_real_draft_layers(k, model):
    prompts = prompts_of([5, 17, 33, 40])
    _, plain = run(prompts, GREEDY, model=model)
    llm, spec = run(prompts, GREEDY, k=k, model=model)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = llm.engine.stats()["speculative"]
    assert stats["verify_spans"] > 0 and stats["draft_tokens"] >= stats["verify_spans"]
    for p, o in zip(prompts, spec):
        assert_greedy_matches_oracle(llm.engine.runtime.model, p, o.token_ids)


@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize("k", [1, 3, 5])
def test_accepted_drafts_give_the_plain_tokens_in_fewer_steps(k, model):
    prompts = prompts_of([5, 17, 33, 40], seed=1)
    base, plain = run(prompts, GREEDY, model=model)
    llm, spec = run(prompts, GREEDY, k=k, truth=truth_of(prompts, plain), model=model)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = llm.engine.stats()["speculative"]
    # a wrong draft every 7 positions: most drafts are accepted, and every length occurs
    assert stats["acceptance_rate"] > 0.5, stats
    assert stats["tokens_per_verify"] > 1.5, stats
    assert llm.engine.stats()["steps"] < base.engine.stats()["steps"]


def test_all_wrong_and_all_right_drafts():
    prompts = prompts_of([9, 31], seed=2)
    _, plain = run(prompts, GREEDY)
    truth = truth_of(prompts, plain)
    for wrong, rate in ((lambda p: True, 0.0), (lambda p: False, 1.0)):
        llm, spec = run(prompts, GREEDY, k=3, truth=truth, wrong=wrong)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
        assert llm.engine.stats()["speculative"]["acceptance_rate"] == rate


@pytest.mark.parametrize("model", FAMILIES)
def test_under_preemption_outputs_unchanged_and_drafts_cleared(model):
    prompts = prompts_of([40, 33, 47, 20, 38, 45], seed=3)
    tight = dict(num_blocks=16, max_num_seqs=6, model=model)
    _, plain = run(prompts, GREEDY, **tight)
    llm, spec = run(prompts, GREEDY, k=3, truth=truth_of(prompts, plain), **tight)
    assert llm.engine.stats()["preemptions"] > 0, "the pool did not force preemption"
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert all(not s.draft for s in llm.engine.scheduler.waiting)


def test_a_verify_span_never_crosses_a_block_boundary_and_images_need_acceptance():
    prompt = prompts_of([BLOCK + 3], seed=4)
    _, plain = run(prompt, GREEDY)
    truth = truth_of(prompt, plain)

    def wrong(p):
        return p % BLOCK == BLOCK - 1  # the draft for a block's last position is wrong

    spans = []
    llm = LLM(MODEL, speculative_tokens=5, **KW)
    eng = llm.engine
    eng.drafter = ScriptedDrafter(eng.drafter, truth, wrong)
    inner = eng.runner.execute

    def execute(sps, *a, **kw):
        spans.extend((sp.start, sp.end, len(sp.drafts), sp.image) for sp in sps)
        return inner(sps, *a, **kw)

    eng.runner.execute = execute
    out = llm.generate(prompt, GREEDY)[0]
    assert out.token_ids == plain[0].token_ids
    rejected_at_boundary = 0
    for start, end, drafts, image in spans:
        if not drafts:
            continue
        assert end <= (start // BLOCK + 1) * BLOCK, f"[{start}, {end}) crosses a boundary"
        if image is not None and any(wrong(p) for p in range(end - drafts, end)):
            assert image.doomed, f"image at {end} kept after a rejected draft"
            rejected_at_boundary += 1
    assert rejected_at_boundary, "no verify span ended on a boundary with a rejected draft"
    # every decode boundary still got its image, from a span with no or only accepted drafts
    ready = {c.position for c in eng.store.images.values() if c.ready}
    assert {2 * BLOCK, 3 * BLOCK} <= ready


def test_rejected_draft_rows_are_never_offered_as_a_hit():
    """Blocks are published only up to the committed end: a block holding rows of rejected
    drafts is not registered until the next forward re-ran them; a later request resuming on
    those blocks computes what plain decoding computes."""
    prompt = prompts_of([BLOCK - 2], seed=5)
    _, plain = run(prompt, GREEDY)
    truth = truth_of(prompt, plain)

    def published_only_committed(engine):
        engine.check_integrity()
        for seq in engine.scheduler.running:
            for i in range(seq.num_computed // BLOCK, len(seq.block_table)):
                assert engine.pool.hash_of[seq.block_table[i]] is None, (seq, i)

    llm = LLM(MODEL, speculative_tokens=5, **KW)
    llm.engine.drafter = ScriptedDrafter(
        llm.engine.drafter, truth, lambda p: p % BLOCK >= BLOCK - 2
    )
    first = llm.generate(prompt, GREEDY, on_step=published_only_committed)[0]
    assert first.token_ids == plain[0].token_ids
    again = (prompt[0] + first.token_ids)[: 2 * BLOCK + 3]
    out = llm.generate([again], GREEDY)[0]
    assert out.hbm_hit_tokens == 2 * BLOCK
    assert out.token_ids == LLM(MODEL, **KW).generate([again], GREEDY)[0].token_ids


def test_one_token_tail_resume_is_exact():
    """A prefix hit leaving a one-token tail (num_tokens - 1 on a block boundary) resumes with
    an ordinary one-token span: drafts exist only for running sequences, so it is never a
    verify row. A request made of the first one's first 2 blocks + 1 token lands there."""
    prompt = prompts_of([BLOCK + 5], seed=6)
    _, plain = run(prompt, GREEDY)
    llm, first = run(prompt, GREEDY, k=3, truth=truth_of(prompt, plain))
    again = (prompt[0] + first[0].token_ids)[: 2 * BLOCK + 1]
    out = llm.generate([again], GREEDY)[0]
    assert out.hbm_hit_tokens == 2 * BLOCK and out.computed_prompt_tokens == 1
    assert out.token_ids == LLM(MODEL, **KW).generate([again], GREEDY)[0].token_ids


def test_penalties_and_logprobs_with_drafts():
    prompts = prompts_of([12, 30], seed=7)
    params = SamplingParams(
        max_tokens=24, ignore_eos=True, repetition_penalty=1.3, logprobs=3, min_tokens=4
    )
    _, plain = run(prompts, params)
    llm, spec = run(prompts, params, k=3, truth=truth_of(prompts, plain))
    assert llm.engine.stats()["speculative"]["accepted_tokens"] > 0
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
        assert len(b.logprobs) == len(b.token_ids)
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token_id == y.token_id and x.rank == y.rank
            assert abs(x.logprob - y.logprob) < 1e-4


def test_stop_token_inside_accepted_drafts_ends_the_request_there():
    prompts = prompts_of([10], seed=8)
    _, plain = run(prompts, GREEDY)
    stop = plain[0].token_ids[5]
    params = SamplingParams(max_tokens=40, stop_token_ids=[stop])
    _, plain_stop = run(prompts, params)
    _, spec = run(prompts, params, k=5, truth=truth_of(prompts, plain), wrong=lambda p: False)
    assert spec[0].token_ids == plain_stop[0].token_ids
    assert spec[0].finish_reason == plain_stop[0].finish_reason == "stop"


def test_rejection_sampling_keeps_the_target_distribution():
    """Sampler.verify with a fixed draft: the token's distribution is the target's p, whether
    the draft is p's likeliest token, an unlikely one or one p excludes (top-k)."""
    vocab, draws = 6, 12_000
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    for params, draft in (
        (SamplingParams(temperature=1.0, seed=1), 0),
        (SamplingParams(temperature=0.7, seed=2), 4),
        (SamplingParams(temperature=1.0, top_k=3, seed=3), 5),
    ):
        seq = Sequence([1], params)
        p = sampling_probs(row, params)
        sampler = Sampler(0)
        counts = torch.zeros(vocab)
        for _ in range(draws):
            tok, _ = sampler.verify(row, seq, draft)
            counts[tok] += 1
        expected = p * draws
        keep = expected > 0
        assert counts[~keep].sum() == 0
        chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
        # 99.9% quantile of chi-square with <= 5 degrees of freedom is 20.5
        assert chi2 < 20.5, (params, draft, counts.tolist(), expected.tolist())


def test_sampled_outputs_with_drafts_follow_the_same_distribution():
    """Engine level: the second output token of one prompt, sampled over many seeds with and
    without drafts (scripted drafts: the plain greedy continuation, so drafts are often
    accepted), has the same distribution (two-sample chi-square)."""
    prompt = prompts_of([9], seed=9)
    params = [SamplingParams(max_tokens=3, temperature=0.8, top_k=8, seed=s) for s in range(300)]
    greedy = run(prompt, SamplingParams(max_tokens=3, ignore_eos=True))[1]
    truth = truth_of(prompt, greedy)
    kw = dict(max_num_seqs=16, num_blocks=96)
    llm_a = LLM(MODEL, **{**KW, **kw})
    llm_b = LLM(MODEL, speculative_tokens=2, **{**KW, **kw})
    llm_b.engine.drafter = ScriptedDrafter(llm_b.engine.drafter, truth, lambda p: False)
    a = [o.token_ids[1] for o in llm_a.generate(prompt * 300, params)]
    b = [o.token_ids[1] for o in llm_b.generate(prompt * 300, params)]
    assert llm_b.engine.stats()["speculative"]["accepted_tokens"] > 0
    ca, cb = torch.bincount(torch.tensor(a), minlength=256), torch.bincount(
        torch.tensor(b), minlength=256
    )
    keep = (ca + cb) >= 10
    rest_a, rest_b = ca[~keep].sum(), cb[~keep].sum()
    ca = torch.cat([ca[keep], rest_a[None]]).double()
    cb = torch.cat([cb[keep], rest_b[None]]).double()
    tot = ca + cb
    ea, eb = tot * ca.sum() / tot.sum(), tot * cb.sum() / tot.sum()
    chi2 = float((((ca - ea) ** 2 / ea) + ((cb - eb) ** 2 / eb)).nansum())
    dof = int(keep.sum())
    # chi-square 99.9% quantile is below dof + 4.3 * sqrt(2 dof) + 10 for these sizes
    assert chi2 < dof + 4.3 * (2 * dof) ** 0.5 + 10, (chi2, dof)


def test_config_refuses_bad_speculative_tokens():
    with pytest.raises(EngineConfigError, match=r"speculative_tokens.*\[0, 5\].*got 6"):
        LLM(MODEL, speculative_tokens=6, **KW)
    with pytest.raises(EngineConfigError, match="v41-tiny.*no draft layers"):
        LLM("v41-tiny", speculative_tokens=2, **KW)
