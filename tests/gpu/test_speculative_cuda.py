"""Speculative decoding on CUDA: greedy outputs with drafts equal plain decoding (fp32 exactly,
bf16 up to near-ties), with the real draft layers and with scripted drafts that are mostly
accepted. Skipped without a GPU (tests/engine/test_speculative.py runs the same on CPU)."""

from __future__ import annotations

import pytest
import torch

from atom import LLM, SamplingParams
from tests.engine.test_speculative import ScriptedDrafter, prompts_of
from tests.gpu.test_decode_graphs_cuda import assert_same_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MODEL = "v41-tiny-draft"
KW = dict(block_size=16, num_blocks=128, max_num_seqs=8, max_num_batched_tokens=128)


@pytest.mark.parametrize("model", [MODEL, "v41-tiny-dspark"])
@pytest.mark.parametrize(
    "dtype, eps",
    [
        (dict(dtype="float32", kv_dtype="fp32", index_dtype="fp32"), 0.0),
        (dict(dtype="bfloat16"), 0.25),
    ],
)
def test_speculative_greedy_on_cuda_equals_plain(dtype, eps, model):
    """Both drafters: the MTP-style draft layers and DSpark's stages (whose drafts run
    eagerly: no draft graphs; their verify forwards replay graphs)."""
    prompts = prompts_of([5, 17, 33, 40, 64, 90], seed=21)
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=2)
    plain = LLM(model, device="cuda", **KW, **dtype).generate(prompts, params)
    truth = {tuple(p): p + o.token_ids for p, o in zip(prompts, plain)}
    for scripted in (False, True):
        llm = LLM(model, device="cuda", speculative_tokens=3, **KW, **dtype)
        if scripted:
            llm.engine.drafter = ScriptedDrafter(llm.engine.drafter, truth, lambda p: p % 6 == 0)
        spec = llm.generate(prompts, params, on_step=lambda e: e.check_integrity())
        if eps == 0.0:
            assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
        else:
            assert_same_greedy(spec, plain, eps, most=2)
        stats = llm.engine.stats()["speculative"]
        assert stats["verify_spans"] > 0
        graphs = llm.engine.runtime.span_graphs  # verify and draft forwards in CUDA graphs
        assert not graphs.failed, graphs.failed
        if dtype["dtype"] == "bfloat16":  # (fp32 small batches take the MoE loop: eager)
            assert graphs.replays["verify"] > 0, graphs.replays
            assert (graphs.replays["draft"] > 0) == (model == MODEL), graphs.replays
        if scripted:
            assert stats["acceptance_rate"] > 0.5, stats


def test_sampled_drafts_on_cuda_are_accepted_reproducibly():
    """Sampling requests propose drafts drawn from q on the GPU (per-request generators on the
    device, q from the draft graphs' outputs) and verify them with the exact rule: the run
    completes, some sampled drafts are accepted (the random draft layer's q and the target's
    p are both near uniform at temperature 1: acceptance about 0.5 on CPU), greedy requests
    in the same batches equal plain decoding, and the same seeds give the same tokens."""
    prompts = prompts_of([5, 17, 33, 40], seed=22)
    sampled = [SamplingParams(max_tokens=24, temperature=1.0, seed=100 + i) for i in range(4)]
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32", kv_dtype="fp32", index_dtype="fp32", **KW)
    plain = LLM(MODEL, **kw).generate(prompts, greedy)
    runs = []
    for _ in range(2):
        llm = LLM(MODEL, speculative_tokens=2, **kw)
        outs = llm.generate(prompts + prompts, sampled + [greedy] * 4)
        runs.append([o.token_ids for o in outs])
        stats = llm.engine.stats()["speculative"]
        assert stats["acceptance_rate"] > 0.1, stats
        assert [o.token_ids for o in outs[4:]] == [o.token_ids for o in plain]
    assert runs[0] == runs[1]
