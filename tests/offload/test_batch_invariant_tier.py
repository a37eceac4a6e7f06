"""The tier in the batch-invariant mode (``batch_invariant: true``), against the real LMCache
server: a second engine resumes every request from the first one's objects while its chunk
size, batch size and batch mix all differ, and computes the same logit bits (as logprobs) and
tokens as pass 1 and as a run without the tier; a default-mode engine of the same preset hits
none of those objects (other bits: the weights identity carries ";arith=batch_invariant")."""

from __future__ import annotations

import pytest

from atom import SamplingParams

from .test_two_pass import ceiling, prompts_of, tier

PARAMS = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=3)


def outputs(llm, prompts, keep):
    """The (tokens, logprobs) of the requests at indices ``keep``."""
    outs = llm.generate(prompts, PARAMS, on_step=lambda e: e.check_integrity())
    return [(outs[i].token_ids, outs[i].logprobs) for i in keep], [outs[i] for i in keep]


@pytest.mark.parametrize("preset", ["v41-tiny", "v4-tiny"])
def test_resumed_requests_compute_the_bits_of_pass_one_under_other_batches(
    lmcache_server, make_llm, preset
):
    prompts = prompts_of([40, 77, 129, 63, 100], seed=3501)  # seeds no other test uses:
    extra = prompts_of([150, 9, 55, 31], seed=3502)  # the session server keeps objects
    mode = dict(batch_invariant=True)
    first = make_llm(preset, **mode, **tier(lmcache_server), max_num_seqs=2)
    got1, _ = outputs(first, prompts, range(len(prompts)))
    first.shutdown()
    # pass 2: other chunk budget and batch size, the prompts reversed among other requests
    second = make_llm(
        preset, **mode, **tier(lmcache_server), max_num_seqs=8, max_num_batched_tokens=64
    )
    mixed = extra[:2] + prompts[::-1] + extra[2:]
    keep = [2 + len(prompts) - 1 - i for i in range(len(prompts))]
    got2, outs2 = outputs(second, mixed, keep)
    hits = sum(o.tier_hit_tokens for o in outs2)
    assert hits >= 0.99 * sum(ceiling(len(p)) for p in prompts), hits
    assert all(o.hbm_hit_tokens == 0 for o in outs2)
    for k, (a, b) in enumerate(zip(got1, got2)):
        assert a[0] == b[0], f"request {k}: tokens {b[0]} after resuming, {a[0]} in pass 1"
        assert a[1] == b[1], f"request {k}: logprobs after resuming differ from pass 1"
    # and a run without the tier, in yet another chunking, computes the same
    plain = make_llm(preset, **mode, max_num_seqs=3, max_num_batched_tokens=48)
    got3, _ = outputs(plain, prompts, range(len(prompts)))
    assert got3 == got1
    # the default mode keys other objects: it finds none of these
    default = make_llm(preset, **tier(lmcache_server))
    _, outs4 = outputs(default, prompts, range(len(prompts)))
    assert sum(o.tier_hit_tokens for o in outs4) == 0


@pytest.mark.parametrize("preset", ["v41-tiny", "v4-tiny"])
def test_a_next_turn_resumed_from_decoded_blocks_computes_what_a_cold_engine_does(
    lmcache_server, make_llm, preset
):
    """A conversation's first turn decodes 40 tokens; its blocks (decoded ones included) go to
    the tier. A second engine resumes the next turn (the first turn, its output and 20 new
    tokens) from those objects, past the prompt, and computes the logprobs and tokens an engine
    without the tier computes by prefilling all of it (decode rows and prefill rows agree)."""
    prompt, extra = prompts_of([70, 20], seed=3503)
    mode = dict(batch_invariant=True)
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=3)
    first = make_llm(preset, **mode, **tier(lmcache_server))
    turn1 = first.generate([prompt], params)[0]
    first.shutdown()  # drains its saves
    turn = prompt + turn1.token_ids + extra
    second = make_llm(preset, **mode, **tier(lmcache_server), max_num_batched_tokens=48)
    resumed = second.generate([turn], params)[0]
    assert (
        resumed.tier_hit_tokens >= ceiling(len(prompt) + 40) > len(prompt)
    ), resumed.tier_hit_tokens
    cold = make_llm(preset, **mode).generate([turn], params)[0]
    assert cold.tier_hit_tokens == cold.hbm_hit_tokens == 0
    assert resumed.token_ids == cold.token_ids
    assert resumed.logprobs == cold.logprobs
