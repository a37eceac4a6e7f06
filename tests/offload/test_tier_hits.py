"""Where a tier hit starts and ends: HBM first then tier, only at stored image boundaries,
always leaving a prefill tail, and the metrics that count it (real LMCache server)."""

from __future__ import annotations

import re

from atom.engine.sequence import Sequence

from .conftest import BLOCK
from .test_two_pass import GREEDY, ceiling, prompts_of, tier

CHECK = dict(on_step=lambda e: e.check_integrity())


def record_loads(llm) -> list[tuple[int, int, int]]:
    """Wrap the connector's start_load: every load's (start, end, image position)."""
    seen: list[tuple[int, int, int]] = []
    conn = llm.engine.scheduler.connector
    inner = conn.start_load

    def start_load(seq, start, end, blocks, image):
        seen.append((start, end, image.position))
        assert len(blocks) == (end - start) // BLOCK
        return inner(seq, start, end, blocks, image)

    conn.start_load = start_load
    return seen


def record_spans(llm) -> list[tuple[str, int, int, int | None]]:
    """Wrap the runner: every span's (request id, start, end, position of its restored image)."""
    seen: list[tuple[str, int, int, int | None]] = []
    runner = llm.engine.runner
    inner = runner.execute

    def execute(spans):
        for sp in spans:
            at = sp.restore.position if sp.restore is not None else None
            seen.append((sp.seq.request_id, sp.start, sp.end, at))
        return inner(spans)

    runner.execute = execute
    return seen


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of a rendered Prometheus text (0 if the series does not exist)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    series = f"{name}{{{want}}}" if want else name
    m = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def test_hbm_preamble_then_tier_loads_only_the_rest(lmcache_server, make_llm):
    pre = prompts_of([2 * BLOCK], seed=101)[0]  # a shared preamble of 2 blocks
    tails = prompts_of([9, 25, 40, 57], seed=102)
    prompts = [pre + t for t in tails]
    first = make_llm(**tier(lmcache_server))
    out1 = first.generate(prompts, GREEDY, **CHECK)
    first.shutdown()  # stores drain before it returns

    second = make_llm(**tier(lmcache_server))
    loads = record_loads(second)
    alone = second.generate([pre], GREEDY, **CHECK)[0]
    # the preamble alone: its last token is computed, so the tier serves only the first block
    assert (alone.hbm_hit_tokens, alone.tier_hit_tokens) == (0, ceiling(len(pre)))
    assert alone.computed_prompt_tokens == BLOCK
    assert loads == [(0, BLOCK, BLOCK)]
    # that run left the 2 preamble blocks in HBM with a READY image at their end (2 blocks)
    eng = second.engine
    hit = eng.scheduler.local_hit(Sequence(prompts[0], GREEDY))
    assert hit.tokens == len(pre) and hit.image.position == len(pre) and len(hit.blocks) == 2

    loads.clear()
    spans = record_spans(second)
    out2 = second.generate(prompts, GREEDY, **CHECK)
    # HBM first: the load covers exactly [hbm hit, tier hit), ending at its image; a prompt
    # whose ceiling is the preamble loads nothing
    want = [(len(pre), ceiling(len(p)), ceiling(len(p))) for p in prompts]
    assert sorted(loads) == sorted(w for w in want if w[1] > w[0])
    for p, a, b in zip(prompts, out1, out2):
        assert b.hbm_hit_tokens == len(pre), b
        assert b.tier_hit_tokens == ceiling(len(p)) - len(pre), b
        assert b.computed_prompt_tokens == len(p) - ceiling(len(p))
        assert a.token_ids == b.token_ids
        # its first forward resumes at the loaded boundary from the loaded image
        first_span = next(s for s in spans if s[0] == b.request_id)
        assert first_span[1] == first_span[3] == ceiling(len(p)), first_span


def _store_then_probe(server, make_llm, interval: int, seed: int) -> tuple:
    """Pass 1 stores one 4-chunk + tail prompt with images every ``interval`` blocks (chunks
    of 4 blocks, so no other boundary gets an image); pass 2 sends a prompt that shares only
    its first 3 chunks, then the stored prompt itself."""
    stored = prompts_of([4 * BLOCK + 5], seed=seed)[0]
    other = stored[: 3 * BLOCK] + prompts_of([BLOCK + 5], seed=seed + 1)[0]
    assert other[3 * BLOCK] != stored[3 * BLOCK]
    wide = dict(max_num_seqs=1, max_num_batched_tokens=4 * BLOCK)
    first = make_llm(**tier(server), checkpoint_interval=interval, **wide)
    spans = record_spans(first)
    out1 = first.generate([stored], GREEDY, **CHECK)[0]
    assert out1.tier_hit_tokens == 0
    ends = [e for _, _, e, _ in spans if e <= len(stored)]
    assert ends == [*range(interval * BLOCK, 4 * BLOCK + 1, interval * BLOCK), len(stored)]
    first.shutdown()
    reference = make_llm().generate([other, stored], GREEDY)
    got = []
    for prompt, want in zip([other, stored], reference):  # each in a fresh engine: no HBM hit
        out = make_llm(**tier(server)).generate([prompt], GREEDY, **CHECK)[0]
        assert out.hbm_hit_tokens == 0 and out.token_ids == want.token_ids
        got.append(out)
    return got


def test_partial_match_hits_only_a_boundary_with_an_image(lmcache_server, make_llm):
    # images every 4 blocks: the 3 shared chunks end at no stored image, so nothing hits
    other, stored = _store_then_probe(lmcache_server, make_llm, interval=4, seed=111)
    assert (other.tier_hit_tokens, other.computed_prompt_tokens) == (0, len(other.prompt_token_ids))
    assert stored.tier_hit_tokens == 4 * BLOCK
    # that run stored images at every boundary of the shared chunks (stored before without
    # one) and of its own 4th chunk: now it resumes from the tier at its ceiling
    again = make_llm(**tier(lmcache_server)).generate([other.prompt_token_ids], GREEDY)[0]
    assert again.tier_hit_tokens == ceiling(len(other.prompt_token_ids)) == 4 * BLOCK
    assert again.token_ids == other.token_ids
    # images every 2 blocks: the shared prefix holds one at 2 chunks, and it hits there
    other, stored = _store_then_probe(lmcache_server, make_llm, interval=2, seed=113)
    assert other.tier_hit_tokens == 2 * BLOCK
    assert other.computed_prompt_tokens == len(other.prompt_token_ids) - 2 * BLOCK
    assert stored.tier_hit_tokens == 4 * BLOCK


def test_fully_stored_prompt_still_computes_its_tail(lmcache_server, make_llm):
    prompt = prompts_of([4 * BLOCK], seed=121)[0]
    per_block = dict(max_num_seqs=1, max_num_batched_tokens=BLOCK)  # an image at every block
    first = make_llm(**tier(lmcache_server), **per_block)
    out1 = first.generate([prompt], GREEDY, **CHECK)[0]
    first.shutdown()
    assert (
        first.engine.scheduler.connector.tier_metrics.saves.get(outcome="done") == 4
    )  # 16, 32, 48, 64

    second = make_llm(**tier(lmcache_server), **per_block)
    loads, spans = record_loads(second), record_spans(second)
    out2 = second.generate([prompt], GREEDY, **CHECK)[0]
    assert out2.tier_hit_tokens == 3 * BLOCK and out2.hbm_hit_tokens == 0
    assert out2.computed_prompt_tokens == BLOCK
    assert out2.token_ids == out1.token_ids
    # the page transfer end, the image's boundary and the resumed position agree
    assert loads == [(0, 3 * BLOCK, 3 * BLOCK)]
    rid, start, end, restored_at = spans[0]
    assert (start, end, restored_at) == (3 * BLOCK, 4 * BLOCK, 3 * BLOCK)


def test_metrics_count_tier_loads_bytes_and_prompt_sources(lmcache_server, make_llm):
    stored = prompts_of([20, 47, 64, 90], seed=131)
    fresh = prompts_of([50, 70], seed=132)  # never stored: a miss each
    first = make_llm(**tier(lmcache_server))
    first.generate(stored, GREEDY, **CHECK)
    first.shutdown()

    second = make_llm(**tier(lmcache_server))
    out = second.generate(stored + fresh, GREEDY, **CHECK)
    text = second.engine.metrics.render()
    hits = [o.tier_hit_tokens for o in out]
    assert hits == [ceiling(len(p)) for p in stored] + [0, 0]
    spec = second.engine.spec
    load_bytes = sum((h // BLOCK + spec.units_per_image) * spec.block_bytes for h in hits if h)
    assert metric(text, "atom_tier_loads_total", outcome="done") == sum(1 for h in hits if h)
    assert metric(text, "atom_tier_loads_total", outcome="failed") == 0
    assert metric(text, "atom_tier_bytes_total", direction="load") == load_bytes > 0
    assert metric(text, "atom_tier_lookups_total", outcome="hit") == 4
    assert metric(text, "atom_tier_lookups_total", outcome="miss") == 2
    assert metric(text, "atom_prompt_tokens_total", source="tier") == sum(hits)
    assert metric(text, "atom_prompt_tokens_total", source="computed") == sum(
        o.computed_prompt_tokens for o in out
    )
    assert metric(text, "atom_tier_transfer_seconds_count", op="load") == 4


def test_a_prefix_being_loaded_is_loaded_once_and_shared_through_hbm(lmcache_server, make_llm):
    p, q = prompts_of([100, 77], seed=141)
    first = make_llm(**tier(lmcache_server))
    out1 = first.generate([p, q], GREEDY, **CHECK)
    first.shutdown()

    second = make_llm(**tier(lmcache_server))
    loads = record_loads(second)
    a, b, c = second.generate([p, p, q], GREEDY, **CHECK)
    # one twin loads; the other waits for that load of the same image, then resumes from HBM
    assert sorted(loads) == sorted([(0, ceiling(100), ceiling(100)), (0, ceiling(77), ceiling(77))])
    twins = sorted((o.hbm_hit_tokens, o.tier_hit_tokens) for o in (a, b))
    assert twins == [(0, ceiling(100)), (ceiling(100), 0)]
    assert (c.hbm_hit_tokens, c.tier_hit_tokens) == (0, ceiling(77))
    assert a.token_ids == b.token_ids == out1[0].token_ids and c.token_ids == out1[1].token_ids
    assert second.engine.scheduler.connector.tier_metrics.loads.get(outcome="done") == 2
