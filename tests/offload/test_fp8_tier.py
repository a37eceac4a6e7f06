"""The tier with FP8 weights and FP4 experts kept as stored (``weight_dtype: fp8``), against
the real LMCache server: KV and images are what the stored-precision model computes, a fresh
engine resumes from them with outputs identical to pass 1, and engines of the other precision
never hit them (their KV is other bytes: the weights identity carries ``;weights=fp8``).

The engines run batch-invariant: at stored precision every linear rounds its input to E4M3, so
the last-bit differences another chunking makes in the default arithmetic can cross a rounding
boundary and move a token (v41-tiny-fp8's second prompt did once its experts became FP4); the
mode makes pass 2's chunks compute pass 1's bits, which is what this test is about."""

from __future__ import annotations

import pytest

from atom.models.common.fp8_linear import Fp8Linear

from .test_two_pass import GREEDY, ceiling, prompts_of, tier


@pytest.mark.parametrize("preset", ["v41-tiny-fp8", "v4-tiny-fp8"])
def test_fp8_two_pass_resumes_with_identical_outputs(lmcache_server, make_llm, preset):
    prompts = prompts_of([40, 77, 129, 63], seed=5)
    first = make_llm(preset, weight_dtype="fp8", batch_invariant=True, **tier(lmcache_server))
    assert first.config.weight_dtype == "fp8"
    assert any(isinstance(m, Fp8Linear) for m in first.engine.runtime.model.modules())
    out1 = first.generate(prompts, GREEDY, on_step=lambda e: e.check_integrity())
    first.shutdown()
    second = make_llm(preset, weight_dtype="fp8", batch_invariant=True, **tier(lmcache_server))
    out2 = second.generate(prompts, GREEDY, on_step=lambda e: e.check_integrity())
    assert sum(o.tier_hit_tokens for o in out2) == sum(ceiling(len(p)) for p in prompts)
    assert [o.token_ids for o in out2] == [o.token_ids for o in out1]
    # the other precision of the same preset and seed finds nothing of it
    other = make_llm(preset, weight_dtype="bf16", batch_invariant=True, **tier(lmcache_server))
    out3 = other.generate(prompts, GREEDY)
    assert sum(o.tier_hit_tokens for o in out3) == 0
