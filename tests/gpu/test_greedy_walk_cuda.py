"""The greedy accept walk on CUDA (``atom.engine.greedy_walk``): speculative steps of greedy
requests walk their drafts and run the draft layers on the device (draft graphs returning the
committed end's logits, ``logit_rows``), for both families' draft layers; outputs equal plain
decoding and the host walk's (V4.1 in fp32 exactly; bf16, and v4-mini's near-flat random
logits, up to near-ties). Skipped without a GPU
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

# v4-mini's compressors need 256-token blocks; its random near-flat logits part at near-ties
# between batch shapes in fp32 too (tests/gpu/test_v4_graphs_cuda.py allows half the prompts)
KW = {
    "v41-tiny-draft": dict(
        block_size=16, num_blocks=128, max_num_seqs=8, max_num_batched_tokens=128
    ),
    "v4-mini": dict(block_size=256, num_blocks=32, max_num_seqs=8, max_num_batched_tokens=1024),
}
FP32 = dict(dtype="float32", kv_dtype="fp32", index_dtype="fp32")


@pytest.mark.parametrize(
    "model, dtype, eps",
    [
        ("v41-tiny-draft", FP32, 0.0),
        ("v41-tiny-draft", dict(dtype="bfloat16"), 0.25),
        ("v4-mini", FP32, 0.125),
        ("v4-mini", dict(dtype="bfloat16"), 0.125),
    ],
)
def test_device_walk_on_cuda_equals_plain_and_the_host_walk(model, dtype, eps):
    prompts = prompts_of([5, 17, 33, 40, 64, 90], seed=23)
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    kw, most = KW[model], 2 if model == "v41-tiny-draft" else 3
    plain = LLM(model, device="cuda", **kw, **dtype).generate(
        prompts, SamplingParams(max_tokens=40, ignore_eos=True, logprobs=2)
    )
    truth = {tuple(p): p + o.token_ids for p, o in zip(prompts, plain)}
    outs = {}
    for on in (True, False):
        llm = LLM(model, device="cuda", speculative_tokens=3, **kw, **dtype)
        llm.engine.device_walk = on
        llm.engine.drafter = ScriptedDrafter(llm.engine.drafter, truth, lambda p: p % 6 == 0)
        spec = llm.generate(prompts, greedy, on_step=lambda e: e.check_integrity())
        outs[on] = [o.token_ids for o in spec]
        if eps == 0.0:
            assert outs[on] == [o.token_ids for o in plain]
        else:
            assert_same_greedy(spec, plain, eps, most=most)
        stats = llm.engine.stats()["speculative"]
        # (v4-mini: a sequence that parts at a near-tie leaves the script's truth behind)
        assert stats["acceptance_rate"] > (0.5 if model == "v41-tiny-draft" else 0.0), stats
        assert (stats["device_walk_steps"] > 0) == on, stats
        graphs = llm.engine.runtime.span_graphs
        assert not graphs.failed, graphs.failed
        if dtype["dtype"] == "bfloat16":  # (fp32 small batches take the MoE loop: eager)
            assert graphs.replays["verify"] > 0 and graphs.replays["draft"] > 0, graphs.replays
    if eps == 0.0:
        assert outs[True] == outs[False]
