"""The greedy accept walk on CUDA (``atom.engine.greedy_walk``): speculative steps of greedy
requests walk their drafts and run the draft layers on the device (draft graphs returning the
committed end's logits, ``logit_rows``), for both families' draft layers; outputs equal plain
decoding (fp32 exactly, bf16 up to near-ties) and the host walk's. Skipped without a GPU
(tests/engine/test_greedy_walk.py runs the same comparison on CPU)."""

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

KW = dict(block_size=16, num_blocks=128, max_num_seqs=8, max_num_batched_tokens=128)


@pytest.mark.parametrize("model", ["v41-tiny-draft", "v4-mini"])
@pytest.mark.parametrize(
    "dtype, eps",
    [
        (dict(dtype="float32", kv_dtype="fp32", index_dtype="fp32"), 0.0),
        (dict(dtype="bfloat16"), 0.25),
    ],
)
def test_device_walk_on_cuda_equals_plain_and_the_host_walk(model, dtype, eps):
    prompts = prompts_of([5, 17, 33, 40, 64, 90], seed=23)
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = LLM(model, device="cuda", **KW, **dtype).generate(
        prompts, SamplingParams(max_tokens=40, ignore_eos=True, logprobs=2)
    )
    truth = {tuple(p): p + o.token_ids for p, o in zip(prompts, plain)}
    outs = {}
    for on in (True, False):
        llm = LLM(model, device="cuda", speculative_tokens=3, **KW, **dtype)
        llm.engine.device_walk = on
        llm.engine.drafter = ScriptedDrafter(llm.engine.drafter, truth, lambda p: p % 6 == 0)
        spec = llm.generate(prompts, greedy, on_step=lambda e: e.check_integrity())
        outs[on] = [o.token_ids for o in spec]
        if eps == 0.0:
            assert outs[on] == [o.token_ids for o in plain]
        else:
            assert_same_greedy(spec, plain, eps, most=2)
        stats = llm.engine.stats()["speculative"]
        assert stats["acceptance_rate"] > 0.5, stats
        assert (stats["device_walk_steps"] > 0) == on, stats
        graphs = llm.engine.runtime.span_graphs
        assert not graphs.failed, graphs.failed
        if dtype["dtype"] == "bfloat16":  # (fp32 small batches take the MoE loop: eager)
            assert graphs.replays["verify"] > 0 and graphs.replays["draft"] > 0, graphs.replays
    if eps == 0.0:
        assert outs[True] == outs[False]
