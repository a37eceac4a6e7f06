"""Progress against a filled tier (real LMCache server): tight pools whose admissions hold
landed loads finish within a bound on steps, with pass-1 outputs; and loads start at the
resident frontier even after the shared prefix's image was evicted."""

from __future__ import annotations

import random

import pytest

from atom import SamplingParams
from atom.engine.sequence import Sequence

from .conftest import BLOCK
from .test_tier_hits import record_loads
from .test_two_pass import GREEDY, prompts_of, tier


def drive(llm, prompts, params, max_steps: int = 2000) -> list[Sequence]:
    """Run ``prompts`` to completion, checking integrity after every step; fails past
    ``max_steps`` steps (a deadlock: steps that run nothing forever count too)."""
    eng = llm.engine
    seqs = [eng.add_request(list(p), params) for p in prompts]
    stuck = 0
    for _ in range(max_steps):
        if all(s.is_finished for s in seqs):
            return seqs
        ran = eng.run_once().ran  # waits for the tier's progress when nothing can run
        eng.check_integrity()
        stuck = 0 if ran or eng.tier_busy() else stuck + 1
        assert stuck < 3, f"nothing can run and nothing is in flight (a deadlock): {seqs}"
    raise AssertionError(f"no progress after {max_steps} steps: {seqs}")


def fill(server, make_llm, prompts, params) -> list[list[int]]:
    """Pass 1 on a roomy engine: the tier holds every boundary; returns the outputs."""
    first = make_llm(**tier(server))
    outs = drive(first, prompts, params)
    first.shutdown()  # stores drain before it returns
    return [s.output for s in outs]


@pytest.mark.parametrize(
    "lengths, pool",
    [
        ([37, 37], dict(num_blocks=8)),  # both loads landed, neither could start: a deadlock
        ([100, 31], dict(num_blocks=10, max_num_batched_tokens=16)),  # preempted forever
    ],
)
def test_tight_pools_reading_a_filled_tier_finish(lmcache_server, make_llm, lengths, pool):
    prompts = prompts_of(lengths, seed=sum(lengths) + pool["num_blocks"])
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    want = fill(lmcache_server, make_llm, prompts, params)
    tight = make_llm(**tier(lmcache_server), **pool)
    got = drive(tight, prompts, params)
    assert [s.output for s in got] == want
    assert sum(s.counters.tier_hit_tokens for s in got) > 0  # the tier was read


@pytest.mark.parametrize("seed", range(4))
def test_random_tight_pools_with_a_filled_tier_finish_with_pass_1_outputs(
    lmcache_server, make_llm, seed
):
    rng = random.Random(100 + seed)
    num_blocks = rng.choice([8, 10, 12])
    room = num_blocks * BLOCK
    lengths = [rng.randrange(BLOCK, room - 8) for _ in range(6)]
    prompts = prompts_of(lengths, seed=200 + seed)
    for i in range(1, len(prompts)):  # some share a prefix with an earlier prompt
        if rng.random() < 0.5:
            keep = min(len(prompts[i]) - 1, rng.randrange(BLOCK, 3 * BLOCK))
            prompts[i] = prompts[i - 1][:keep] + prompts[i][keep:]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    want = fill(lmcache_server, make_llm, prompts, params)
    tight = make_llm(
        **tier(lmcache_server),
        num_blocks=num_blocks,
        max_num_seqs=rng.choice([1, 2, 4]),
        max_num_batched_tokens=rng.choice([16, 32, 64]),
    )
    got = drive(tight, prompts, params)
    assert [s.output for s in got] == want
    for s in got:
        c = s.counters
        assert c.hbm_hit_tokens + c.tier_hit_tokens + c.computed_prompt_tokens == len(s.prompt)


def test_a_load_starts_at_the_resident_frontier_when_the_prefix_image_is_gone(
    lmcache_server, make_llm
):
    """The shared prefix's blocks stay resident but its image is evicted: the next request's
    tier load covers only the tail past the resident blocks (it restores the state at its own
    end), and its output equals the full recompute's."""
    pre = prompts_of([3 * BLOCK], seed=301)[0]
    tails = prompts_of([2 * BLOCK + 5, 2 * BLOCK + 9], seed=302)
    a, b = pre + tails[0], pre + tails[1]
    want = fill(lmcache_server, make_llm, [a, b], GREEDY)
    llm = make_llm(**tier(lmcache_server))
    eng = llm.engine
    # a run of the prefix alone leaves its blocks resident (and an image, evicted below)
    llm.generate([pre], SamplingParams(max_tokens=1))
    eng.run_until(lambda: not eng.tier_busy())  # its saves drain (they pin their images)
    while eng.store.evict_fewest_dependents():
        pass
    assert eng.scheduler.local_hit(Sequence(b, GREEDY)).tokens == 0  # no image: no local hit
    loads = record_loads(llm)
    out = llm.generate([b], GREEDY, on_step=lambda e: e.check_integrity())[0]
    # the prefix's 3 blocks are resident: the load starts there, not at 0
    frontier = 3 * BLOCK
    assert loads == [(frontier, 5 * BLOCK, 5 * BLOCK)]
    assert (out.hbm_hit_tokens, out.tier_hit_tokens) == (frontier, 2 * BLOCK)
    assert out.token_ids == want[1]


def test_a_failed_frontier_load_recomputes_from_the_last_ready_image(lmcache_server, make_llm):
    """The same frontier load, failing (injected: the real server cannot fail on cue): there is
    no state at the frontier, so the request resumes from the last READY image at or below it
    (none here: from 0) and computes what the oracle computes."""
    pre = prompts_of([3 * BLOCK], seed=311)[0]
    b = pre + prompts_of([2 * BLOCK + 9], seed=312)[0]
    want = fill(lmcache_server, make_llm, [b], GREEDY)
    # the failure is injected where the server's retrieve is submitted: lmcache_driven loads
    # (engine-driven loads that cannot be copied go the same way: test_engine_driven.py)
    llm = make_llm(**tier(lmcache_server, load_mode="lmcache_driven"))
    eng, conn = llm.engine, llm.engine.scheduler.connector
    llm.generate([pre], SamplingParams(max_tokens=1))
    eng.run_until(lambda: not eng.tier_busy())
    while eng.store.evict_fewest_dependents():
        pass
    loads = record_loads(llm)
    inner = conn.transfers.submit

    def fail_loads(op):
        if op.kind != "load":
            return inner(op)
        op.resolve(False, "injected failure")
        conn.post(op)

    conn.transfers.submit = fail_loads
    out = llm.generate([b], GREEDY, on_step=lambda e: e.check_integrity())[0]
    assert loads == [(3 * BLOCK, 5 * BLOCK, 5 * BLOCK)]
    assert out.token_ids == want[0]
    assert (out.hbm_hit_tokens, out.tier_hit_tokens) == (0, 0)
    assert out.computed_prompt_tokens == len(b)
