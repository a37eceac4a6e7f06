"""Server faults against a real LMCache server of the test's own: killed, frozen, absent at
start, restarted. The engine never stops, never gives a wrong token (the reference is an engine
without a tier), holds blocks of transfers of unknown fate, and uses the tier again once the
server is back."""

from __future__ import annotations

import signal

from atom.tier.operations import TransferOp
from atom.tier.server.lmcache_server import probe

from .test_two_pass import GREEDY, ceiling, prompts_of, tier

FAST = dict(transfer_timeout_s=0.5, lookup_timeout_s=0.5)


def check(engine) -> None:
    engine.check_integrity()


def pump(llm, cond, what: str, rounds: int = 150) -> None:
    """Step the (idle) engine, so it folds tier outcomes, until ``cond()``; at most
    ``rounds`` waits of 0.2 s."""
    eng = llm.engine
    for _ in range(rounds):
        eng.step()
        eng.check_integrity()
        if cond():
            return
        eng.wait_for_progress(0.2)
    raise AssertionError(f"gave up waiting for {what}: {eng.tier_health()}")


def healthy(llm) -> bool:
    return llm.engine.tier_health()["healthy"]


def settled(llm) -> bool:
    """Nothing outstanding with the tier: no transfer, lookup, lease or quarantine."""
    conn = llm.engine.scheduler.connector
    return not conn.busy() and not conn.leases() and not conn.quarantined


def visible(llm, prompts) -> bool:
    """The server's own lookups (LMCache's scheduler adapter, not the engine's) find every
    prompt's stored prefix up to its ceiling. A store's future resolves a few milliseconds
    before its objects are visible to lookups (lmcache 0.5.6 commits them on a thread of its
    own), so a pass that must hit right after its stores settled waits for this too.
    Lock-free afterwards: each lookup's locks are freed."""
    from .test_engine_saves import lookup_hit

    tier = llm.engine.tier
    return all(
        lookup_hit(tier.url, tier.namespace, list(p), f"visible-{i}") >= ceiling(len(p))
        for i, p in enumerate(prompts)
    )


def same_tokens(got, want) -> None:
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(o.finish_reason == "length" for o in got)


def stores_then_hits(llm, prompts, reference) -> None:
    """With an empty tier: a pass from an empty prefix cache misses and stores, and the
    next pass (prefix cache emptied again) resumes every prompt from the tier."""
    conn = llm.engine.scheduler.connector
    saved = conn.tier_metrics.saves.get(outcome="done")
    misses = conn.tier_metrics.lookups.get(outcome="miss")
    llm.engine.reset_prefix_cache()
    out = llm.generate(prompts, GREEDY, on_step=check)
    same_tokens(out, reference)
    assert [o.tier_hit_tokens for o in out] == [0] * len(prompts)
    assert conn.tier_metrics.lookups.get(outcome="miss") == misses + len(
        prompts
    )  # answered, not lost
    pump(llm, lambda: settled(llm) and visible(llm, prompts), "the stores to be visible")
    assert conn.tier_metrics.saves.get(outcome="done") > saved
    llm.engine.reset_prefix_cache()
    out = llm.generate(prompts, GREEDY, on_step=check)
    same_tokens(out, reference)
    assert [o.tier_hit_tokens for o in out] == [ceiling(len(p)) for p in prompts]
    pump(llm, lambda: settled(llm), "the tier to settle")


def test_sigkill_mid_run_no_wrong_outputs_quarantine_then_recovery(
    own_server, make_llm, monkeypatch
):
    own_server.start()
    old = prompts_of([40, 77, 100, 129, 64, 90], seed=201)  # stored by pass 1
    new = prompts_of([70, 95, 110, 60], seed=202)  # saves in pass 2
    reference = make_llm().generate(old + new, GREEDY)
    # loads the server copies, so that transfers of unknown fate are in flight when it dies
    # (engine-driven loads finish without the server: test_engine_driven.py kills it too)
    llm = make_llm(**tier(own_server, load_mode="lmcache_driven", **FAST))
    eng, conn = llm.engine, llm.engine.scheduler.connector
    same_tokens(llm.generate(old, GREEDY, on_step=check), reference[: len(old)])
    pump(llm, lambda: settled(llm), "pass 1's stores")
    assert conn.tier_metrics.saves.get(outcome="done") > 0

    eng.reset_prefix_cache()
    killed: list[TransferOp] = []
    submitted = TransferOp.mark_submitted

    def kill_once_sent(op, future):
        # the server dies just after it was handed pass 2's first transfer, which it has not
        # answered: that transfer's fate is unknown (killed at a step boundary instead, the
        # transfers were at times all still queued, and failed as never sent, a known fate)
        submitted(op, future)
        if not killed:
            killed.append(op)
            own_server.signal(signal.SIGKILL)

    monkeypatch.setattr(TransferOp, "mark_submitted", kill_once_sent)
    out2 = llm.generate(old + new, GREEDY, on_step=check)
    assert killed and not own_server.running
    same_tokens(out2, reference)  # the engine kept serving, and every token is right
    # transfers of unknown fate hold their blocks while the server is dead
    pump(llm, lambda: conn.quarantined_blocks > 0 and not healthy(llm), "a quarantine")
    assert (
        conn.tier_metrics.loads.get(outcome="late") + conn.tier_metrics.saves.get(outcome="late")
        >= 1
    )
    assert sum(conn.leases().values()) >= conn.quarantined_blocks > 0

    own_server.start()  # the same port; its L1 is empty
    pump(llm, lambda: healthy(llm) and settled(llm), "re-registration and the quarantine's end")
    assert conn.quarantined_blocks == 0 and eng.stats()["running"] == 0
    stores_then_hits(llm, old, reference[: len(old)])


def test_sigstop_past_the_deadline_recomputes_then_hits_after_sigcont(own_server, make_llm):
    own_server.start()
    prompts = prompts_of([50, 77, 100, 64, 129], seed=211)
    reference = make_llm().generate(prompts, GREEDY)
    # loads the server copies (a stopped server cannot): engine-driven loads copy from its
    # shared-memory L1 without it (test_engine_driven.py)
    llm = make_llm(**tier(own_server, load_mode="lmcache_driven", **FAST))
    eng, conn = llm.engine, llm.engine.scheduler.connector
    same_tokens(llm.generate(prompts, GREEDY, on_step=check), reference)
    pump(llm, lambda: settled(llm), "pass 1's stores")

    # freeze the server just before pass 2's first load is handed to it
    inner, frozen = conn.start_load, []

    def start_load(seq, start, end, blocks, image):
        if not frozen:
            own_server.signal(signal.SIGSTOP)
            frozen.append(end)
        return inner(seq, start, end, blocks, image)

    conn.start_load = start_load
    eng.reset_prefix_cache()
    try:
        out2 = llm.generate(prompts, GREEDY, on_step=check)
        same_tokens(out2, reference)  # late loads were recomputed
        assert frozen and conn.tier_metrics.loads.get(outcome="late") >= 1
        assert conn.tier_metrics.loads.get(outcome="done") == 0
        assert sum(o.tier_hit_tokens for o in out2) == 0
        assert conn.quarantined_blocks > 0 and conn.leases()  # the late loads' destinations
    finally:
        own_server.signal(signal.SIGCONT)
    conn.start_load = inner
    pump(llm, lambda: healthy(llm) and settled(llm), "the quarantine to end after SIGCONT")
    assert conn.quarantined_blocks == 0

    eng.reset_prefix_cache()  # the server kept its L1: every prompt hits again
    out3 = llm.generate(prompts, GREEDY, on_step=check)
    same_tokens(out3, reference)
    assert [o.tier_hit_tokens for o in out3] == [ceiling(len(p)) for p in prompts]
    pump(llm, lambda: settled(llm), "the tier to settle")


def test_server_absent_at_start_serves_then_registers_in_the_background(own_server, make_llm):
    # own_server is not started: its port (from free_port) has no server yet
    assert not own_server.running and not probe(own_server.url, 0.2)
    prompts = prompts_of([45, 80, 100, 33], seed=221)
    reference = make_llm().generate(prompts, GREEDY)
    llm = make_llm(**tier(own_server, **FAST))
    conn = llm.engine.scheduler.connector
    assert llm.engine.tier_health()["healthy"] is False
    out1 = llm.generate(prompts, GREEDY, on_step=check)
    same_tokens(out1, reference)
    assert [o.tier_hit_tokens for o in out1] == [0] * len(prompts)
    assert conn.tier_metrics.saves.total() == 0 and conn.tier_metrics.loads.total() == 0
    assert llm.engine.tier_health()["healthy"] is False

    own_server.start()
    pump(llm, lambda: healthy(llm), "registration with the late server")
    assert llm.engine.tier_health()["registrations"] == 1
    stores_then_hits(llm, prompts, reference)


def test_restarted_server_starts_empty_then_stores_and_hits(own_server, make_llm):
    own_server.start()
    prompts = prompts_of([45, 80, 100, 64], seed=231)
    reference = make_llm().generate(prompts, GREEDY)
    llm = make_llm(**tier(own_server, **FAST))
    conn = llm.engine.scheduler.connector
    same_tokens(llm.generate(prompts, GREEDY, on_step=check), reference)
    pump(llm, lambda: settled(llm), "pass 1's stores")
    assert conn.tier_metrics.saves.get(outcome="done") > 0

    own_server.stop()
    pump(llm, lambda: not healthy(llm), "the engine to notice the outage")
    own_server.start()  # the same port, an empty L1
    pump(llm, lambda: healthy(llm), "re-registration")
    stores_then_hits(llm, prompts, reference)


def test_restarted_server_gets_prefixes_still_in_hbm_stored_again(own_server, make_llm):
    own_server.start()
    prompts = prompts_of([45, 80, 100, 64], seed=241)
    reference = make_llm().generate(prompts, GREEDY)
    llm = make_llm(**tier(own_server, **FAST))
    conn = llm.engine.scheduler.connector
    same_tokens(llm.generate(prompts, GREEDY, on_step=check), reference)
    pump(llm, lambda: settled(llm), "pass 1's stores")
    saved, misses = conn.tier_metrics.saves.get(outcome="done"), conn.tier_metrics.lookups.get(
        outcome="miss"
    )
    assert saved > 0

    own_server.stop()
    pump(llm, lambda: not healthy(llm), "the engine to notice the outage")
    own_server.start()  # the same port, an empty L1
    pump(llm, lambda: healthy(llm), "re-registration")
    # the prefix cache is kept: HBM serves every prompt, the tier answers a miss for each
    out2 = llm.generate(prompts, GREEDY, on_step=check)
    same_tokens(out2, reference)
    assert [o.hbm_hit_tokens for o in out2] == [ceiling(len(p)) for p in prompts]
    assert [o.tier_hit_tokens for o in out2] == [0] * len(prompts)
    assert conn.tier_metrics.lookups.get(outcome="miss") == misses + len(prompts)
    pump(llm, lambda: settled(llm), "the stores to finish")
    # the tier lost what it held, so what pass 2 used is stored again ...
    assert conn.tier_metrics.saves.get(outcome="done") > saved
    # ... and a pass from an empty prefix cache resumes from the tier
    llm.engine.reset_prefix_cache()
    out3 = llm.generate(prompts, GREEDY, on_step=check)
    same_tokens(out3, reference)
    assert [o.tier_hit_tokens for o in out3] == [ceiling(len(p)) for p in prompts]
