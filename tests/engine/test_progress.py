"""The engine always makes progress: tight pools and many requests finish within a bound on
steps, with outputs equal to the oracle and the pool's invariants after every step."""

from __future__ import annotations

import random

import pytest

from atom import LLM, SamplingParams
from atom.engine.engine import LLMEngine

from .test_engine_oracle import assert_greedy_matches_oracle

TINY = dict(block_size=16, dtype="float32", kv_dtype="fp32", index_dtype="fp32", device="cpu")


def drive(engine: LLMEngine, seqs, max_steps: int) -> int:
    """Run until every sequence finished; fails past ``max_steps`` steps (a livelock or a
    deadlock: a step that runs nothing forever counts too). Returns the steps taken."""
    stuck = 0
    for step in range(max_steps):
        if all(s.is_finished for s in seqs):
            return step
        ran = engine.run_once(lambda timeout: None).ran
        engine.check_integrity()
        stuck = 0 if ran or engine.tier_busy() else stuck + 1
        assert stuck < 3, f"nothing can run and nothing is in flight (a deadlock): {seqs}"
    raise AssertionError(f"no progress after {max_steps} steps: {seqs}")


def random_workload(rng: random.Random, num_blocks: int, n: int) -> tuple[list, list]:
    """Prompts (some sharing prefixes) and max_tokens that each fit the pool on their own."""
    room = num_blocks * 16
    prompts, max_tokens = [], []
    for _ in range(n):
        length = rng.randrange(1, room - 2)
        if prompts and rng.random() < 0.5:
            base = rng.choice(prompts)[: rng.randrange(1, room - 2)]
        else:
            base = []
        tail = [rng.randrange(256) for _ in range(max(0, length - len(base)))]
        prompt = (base + tail)[:length]
        prompts.append(prompt)
        max_tokens.append(rng.randrange(1, min(12, room - len(prompt) + 1) + 1))
    return prompts, max_tokens


@pytest.mark.parametrize("seed", range(6))
def test_random_tight_pools_always_finish_and_match_the_oracle(seed):
    rng = random.Random(seed)
    num_blocks = rng.choice([4, 6, 8, 10])
    llm = LLM(
        "v41-tiny",
        num_blocks=num_blocks,
        max_num_seqs=rng.choice([1, 2, 4, 8]),
        max_num_batched_tokens=rng.choice([16, 24, 40, 64]),
        **TINY,
    )
    eng = llm.engine
    prompts, max_tokens = random_workload(rng, num_blocks, 10)
    seqs = [
        eng.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True))
        for p, m in zip(prompts, max_tokens)
    ]
    drive(eng, seqs, max_steps=3000)
    model = eng.runtime.model
    for s in seqs:
        assert len(s.output) == s.max_tokens
        assert_greedy_matches_oracle(model, s.prompt, s.output)
        c = s.counters
        assert c.hbm_hit_tokens + c.tier_hit_tokens + c.computed_prompt_tokens == len(s.prompt)


def test_preempted_requests_count_what_they_computed_not_their_own_blocks_as_hits():
    """Unique prompts in a pool that forces preemption: a preempted request resumes from its own
    blocks, which it computed; nothing came from another request's cache."""
    llm = LLM("v41-tiny", num_blocks=8, max_num_seqs=4, max_num_batched_tokens=64, **TINY)
    eng = llm.engine
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(40)] for _ in range(4)]
    seqs = [eng.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in prompts]
    drive(eng, seqs, max_steps=3000)
    assert sum(s.counters.preemptions for s in seqs) > 0, "the pool should force preemption"
    for s in seqs:
        c = s.counters
        assert (c.hbm_hit_tokens, c.tier_hit_tokens, c.computed_prompt_tokens) == (0, 0, 40)
        assert_greedy_matches_oracle(eng.runtime.model, s.prompt, s.output)


def test_the_oldest_request_is_never_preempted_by_a_newer_one():
    llm = LLM("v41-tiny", num_blocks=8, max_num_seqs=4, max_num_batched_tokens=64, **TINY)
    eng = llm.engine
    rng = random.Random(8)
    seqs = [
        eng.add_request(
            [rng.randrange(256) for _ in range(30)], SamplingParams(max_tokens=60, ignore_eos=True)
        )
        for _ in range(3)
    ]
    drive(eng, seqs, max_steps=3000)
    assert seqs[0].counters.preemptions == 0
    assert sum(s.counters.preemptions for s in seqs[1:]) > 0


def test_a_hit_whose_image_fills_the_pool_is_computed_instead_of_waited_for():
    """8 blocks of 16: a 96-token run leaves 6 cached blocks and a READY image (2 units) at
    96; a 102-token prompt extending it hits all of that, which leaves no block for its tail,
    and nothing running will free one: it must compute instead of waiting forever."""
    llm = LLM("v41-tiny", num_blocks=8, max_num_seqs=2, max_num_batched_tokens=32, **TINY)
    eng = llm.engine
    prompt = [random.Random(9).randrange(256) for _ in range(102)]
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    drive(eng, [eng.add_request(prompt[:96], params)], max_steps=200)
    again = eng.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    hit = eng.scheduler.local_hit(again)
    assert hit.tokens == 96 and len(hit.blocks) + eng.spec.units_per_image == 8
    drive(eng, [again], max_steps=200)
    assert_greedy_matches_oracle(eng.runtime.model, again.prompt, again.output)
