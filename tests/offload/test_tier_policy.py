"""The tier does what its config restricts, by the server's own account (real LMCache server).

``save: false`` (a replica that only reads a shared cache): no store reaches the server on any
path, whatever the engine's own counters say: the issue-42 scenario (a request admitted at once
because its HBM hit covers all the tier could add, whose lookup answer arrives later), tight
pools that preempt, a request that loads a prefix and computes the rest, speculative decoding.
Each path is checked to have run (a preemption, an HBM hit, a tier hit, drafts). ``load:
false`` sends no lookup and loads nothing; ``load_mode`` decides who copies a load (the server
retrieves every load lmcache_driven, none engine_driven). Across ranks: tests/distributed/
test_tp_tier_policy.py.
"""

from __future__ import annotations

import itertools

import pytest

from atom import SamplingParams

from .server_view import ServerView
from .test_engine_driven import mapped
from .test_two_pass import GREEDY, ceiling, prompts_of, tier

CHECK = dict(on_step=lambda e: e.check_integrity())
MARKER_SEEDS = itertools.count(42_000)  # a fresh prompt per marker: always a miss


@pytest.fixture()
def view(lmcache_server, make_llm):
    """The session server's view, and a marker that settles its readings."""
    v = ServerView(lmcache_server)

    def mark() -> tuple[float, float]:
        llm = make_llm(**tier(lmcache_server))
        llm.generate(prompts_of([40], seed=next(MARKER_SEEDS)), GREEDY)
        llm.shutdown()  # its stores drain before it returns
        m = llm.engine.scheduler.connector.tier_metrics
        return m.saves.get(outcome="done"), m.lookups.total()

    v.mark = mark
    return v


def tier_hits(make_llm, server, prompts, **cfg) -> list[int]:
    """A fresh engine's tier hits on ``prompts`` (what the server holds of them)."""
    llm = make_llm(**tier(server, **cfg))
    out = llm.generate(prompts, GREEDY, **CHECK)
    llm.shutdown()
    return [o.tier_hit_tokens for o in out]


def saves_of(llm) -> float:
    return llm.engine.scheduler.connector.tier_metrics.saves.total()


def test_issue_42_a_load_only_engine_never_writes(lmcache_server, make_llm, view):
    before = view.read()
    prompt = prompts_of([49], seed=4201)
    one = make_llm(**tier(lmcache_server, save=False))
    one.generate(prompt, GREEDY, **CHECK)
    again = one.generate(prompt, GREEDY, **CHECK)[0]
    # the second run is admitted at once (HBM covers every chunk the tier could add); its
    # lookup's answer arrives later and is settled without it
    assert again.hbm_hit_tokens == ceiling(49) and again.tier_hit_tokens == 0
    one.shutdown()
    assert saves_of(one) == 0
    assert tier_hits(make_llm, lmcache_server, prompt, save=False) == [0]
    assert view.settled(before, view.mark).stores == 0


def test_save_off_stores_nothing_through_preemption(lmcache_server, make_llm, view):
    before = view.read()
    prompts = prompts_of([64, 64, 57], seed=4202)
    llm = make_llm(**tier(lmcache_server, save=False), num_blocks=14, max_num_seqs=3)
    llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True), **CHECK)
    assert llm.engine.scheduler.preemptions > 0, "the pool never preempted"
    llm.shutdown()
    assert saves_of(llm) == 0
    assert view.settled(before, view.mark).stores == 0
    assert tier_hits(make_llm, lmcache_server, prompts, save=False) == [0, 0, 0]


def test_save_off_stores_nothing_past_a_loaded_prefix(lmcache_server, make_llm, view):
    prefix = prompts_of([33], seed=4203)[0]
    longer = [prefix + prompts_of([60], seed=4204)[0]]
    assert tier_hits(make_llm, lmcache_server, [prefix]) == [0]  # save on: stores [0, 32)
    before = view.read()
    reader = make_llm(**tier(lmcache_server, save=False))
    out = reader.generate(longer, GREEDY, **CHECK)[0]
    assert out.tier_hit_tokens == 32, "the prefix was not loaded"
    reader.shutdown()
    assert saves_of(reader) == 0
    assert view.settled(before, view.mark).stores == 0
    # the server still holds the stored prefix only, not the span the reader computed
    assert tier_hits(make_llm, lmcache_server, longer, save=False) == [32]


def test_save_off_stores_nothing_under_speculative_decoding(lmcache_server, make_llm, view):
    before = view.read()
    prompts = prompts_of([40, 77], seed=4205)
    cfg = tier(lmcache_server, save=False)
    llm = make_llm("v41-tiny-draft", speculative_tokens=3, **cfg)
    llm.generate(prompts, GREEDY, **CHECK)
    llm.generate(prompts, GREEDY, **CHECK)  # again: admitted at once from HBM
    assert llm.engine.stats()["speculative"]["draft_tokens"] > 0, "no draft was verified"
    llm.shutdown()
    assert saves_of(llm) == 0
    assert view.settled(before, view.mark).stores == 0
    llm2 = make_llm("v41-tiny-draft", speculative_tokens=3, **cfg)
    assert [o.tier_hit_tokens for o in llm2.generate(prompts, GREEDY)] == [0, 0]


def test_load_off_sends_no_lookup_and_loads_nothing(lmcache_server, make_llm, view):
    prompts = prompts_of([40, 77], seed=4206)
    assert tier_hits(make_llm, lmcache_server, prompts) == [0, 0]  # stores them
    before = view.read()
    assert tier_hits(make_llm, lmcache_server, prompts, load=False) == [0, 0]
    got = view.settled(before, view.mark)
    assert (got.lookups, got.retrieves) == (0, 0)
    # the control: the same prompts do hit with loads on
    assert tier_hits(make_llm, lmcache_server, prompts) == [ceiling(40), ceiling(77)]


@pytest.mark.parametrize("mode", ["engine_driven", "lmcache_driven"])
def test_load_mode_decides_who_copies_every_load(lmcache_server, make_llm, view, mode):
    prompts = prompts_of([40, 77, 64], seed=4207 if mode == "engine_driven" else 4208)
    assert tier_hits(make_llm, lmcache_server, prompts) == [0, 0, 0]  # stores them
    before = view.read()
    llm = make_llm(**tier(lmcache_server, load_mode=mode))
    if mode == "engine_driven":
        mapped(llm)  # before the first hit: else it loads through the server
    out = llm.generate(prompts, GREEDY, **CHECK)
    assert [o.tier_hit_tokens for o in out] == [ceiling(len(p)) for p in prompts]
    llm.shutdown()
    got = view.settled(before, view.mark)
    assert got.retrieves == (len(prompts) if mode == "lmcache_driven" else 0)
