"""Engine outputs against the oracle (full recompute) under chunking, sharing and pressure.

Greedy equivalence is checked by teacher forcing: one reference forward over prompt + output
must predict every output token (by induction, greedy generation is then identical).
"""

import pytest
import torch

from atom import LLM, SamplingParams
from atom.models.deepseek_v4.model import DeepseekV4ForCausalLM
from atom.models.deepseek_v4.reference import reference_forward as v4_reference_forward
from atom.models.deepseek_v41.reference import reference_forward

from .workloads import prefix_tree_prompts


def assert_greedy_matches_oracle(model, prompt, output):
    ids = prompt + output[:-1]
    oracle = v4_reference_forward if isinstance(model, DeepseekV4ForCausalLM) else reference_forward
    logits = oracle(model, ids)
    predicted = logits[len(prompt) - 1 :].argmax(-1).tolist()
    assert predicted == output, f"engine {output} vs oracle {predicted} (prompt len {len(prompt)})"


def run_checked(llm, prompts, params):
    steps = []

    def check(engine):
        engine.check_integrity()
        steps.append(1)

    outs = llm.generate(prompts, params, on_step=check)
    assert steps, "no engine step ran"
    return outs


def assert_drained(llm):
    eng = llm.engine
    eng.check_integrity()
    pool = eng.pool
    owned = sum(1 for b in range(pool.num_blocks) if pool.ref[b])
    assert owned == eng.store.counts()["units"]  # only image units stay owned
    assert eng.store.counts()["pinned"] == 0
    assert not eng.store.limbo


@pytest.mark.parametrize("n, seed", [(8, 0), (24, 1), (64, 2)])
def test_tiny_prefix_trees_match_oracle_under_pressure(n, seed):
    block = 16
    llm = LLM(
        "v41-tiny",
        block_size=block,
        num_blocks=22,
        max_num_seqs=8,
        max_num_batched_tokens=40,  # forces many chunks, not a multiple of the block
        dtype="float32",
        kv_dtype="fp32",
        index_dtype="fp32",
        device="cpu",
    )
    prompts = prefix_tree_prompts(n, block, seed)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    outs = run_checked(llm, prompts, params)
    model = llm.engine.runtime.model
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == 8 and out.finish_reason == "length"
        assert_greedy_matches_oracle(model, prompt, out.token_ids)
        assert out.hbm_hit_tokens + out.computed_prompt_tokens == len(prompt)
        assert out.hbm_hit_tokens < len(prompt)
    stats = llm.engine.stats()
    assert sum(o.hbm_hit_tokens for o in outs) > 0, "the tree workload produced no local hit"
    if n >= 24:
        assert stats["preemptions"] > 0, "the pool was not small enough to force preemption"
        assert llm.engine.pool.evictions > 0 or stats["images_evicted"] > 0
    assert_drained(llm)


def test_mini_block_256_matches_oracle():
    llm = LLM(
        "v41-mini",
        num_blocks=40,
        max_num_seqs=4,
        max_num_batched_tokens=512,
        dtype="float32",
        kv_dtype="fp32",
        index_dtype="fp32",
        device="cpu",
    )
    assert llm.config.block_size == 256
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 256, (300,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 211, 467)]
    prompts.append(shared[:256])
    outs = run_checked(llm, prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert_greedy_matches_oracle(llm.engine.runtime.model, prompt, out.token_ids)
    assert_drained(llm)


def test_sampling_is_repeatable_with_a_seed():
    llm = LLM("v41-tiny", num_blocks=64, device="cpu", dtype="float32", max_num_batched_tokens=32)
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=20, seed=7, ignore_eos=True)
    a = llm.generate([list(range(40))], p)[0].token_ids
    b = llm.generate([list(range(40))], p)[0].token_ids
    assert a == b
    c = llm.generate(
        [list(range(40))], SamplingParams(max_tokens=12, temperature=0.9, seed=8, ignore_eos=True)
    )[0].token_ids
    assert c != a
