"""The tier under speculative decoding, against the real LMCache server: images (and so tier
saves) hold accepted tokens only, pass 2 resumed from the tier equals pass 1 and plain decoding,
requests resumed from the tier share steps with other requests' verify spans, and engines with
another ``speculative_tokens`` never read each other's objects."""

from __future__ import annotations

import pytest

from atom import SamplingParams

from ..engine.test_speculative import ScriptedDrafter
from .conftest import BLOCK
from .test_two_pass import ceiling, prompts_of, tier

MODEL = "v41-tiny-draft"
GREEDY = SamplingParams(max_tokens=2 * BLOCK, ignore_eos=True)


def scripted(llm, truth, wrong=lambda p: p % 5 == 0):
    llm.engine.drafter = ScriptedDrafter(llm.engine.drafter, truth, wrong)
    return llm


@pytest.fixture(params=["eager", "graphs"])
def graphs(request):
    """Engines built in the test run eagerly, or replay fake span graphs (verify and draft
    forwards through ``EagerBackend``: everything but the CUDA graph itself)."""
    return request.getfixturevalue("fake_engine_graphs") if request.param == "graphs" else []


def test_two_pass_with_drafts_equals_plain_and_resumes_at_the_ceiling(
    lmcache_server, make_llm, graphs
):
    prompts = prompts_of([40, 77, 100, 16, 63, 64], seed=11)
    plain = make_llm(MODEL).generate(prompts, GREEDY)
    truth = {tuple(p): p + o.token_ids for p, o in zip(prompts, plain)}
    first = scripted(make_llm(MODEL, speculative_tokens=3, **tier(lmcache_server)), truth)
    out1 = first.generate(prompts, GREEDY, on_step=lambda e: e.check_integrity())
    assert first.engine.stats()["speculative"]["accepted_tokens"] > 0
    first.shutdown()  # stores drain before it returns
    # pass 2: resumed requests are admitted while earlier ones verify drafts (4 slots, 6
    # requests, a 32-token budget: admissions and verify spans share steps)
    second = scripted(make_llm(MODEL, speculative_tokens=3, **tier(lmcache_server)), truth)
    mixed = []

    def watch(engine):
        engine.check_integrity()

    inner = second.engine.runner.execute

    def execute(spans, *a, **kw):
        if any(sp.drafts for sp in spans) and any(sp.restore is not None for sp in spans):
            mixed.append(len(spans))
        return inner(spans, *a, **kw)

    second.engine.runner.execute = execute
    out2 = second.generate(prompts, GREEDY, on_step=watch)
    got = sum(o.tier_hit_tokens for o in out2)
    ceil = sum(ceiling(len(p)) for p in prompts)
    assert got >= 0.99 * ceil, f"tier hit {got} of ceiling {ceil}"
    assert mixed, "no step mixed a tier-resumed admission with a verify span"
    for a, b, c in zip(plain, out1, out2):
        assert a.token_ids == b.token_ids == c.token_ids
    for rt in graphs[1:]:  # both passes verified and drafted in graphs
        assert rt.span_graphs.replays["verify"] > 5 and rt.span_graphs.replays["draft"] > 5
        assert not rt.span_graphs.failed


def test_v4_two_pass_with_drafts_equals_plain_at_the_ceiling(lmcache_server, make_llm):
    """V4 (v4-tiny's MTP block): both passes with drafts (rejections every 5 positions) equal
    plain decoding; pass 2 resumes from the tier at the reuse ceiling."""
    model = "v4-tiny"
    prompts = prompts_of([40, 77, 100, 16, 63], seed=15)
    plain = make_llm(model).generate(prompts, GREEDY)
    truth = {tuple(p): p + o.token_ids for p, o in zip(prompts, plain)}
    outs = []
    for _ in range(2):
        llm = scripted(make_llm(model, speculative_tokens=3, **tier(lmcache_server)), truth)
        outs.append(llm.generate(prompts, GREEDY, on_step=lambda e: e.check_integrity()))
        assert llm.engine.stats()["speculative"]["accepted_tokens"] > 0
        llm.shutdown()
    got = sum(o.tier_hit_tokens for o in outs[1])
    ceil = sum(ceiling(len(p)) for p in prompts)
    assert got >= 0.99 * ceil, f"tier hit {got} of ceiling {ceil}"
    for a, b, c in zip(plain, *outs):
        assert a.token_ids == b.token_ids == c.token_ids


@pytest.mark.parametrize("model", [MODEL, "v4-tiny"])
def test_decode_boundaries_saved_with_drafts_resume_exactly(lmcache_server, make_llm, model):
    """Images taken at block boundaries crossed while decoding with drafts (rejections right
    before each boundary) are saved; a request whose prompt is prompt + output resumes from
    them and continues as plain decoding does."""
    MODEL = model  # noqa: N806  (the body as for V4.1's draft model)
    prompt = prompts_of([BLOCK + 7], seed=12)
    plain = make_llm(MODEL).generate(prompt, GREEDY)[0]
    truth = {tuple(prompt[0]): prompt[0] + plain.token_ids}
    first = scripted(
        make_llm(MODEL, speculative_tokens=5, **tier(lmcache_server)),
        truth,
        wrong=lambda p: p % BLOCK == BLOCK - 1,
    )
    assert first.generate(prompt, GREEDY)[0].token_ids == plain.token_ids
    first.shutdown()
    longer = (prompt[0] + plain.token_ids)[: 3 * BLOCK + 2]
    want = make_llm(MODEL).generate([longer], GREEDY)[0]
    second = make_llm(MODEL, speculative_tokens=5, **tier(lmcache_server))
    got = second.generate([longer], GREEDY)[0]
    assert got.tier_hit_tokens == 3 * BLOCK  # the boundaries at 32 and 48 were decode ones
    assert got.token_ids == want.token_ids


def test_engines_with_another_speculative_tokens_share_no_object(lmcache_server, make_llm):
    prompts = prompts_of([70, 90], seed=13)
    first = make_llm(MODEL, speculative_tokens=2, **tier(lmcache_server))
    out1 = first.generate(prompts, GREEDY)
    first.shutdown()
    for k in (0, 3):
        other = make_llm(MODEL, speculative_tokens=k, **tier(lmcache_server))
        out = other.generate(prompts, GREEDY)
        assert sum(o.tier_hit_tokens for o in out) == 0, f"k={k} read k=2's objects"
        assert [o.token_ids for o in out] == [o.token_ids for o in out1]
        other.shutdown()
    same = make_llm(MODEL, speculative_tokens=2, **tier(lmcache_server))
    assert sum(o.tier_hit_tokens for o in same.generate(prompts, GREEDY)) > 0


def _record_drafts(llm) -> dict:
    """(prompt, position) -> the DSpark drafts the engine made after that position."""
    seen: dict = {}
    rt = llm.engine.runtime
    inner = rt.draft_blocks

    def spy(tokens, positions, slots):
        got = inner(tokens, positions, slots)
        by_slot = {s.slot: s for s in llm.engine.scheduler.running}
        for p, slot, ids in zip(positions, slots, got):
            seen[(tuple(by_slot[slot].prompt), p)] = ids
        return got

    rt.draft_blocks = spy
    return seen


def test_dspark_windows_resume_from_the_tier(lmcache_server, make_llm):
    """DSpark's windows of target KV travel in the images the tier stores: pass 2, resumed
    from the tier, drafts after every position what pass 1 drafted there (the first draft
    after a resume reads only restored rows of the window), and both equal plain decoding."""
    model = "v41-tiny-dspark"
    prompts = prompts_of([40, 77, 100], seed=14)
    plain = make_llm(model).generate(prompts, GREEDY)
    first = make_llm(model, speculative_tokens=3, **tier(lmcache_server))
    seen1 = _record_drafts(first)
    out1 = first.generate(prompts, GREEDY)
    first.shutdown()
    second = make_llm(model, speculative_tokens=3, **tier(lmcache_server))
    seen2 = _record_drafts(second)
    out2 = second.generate(prompts, GREEDY)
    got, ceil = sum(o.tier_hit_tokens for o in out2), sum(ceiling(len(p)) for p in prompts)
    assert got >= 0.99 * ceil, f"tier hit {got} of ceiling {ceil}"
    for a, b, c in zip(plain, out1, out2):
        assert a.token_ids == b.token_ids == c.token_ids
    resumed = {(tuple(p), len(p) - 1) for p in prompts}
    assert resumed <= seen2.keys() and len(seen1.keys() & seen2.keys()) > 3 * BLOCK
    assert all(seen1[key] == seen2[key] for key in seen1.keys() & seen2.keys())


@pytest.mark.parametrize("rejected", [False, True], ids=["accepted", "rejected"])
def test_verify_spans_reserve_their_saves_before_the_forward(lmcache_server, make_llm, rejected):
    """Engine-driven saves with drafts: a verify span that ends on a chunk boundary reserves
    its save ahead, keyed by the tokens with its drafts. All drafts accepted: the save claims
    it. The last draft before each boundary wrong: that reservation is given back, the span
    that reaches the boundary next reserves again, and every save still claims one."""
    from .test_engine_saves import saves_of, saves_ready, saves_tier

    prompt = prompts_of([BLOCK + 7], seed=39_611 + rejected)
    plain = make_llm(MODEL).generate(prompt, GREEDY)[0]
    truth = {tuple(prompt[0]): prompt[0] + plain.token_ids}
    wrong = (lambda p: p % BLOCK == BLOCK - 1) if rejected else (lambda p: False)
    llm = scripted(
        make_llm(MODEL, speculative_tokens=5, **saves_tier(lmcache_server)), truth, wrong
    )
    saves_ready(llm)
    saves = saves_of(llm)
    at_boundary = []  # verify spans that end on a chunk boundary with their image
    inner = llm.engine.runner.execute

    def execute(spans, *a, **kw):
        at_boundary.extend(
            sp for sp in spans if sp.drafts and sp.image is not None and sp.end % BLOCK == 0
        )
        return inner(spans, *a, **kw)

    llm.engine.runner.execute = execute
    assert llm.generate(prompt, GREEDY)[0].token_ids == plain.token_ids
    llm.shutdown()  # its saves drain before it returns
    done = llm.engine.scheduler.connector.tier_metrics.saves.get(outcome="done")
    assert len(at_boundary) >= 2, at_boundary  # the decode boundaries at 32 and 48 at least
    assert saves.ahead["claimed"] == done == saves.counts["copied"], (saves.ahead, done)
    assert saves.ahead["unclaimed"] == (len(at_boundary) if rejected else 0), saves.ahead
