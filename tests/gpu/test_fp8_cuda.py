"""FP8 weights on CUDA (``weight_dtype: fp8``, the Triton FP8 GEMM): for every family, the
engine at stored precision against the same model's reference forward, the CUDA forward
against the CPU torch expression of the same FP8 model, and decode graphs against eager.
Skipped without a GPU; tests/model/test_fp8_weights.py runs the CPU side."""

from __future__ import annotations

import pytest
import torch

from atom import LLM, SamplingParams, kernels
from atom.models.common.fp8_linear import Fp8Linear
from atom.models.deepseek_v4.reference import reference_forward as v4_reference
from atom.models.deepseek_v41.reference import reference_forward as v41_reference

from .test_decode_graphs_cuda import assert_same_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# one FP8-stored preset per family (tests/model/test_gpu_gate_coverage.py checks the list)
PRESETS = {"v4-tiny-fp8": v4_reference, "v41-tiny-fp8": v41_reference}
FP32 = dict(dtype="float32", kv_dtype="fp32", index_dtype="fp32")


def _prompts(count=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 300, (60 + 37 * i,), generator=g).tolist() for i in range(count)]


@pytest.mark.parametrize("preset", list(PRESETS))
def test_fp8_engine_on_cuda_matches_its_reference_and_the_torch_expression(preset):
    """auto resolves to fp8 on CUDA, the FP8 linears keep E4M3 bytes, and the engine's greedy
    tokens are the reference forward's argmax; in a 48-row reference forward every FP8 linear's
    kernel output equals the torch expression on the same input to float32 rounding, and
    through the cuBLAS path (more than 64 rows) the logits equal it bit for bit.

    Not bit for bit: the kernel's size classes sum in other orders than the reference's, and
    the next layer's E4M3 input rounding turns a last-bit difference, where it crosses a
    rounding boundary, into 1/16 of that value; a routing or top-k choice downstream may then
    flip. Measured on the H200 at b4c70e4: v4-tiny-fp8 22+ of 24 greedy tokens equal,
    v41-tiny-fp8 21 of 24 (the torch expression on CUDA: 24 and 23). So 3 in 4 tokens must agree;
    a miswired linear parts everywhere."""
    llm = LLM(model=preset, device="cuda", cuda_graphs=False, max_num_batched_tokens=128, **FP32)
    assert llm.config.weight_dtype == "fp8"
    model = llm.engine.runtime.model
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert fp8 and all(m.weight.dtype == torch.float8_e4m3fn for m in fp8)
    prompts = _prompts()
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    ref = PRESETS[preset]
    agree = total = 0
    for p, out in zip(prompts, outs):
        ids = p + out.token_ids[:-1]
        with torch.no_grad():
            logits = ref(model, ids)[len(p) - 1 :].float()
        agree += sum(int(logits[j].argmax()) == t for j, t in enumerate(out.token_ids))
        total += len(out.token_ids)
    assert agree >= total * 3 // 4, (agree, total)
    short, long = prompts[0][:48], prompts[-1]  # <= 64 rows: the kernel; above: cuBLAS
    # every FP8 linear's input and kernel output in one 48-row forward, copied: the model adds
    # into some outputs in place
    calls = []
    hooks = [
        m.register_forward_hook(
            lambda mod, args, out: calls.append((mod, args[0].clone(), out.clone()))
        )
        for m in fp8
    ]
    with torch.no_grad():
        try:
            ref(model, short)
        finally:
            for h in hooks:
                h.remove()
        dequant = ref(model, long).float()
        kernels.configure(off=["fp8_gemm"])  # the torch expression, on the same weights
        try:
            torch_long = ref(model, long).float()
            exprs = [mod(x) for mod, x, _ in calls]
        finally:
            kernels.configure()
    # above 64 rows both operands are rounded exactly and one float32 GEMM runs: the torch
    # expression's own computation, bit for bit
    assert torch.equal(dequant, torch_long)
    # each linear, on the activations the model gave it, equals its torch expression to
    # float32 rounding; compared per linear because across layers the next one's E4M3 input
    # rounding turns a last-bit difference into 1/16 of a value, and a top-k flip then parts
    # every later row (measured at f4910db: 18 of 48 rows close at the logits)
    trunk = {m for n, m in model.named_modules() if isinstance(m, Fp8Linear) and "mtp" not in n}
    assert {mod for mod, _, _ in calls} >= trunk  # every linear but the draft layer's ran
    differ = 0
    for (mod, _x, out), want in zip(calls, exprs):
        assert out.shape == want.shape and out.dtype == want.dtype
        err = (out.float() - want.float()).abs().amax()
        assert err <= 1e-3 * want.float().abs().amax() + 1e-6, (mod, float(err))
        differ += not torch.equal(out, want)
    assert differ  # two paths: the kernel ran


@pytest.mark.parametrize("preset", list(PRESETS))
def test_fp8_decode_graphs_equal_eager_in_bf16(preset):
    kw = dict(device="cuda", dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=256)
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = _prompts(4, seed=1)
    graphed = LLM(model=preset, **kw)
    assert graphed.config.weight_dtype == "fp8" and graphed.engine.runtime.graphs is not None
    out_g = graphed.generate(prompts, params)
    eager = LLM(model=preset, cuda_graphs=False, **kw)
    out_e = eager.generate(prompts, params)
    assert_same_greedy(out_g, out_e, eps=0.25, most=1)
