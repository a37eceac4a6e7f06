"""DeepSeek-V4 on CUDA: the paged forward (prefill chunks and decode steps), its bf16 rounding
and the tier, as the GPU gate runs them for V4.1. Skipped without a GPU.

The engine builds block tables on the host; V4's compressed-row writes once indexed a host table
with device rows and crashed here (nothing ran V4 on CUDA). These tests pass host tables, as the
engine does.
"""

from __future__ import annotations

import pytest
import torch

from atom import LLM, SamplingParams
from atom.model_api import Span
from atom.models.deepseek_v4.model import DeepseekV4ForCausalLM
from atom.models.deepseek_v4.presets import preset_config
from atom.models.deepseek_v4.reference import reference_forward
from atom.models.deepseek_v4.runtime import V4Runtime
from tests.engine.test_batch_invariant import prompts_of

from .tier_two_pass import assert_same_bits, two_pass

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ATOL = 1e-4  # tests/model/test_v4_paged.py: fp32 paged and reference agree to rounding


def _paged(model: DeepseekV4ForCausalLM, ids: torch.Tensor, ends, block: int) -> torch.Tensor:
    """Logits of every position of ``ids`` run as spans ending at ``ends`` in one slot."""
    rt = V4Runtime(model, block_size=block)
    pool = torch.zeros(rt.spec.pool_shape(8), dtype=rt.spec.pool_dtype, device="cuda")
    slots = torch.zeros(2, rt.spec.state_bytes, dtype=torch.uint8, device="cuda")
    rt.bind(pool, slots)
    table = torch.arange(1, 1 + -(-ends[-1] // block))  # a host table, as the engine's
    outs, start = [], 0
    for end in ends:
        span = Span(start, end, 1, table)
        outs.append(model.forward_paged(ids[start:end], [span], rt.kv, rt.slots, True).cpu())
        start = end
    return torch.cat(outs)


def _fp32_twin(model: DeepseekV4ForCausalLM) -> DeepseekV4ForCausalLM:
    """The same weights, upcast, in a float32 model storing float32 rows: the truth a bf16
    forward approximates."""
    twin = DeepseekV4ForCausalLM(
        model.config, dtype=torch.float32, kv_dtype="fp32", index_dtype="fp32", device="cuda"
    )
    sd = {k: v.float() if v.is_floating_point() else v for k, v in model.state_dict().items()}
    twin.load_state_dict(sd)
    return twin


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# v4-mini: block 256, window 128, CSA (4) and HCA (128) layers, the FP8/FP4 simulations on
PLANS = {
    "chunks": (600, (256, 301, 512, 600)),
    "decode-steps": (560, (256, 512, *range(513, 561))),
}


@pytest.mark.parametrize("plan", list(PLANS), ids=list(PLANS))
def test_v4_fp32_paged_forward_on_cuda_equals_the_reference(plan):
    """fp32 with the FP8/FP4 simulations off: only reduction order differs between the two
    paths. With them on, a last-bit difference moves a value across a rounding boundary of the
    simulated format and the logits part by far more (v4-mini, these 600 tokens, on CPU: 0.155
    with the simulations on, 7.9e-6 off; on the H200: 0.56 on), so the simulations are checked
    against the float32 truth in bf16 below, and their exact roundings by tests/model."""
    n, ends = PLANS[plan]
    cfg = preset_config("v4-mini", kv_fp8_sim=False, index_fp4_sim=False)
    model = DeepseekV4ForCausalLM(cfg, device="cuda").init_weights(0)
    ids = torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(0))
    paged = _paged(model, ids.cuda(), ends, 256)
    ref = reference_forward(model, ids.tolist()).cpu()
    diff = (paged - ref).abs().max().item()
    assert diff < ATOL, f"max |paged - reference| = {diff}"
    assert torch.equal(paged.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("plan", list(PLANS), ids=list(PLANS))
def test_v4_bf16_paged_forward_is_as_close_to_the_fp32_truth_as_the_bf16_reference(plan):
    """bf16 compute with bf16 rows: the paged forward's error from the float32 truth (same
    weights upcast) is at most that of the bf16 reference forward, plus rounding noise."""
    n, ends = PLANS[plan]
    model = DeepseekV4ForCausalLM(
        preset_config("v4-mini"),
        dtype=torch.bfloat16,
        kv_dtype="bf16",
        index_dtype="bf16",
        device="cuda",
    ).init_weights(0)
    ids = torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(1))
    paged = _paged(model, ids.cuda(), ends, 256)
    ref = reference_forward(model, ids.tolist()).cpu()
    truth = reference_forward(_fp32_twin(model), ids.tolist()).cpu()
    paged_err, ref_err = _rel(paged, truth), _rel(ref, truth)
    assert paged_err <= 1.25 * ref_err + 0.01, (paged_err, ref_err)
    agree = [(x.argmax(-1) == truth.argmax(-1)).float().mean().item() for x in (paged, ref)]
    assert agree[0] >= agree[1] - 0.05, agree


def test_v4_engine_on_cuda_fp32_matches_the_oracle():
    """The engine (host block tables, chunked prefill, batched decode steps) on CUDA: greedy
    outputs equal the reference forward's, by teacher forcing."""
    llm = LLM(
        "v4-tiny",
        block_size=16,
        num_blocks=40,
        max_num_seqs=4,
        max_num_batched_tokens=40,
        dtype="float32",
        kv_dtype="fp32",
        index_dtype="fp32",
        device="cuda",
    )
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (70, 33, 52)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    model = llm.engine.runtime.model
    for prompt, out in zip(prompts, outs):
        logits = reference_forward(model, prompt + out.token_ids[:-1])
        assert logits[len(prompt) - 1 :].argmax(-1).tolist() == out.token_ids
    llm.shutdown()


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch_invariant"])
def test_v4_tier_two_pass_on_cuda(invariant):
    """Pass 2 on a fresh engine loads every reusable prefix from the LMCache server (PAGE rows
    and the checkpoint image: window rings, compressor overlap), byte for byte what pass 1
    stored; in the batch-invariant mode it decodes pass 1's tokens and logprobs bit for bit
    with another chunk budget (tests/gpu/tier_two_pass.py: what the default mode promises)."""
    kw = dict(
        block_size=256,
        num_blocks=48,
        max_num_seqs=3,
        max_num_batched_tokens=512,
        device="cuda",
        dtype="bfloat16",
        offload="lmcache_mp",
        lmcache={"l1_size_gb": 2.0},
        batch_invariant=invariant,
    )
    prompts = prompts_of((700, 530, 300), seed=3, vocab=300)
    p = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=5)
    second = {"max_num_batched_tokens": 320} if invariant else {}
    out1, out2, hits, _ = two_pass("v4-mini", prompts, p, kw, second)
    assert hits == [512, 512, 256]
    if invariant:
        assert_same_bits(out2, out1)
