"""Local (HBM) prefix hits: exactly at the last READY image, capped when images are gone."""

import pytest

from atom import LLM, SamplingParams

B = 16


@pytest.fixture()
def llm():
    return LLM(
        "v41-tiny",
        block_size=B,
        num_blocks=200,
        max_num_seqs=4,
        max_num_batched_tokens=B,
        dtype="float32",
        kv_dtype="fp32",
        index_dtype="fp32",
        device="cpu",
    )


def run(llm, prompt, n=4):
    out = llm.generate(
        [prompt],
        SamplingParams(max_tokens=n, ignore_eos=True),
        on_step=lambda e: e.check_integrity(),
    )[0]
    assert out.hbm_hit_tokens + out.computed_prompt_tokens == len(prompt)
    return out


def image_keys(llm, prompt):
    """Boundary hash -> position, for every full block of the prompt."""
    from atom.engine.block_pool import block_hashes

    return {h: (i + 1) * B for i, h in enumerate(block_hashes(prompt, B))}


def test_repeat_hits_at_last_ready_image_and_computes_the_rest(llm):
    prompt = list(range(5 * B + 3))
    first = run(llm, prompt)
    assert first.hbm_hit_tokens == 0
    # chunks of B tokens: a forward ended on every boundary, so images exist at B..5B
    ready = {c.position for c in llm.engine.store.images.values() if c.ready}
    assert ready >= {B, 2 * B, 3 * B, 4 * B, 5 * B}
    again = run(llm, prompt)
    assert again.hbm_hit_tokens == 5 * B and again.computed_prompt_tokens == 3
    assert again.token_ids == first.token_ids


def test_prompt_on_a_boundary_keeps_a_tail(llm):
    prompt = list(range(4 * B))
    first = run(llm, prompt)
    again = run(llm, prompt)
    assert again.hbm_hit_tokens == 3 * B and again.computed_prompt_tokens == B
    assert again.token_ids == first.token_ids


def test_evicted_images_cap_the_hit_lower_and_never_hit_without_one(llm):
    prompt = list(range(7, 7 + 5 * B + 3))
    base = run(llm, prompt)
    store = llm.engine.store
    keys = image_keys(llm, prompt)
    by_pos = {keys[k]: c for k, c in store.images.items() if k in keys}
    store.drop(by_pos[5 * B])
    out = run(llm, prompt)
    assert out.hbm_hit_tokens == 4 * B
    assert out.token_ids == base.token_ids
    # the run above re-took the image at 5B; now drop 5B, 4B and 3B
    for pos in (5 * B, 4 * B, 3 * B):
        store.drop(store.images[[k for k, p in keys.items() if p == pos][0]])
    out = run(llm, prompt)
    assert out.hbm_hit_tokens == 2 * B and out.token_ids == base.token_ids
    # the KV blocks are all still cached, but with no image there is no hit
    for k in [k for k in keys if k in store.images]:
        store.drop(store.images[k])
    assert all(llm.engine.pool.lookup(h) is not None for h in list(keys)[:3])
    out = run(llm, prompt)
    assert out.hbm_hit_tokens == 0 and out.token_ids == base.token_ids


def test_evicting_a_prefix_block_drops_the_images_above_it(llm):
    prompt = list(range(3, 3 + 4 * B + 1))
    run(llm, prompt)
    eng = llm.engine
    hashes = list(image_keys(llm, prompt))
    block1 = eng.pool.lookup(hashes[1])
    assert all(h in eng.store.images for h in hashes)
    eng.pool.forget(block1)  # block 1 leaves the pool
    assert hashes[0] in eng.store.images  # the image at B does not depend on block 1
    assert not any(h in eng.store.images for h in hashes[1:])
    eng.check_integrity()
    out = run(llm, prompt)
    assert out.hbm_hit_tokens == B


def test_shared_prefix_between_different_prompts(llm):
    shared = list(range(100, 100 + 3 * B))
    run(llm, shared + [1, 2, 3])
    out = run(llm, shared + [9] * (2 * B))
    assert out.hbm_hit_tokens == 3 * B
