"""The tier across two GPUs (NCCL, rank r on cuda:r, a real LMCache server): two passes at
TP=2 with rank collapse on and off, each rank copying its loads out of the server's
shared-memory L1 into its device pool (and once through the server's retrieve), fp32; pass 2
resumes from the tier at the ceiling on every rank and equals pass 1 token for token. With
collapse, also with engine-driven saves (rank 0 copies every save out of its device pool into
the server's L1 itself). Skipped without two CUDA devices (tests/distributed/test_tp_tier.py
runs the same on CPU with gloo).
"""

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


@pytest.mark.parametrize(
    "collapse, shared, save_mode",
    [
        ("true", True, "lmcache_driven"),
        ("true", True, "engine_driven"),
        ("false", True, "lmcache_driven"),
        ("false", False, "lmcache_driven"),
    ],
)
def test_tp2_two_pass_on_two_gpus(collapse, shared, save_mode):
    """``shared``: the server's L1 in shared memory, so every rank copies its loads itself
    (engine-driven, collapse on or off); without it every part is the server's retrieve.
    ``save_mode`` engine_driven: rank 0's engine copies pass 1's saves itself."""
    prompts = prompts_of([40, 77, 100, 129, 64], seed=7)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    server = LMCacheServer(chunk_size=BLOCK, l1_size_gb=0.5, shared_l1=shared)
    server.start(wait=True)
    try:
        lmcache = {"url": server.url, "tp_rank_collapse": collapse, "save_mode": save_mode}
        tier = dict(offload="lmcache_mp", lmcache=lmcache)
        outs, ranks, saved = [], None, []
        for _ in range(2):
            llm = LLM("v41-tiny", **KW, **tier)
            saves = llm.engine.tier.saves
            outs.append(llm.generate(prompts, params))
            ranks = llm.engine.tier_health()["tensor_parallel"]["ranks"]
            llm.shutdown()
            saved.append(dict(saves.counts) if saves is not None else None)
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
    if save_mode == "engine_driven":  # pass 1's saves: every one copied by rank 0's engine
        counts = saved[0]
        assert counts["copied"] > 0 and counts["via_server"] == counts["failed"] == 0, counts
    else:
        assert saved == [None, None]
    print(f"collapse={collapse} shared={shared}: {ranks}")
