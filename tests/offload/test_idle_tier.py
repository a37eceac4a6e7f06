"""A tier with nothing to move costs nothing (issue 39, item 5): once the stores are done its
threads block, running no polling round and using no CPU, against the real LMCache server."""

from __future__ import annotations

from atom.thread_cpu import cpu_used, thread_cpu_seconds

from .conftest import BLOCK
from .test_tier_faults import pump, settled
from .test_two_pass import GREEDY, prompts_of, tier

IDLE_WINDOW_S = 0.5  # observed in waits of 0.05 s: a poll every 0.5 ms would run ~1,000 rounds


def test_an_idle_tier_runs_no_polling_rounds_and_its_threads_use_no_cpu(lmcache_server, make_llm):
    llm = make_llm(**tier(lmcache_server))
    [prompt] = prompts_of([3 * BLOCK + 5], seed=39_500)  # a seed no other test uses
    llm.generate([prompt], GREEDY)
    pump(llm, lambda: settled(llm), "the stores")
    eng = llm.engine
    rounds = eng.metrics._metrics["atom_tier_transfer_rounds_total"]
    before_rounds, before_cpu = rounds.read(), thread_cpu_seconds()
    assert before_rounds > 0  # the stores were polled
    for _ in range(int(IDLE_WINDOW_S / 0.05)):
        eng.step()  # nothing to run, nothing in flight
        eng.wait_for_progress(0.05)
    used = cpu_used(before_cpu, thread_cpu_seconds())
    assert rounds.read() - before_rounds <= 1  # at most the round that was ending
    for name in ("atom-lmcache-transfer", "atom-lmcache-lookup"):
        assert used[name] < 0.005, (name, used[name])
    rendered = eng.metrics.render()
    assert 'atom_thread_cpu_seconds_total{thread="atom-lmcache-transfer"}' in rendered
