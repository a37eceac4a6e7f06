"""The tier across two GPUs (NCCL, rank r on cuda:r, a real LMCache server): two passes at
TP=2 with rank collapse on and off, each rank copying its loads out of the server's
shared-memory L1 into its device pool (and once through the server's retrieve), fp32; pass 2
resumes from the tier at the ceiling on every rank and equals pass 1 token for token. Skipped
without two CUDA devices (tests/distributed/test_tp_tier.py runs the same on CPU with gloo)."""

from __future__ import annotations

import pytest
import torch

from atom import LLM, SamplingParams
from atom.tier.server.lmcache_server import LMCacheServer
from tests.offload.test_two_pass import ceiling, prompts_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

BLOCK = 16
KW = dict(
    block_size=BLOCK, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=64, device="cuda",
    dtype="float32", kv_dtype="fp32", index_dtype="fp32", tensor_parallel_size=2,
)  # fmt: skip


@pytest.mark.parametrize("collapse, shared", [("true", True), ("false", True), ("false", False)])
def test_tp2_two_pass_on_two_gpus(collapse, shared):
    """``shared``: the server's L1 in shared memory, so every rank copies its loads itself
    (engine-driven, collapse on or off); without it every part is the server's retrieve."""
    prompts = prompts_of([40, 77, 100, 129, 64], seed=7)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    server = LMCacheServer(chunk_size=BLOCK, l1_size_gb=0.5, shared_l1=shared)
    server.start(wait=True)
    try:
        tier = dict(offload="lmcache_mp", lmcache={"url": server.url, "tp_rank_collapse": collapse})
        outs, ranks = [], None
        for _ in range(2):
            llm = LLM("v41-tiny", **KW, **tier)
            outs.append(llm.generate(prompts, params))
            ranks = llm.engine.tier_health()["tensor_parallel"]["ranks"]
            llm.shutdown()
    finally:
        server.stop()
    for p, a, b in zip(prompts, *outs):
        assert a.token_ids == b.token_ids
        assert b.tier_hit_tokens == ceiling(len(p))
    r0, r1 = ranks
    assert r0["parts"]["load"] == r1["parts"]["load"] == len(prompts)
    assert r0["failed"]["load"] == r1["failed"]["load"] == 0
    how = "copied" if shared else "retrieved"
    assert r0["loads"][how] == r1["loads"][how] == len(prompts), ranks
    print(f"collapse={collapse} shared={shared}: {ranks}")
