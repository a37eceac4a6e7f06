"""The CUDA tier two-pass, shared by the GPU tier tests: pass 1 computes and stores, pass 2 (a
fresh engine on pass 1's server) loads every reusable prefix and computes the rest.

What each arithmetic can promise, and so what the tests assert:

- Both modes: pass 2's hits, and the loaded bytes (each hit PAGE block and the image at the hit's
  end) equal to the bytes pass 1 stored, bit for bit. That is the tier's own contract.
- Batch-invariant mode (``batch_invariant=True``): pass 2's tokens and logprobs equal pass 1's,
  bit for bit, though pass 2 runs other chunks and batches (its loads land at other steps).
- The default mode: no output check. In bf16 another chunking rounds differently, and the
  sparse attention's top-k selection turns a rounding difference into another choice of keys:
  on the H200 this two-pass took a token outside pass 1's top 5 in about half the runs (at
  1d236cf, with every loaded byte equal to pass 1's), and pass 1 itself picked another first
  token from one process to the next (its batches depend on when lookups answer).
"""

from __future__ import annotations

from atom import LLM
from tests.engine.test_batch_invariant import prompt_bytes as prefix_bytes


def assert_loaded_bytes_equal(first, second, hits: list[int], block_size: int) -> None:
    """Every hit block of pass 2 holds pass 1's bytes, and so does the image at each hit's end
    (pass 2 holds only that one image of the prefix)."""
    for k, (a, b, hit) in enumerate(zip(first, second, hits)):
        n = hit // block_size
        for j in range(n):
            assert b[j][0] == a[j][0], f"request {k}: loaded PAGE block {j} differs from pass 1"
        if n:
            assert b[n - 1][1] is not None, f"request {k}: no image at the hit's end"
            assert b[n - 1][1] == a[n - 1][1], f"request {k}: the loaded image differs"


def assert_same_bits(got, want) -> None:
    """Tokens and every listed logprob equal, bit for bit (requests that listed none: none)."""
    assert len(got) == len(want), (len(got), len(want))
    for k, (g, w) in enumerate(zip(got, want)):
        assert g.token_ids == w.token_ids, f"request {k}: {g.token_ids} != {w.token_ids}"
        assert (g.logprobs is None) == (w.logprobs is None), f"request {k}: logprobs listed once"
        for j, (a, b) in enumerate(zip(g.logprobs or [], w.logprobs or [])):
            assert a.top == b.top, f"request {k} output {j}: logprobs {a.top} != {b.top}"


def two_pass(model: str, prompts, params, kw: dict, second: dict | None = None, ready=None):
    """(pass 1 outputs, pass 2 outputs, pass 2's hit tokens, facts about pass 2's tier); the
    loaded bytes are checked equal to pass 1's here.

    ``kw`` configures both engines (``offload="lmcache_mp"`` and an owned server from
    ``kw["lmcache"]``); ``second`` overrides pass 2's config (``lmcache`` there is merged
    with the server's URL). ``ready(llm)``, if given, runs on pass 1's engine before it
    generates. ``info["first_saves"]`` is pass 1's ``EngineSaves`` (None: the server's
    stores), read after its shutdown drained them."""
    second = dict(second or {})
    first = LLM(model, **kw)
    if ready is not None:
        ready(first)
    out1 = first.generate(prompts, params)
    bytes1 = [prefix_bytes(first, p, len(p) // kw["block_size"]) for p in prompts]
    server = first.engine.tier.server
    first_saves = first.engine.tier.saves
    first_done = first.engine.scheduler.connector.tier_metrics.saves
    first.engine.tier.server = None  # keep the owned server alive for pass 2
    first.shutdown()
    try:
        tier = {"url": server.url, **second.pop("lmcache", {})}
        llm = LLM(model, **{**kw, **second, "lmcache": tier})
        out2 = llm.generate(prompts, params)
        hits = [o.tier_hit_tokens for o in out2]
        bytes2 = [prefix_bytes(llm, p, h // kw["block_size"]) for p, h in zip(prompts, hits)]
        info = {
            "first_saves": first_saves,
            "first_saves_done": first_done.get(outcome="done"),
            "load_mode": llm.engine.tier.health()["load_mode"],
            "events_created": llm.engine.tier.connector.events.created,
            "copied": llm.engine.tier.connector.tier_metrics.local_loads.get(outcome="copied"),
        }
        local = llm.engine.tier.connector.local
        info["gathers"] = local.gathers if local is not None else 0
        maps = llm.engine.tier.mappings
        info["pinned"] = maps.current.pinned if maps and maps.current else None
        llm.shutdown()
    finally:
        server.stop()
    assert_loaded_bytes_equal(bytes1, bytes2, hits, kw["block_size"])
    return out1, out2, hits, info
