"""The engine runs DeepSeek-V4 without knowing it: outputs against V4's oracle (full recompute)
under chunking, prefix sharing and pool pressure, exactly as for V4.1.

Greedy equivalence is checked by teacher forcing: one reference forward over prompt + output
must predict every output token (by induction, greedy generation is then identical).
"""

import pytest
import torch

from atom import LLM, SamplingParams
from atom.models.deepseek_v4.reference import reference_forward

from .test_engine_oracle import assert_drained, run_checked
from .workloads import prefix_tree_prompts


def assert_greedy_matches_oracle(model, prompt, output):
    """As test_engine_oracle's, with V4's reference forward."""
    logits = reference_forward(model, prompt + output[:-1])
    predicted = logits[len(prompt) - 1 :].argmax(-1).tolist()
    assert predicted == output, f"engine {output} vs oracle {predicted} (prompt len {len(prompt)})"


@pytest.mark.parametrize("n, seed", [(8, 0), (24, 1)])
def test_v4_tiny_prefix_trees_match_oracle_under_pressure(n, seed):
    block = 16
    llm = LLM(
        "v4-tiny",
        block_size=block,
        num_blocks=18,
        max_num_seqs=8,
        max_num_batched_tokens=40,  # many chunks, not a multiple of the block (or of 4, 8)
        dtype="float32",
        kv_dtype="fp32",
        index_dtype="fp32",
        device="cpu",
    )
    assert llm.engine.spec.units_per_image == 4  # the geometry came from V4 via the registry
    prompts = prefix_tree_prompts(n, block, seed)
    outs = run_checked(llm, prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    model = llm.engine.runtime.model
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == 6 and out.finish_reason == "length"
        assert_greedy_matches_oracle(model, prompt, out.token_ids)
        assert out.hbm_hit_tokens + out.computed_prompt_tokens == len(prompt)
    stats = llm.engine.stats()
    assert sum(o.hbm_hit_tokens for o in outs) > 0, "the tree workload produced no local hit"
    if n >= 24:
        assert stats["preemptions"] > 0, "the pool was not small enough to force preemption"
    assert_drained(llm)


def test_v4_mini_block_256_matches_oracle():
    """Real block (256), window (128) and HCA ratio (128), FP8/FP4 simulations on."""
    llm = LLM(
        "v4-mini",
        num_blocks=18,
        max_num_seqs=3,
        max_num_batched_tokens=256,
        dtype="float32",
        kv_dtype="fp32",
        index_dtype="fp32",
        device="cpu",
    )
    assert llm.config.block_size == 256
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 256, (300,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 40)]
    prompts.append(shared[:256])
    outs = run_checked(llm, prompts, SamplingParams(max_tokens=3, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert_greedy_matches_oracle(llm.engine.runtime.model, prompt, out.token_ids)
    assert sum(o.hbm_hit_tokens for o in outs) >= 256  # a 256-boundary image was reused
    assert_drained(llm)
