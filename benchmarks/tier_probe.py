"""What the tier holds: a direct lookup of each prompt on the engine's LMCache server, through a
client of its own (the engine's lookup thread is not involved).

Run between passes, it separates "never stored" (the probe finds less than the ceiling) from
"stored but not used" (the probe finds it, the measured pass recomputed it).
"""

from __future__ import annotations

import time


def tier_holds(engine, prompts: list[list[int]], timeout_s: float = 30.0) -> list[int]:
    """Tokens of each prompt (less its last token, as the engine looks it up) the tier holds
    as a contiguous prefix. Locks the lookups take are freed and their sessions ended."""
    import zmq
    from lmcache.integration.atom import AtomMPParallelConfig, AtomMPSchedulerAdapter

    tier = engine.tier
    ctx = zmq.Context()
    ctx.linger = 0
    adapter = AtomMPSchedulerAdapter(
        tier.url,
        ctx,
        tier.namespace,
        engine.scheduler.block_size,
        AtomMPParallelConfig(world_size=tier.world_size, worker_id=0, tp_size=1),
        mq_timeout=timeout_s,
    )
    held = []
    try:
        for i, prompt in enumerate(prompts):
            rid, tokens = f"probe-{i}-{time.monotonic_ns()}", prompt[:-1]
            adapter.maybe_submit_lookup_request(rid, tokens)
            deadline = time.monotonic() + timeout_s
            hit = None
            while hit is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"probe lookup {i} not answered in {timeout_s} s")
                hit = adapter.check_lookup_result(rid)
            adapter.cleanup_lookup_result(rid)
            if hit:
                adapter.free_lookup_locks(tokens, 0, int(hit), rid)
            adapter.end_session(rid)
            held.append(int(hit))
    finally:
        adapter.shutdown()
        ctx.term()
    return held
