"""First-wave vs later-wave tier lookup latency against an LMCache server without atom's locate
module (the capability probe must not delay the first wave; docs/TIER.md).

Usage: python -m benchmarks.locate_probe [LOOKUP_TIMEOUT_S]   (CPU, v41-tiny, 4 waves of 4)
"""

import statistics
import sys

import torch

from atom import LLM, SamplingParams
from atom.tier.server.lmcache_server import LMCacheServer

KW = dict(
    block_size=16,
    num_blocks=300,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    dtype="float32",
    kv_dtype="fp32",
    index_dtype="fp32",
    device="cpu",
)
torch.set_num_threads(1)
timeout = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
s = LMCacheServer(chunk_size=16, l1_size_gb=0.2, shared_l1=False)
s.start()
try:
    g = torch.Generator().manual_seed(7)
    waves = [
        [torch.randint(0, 256, (49,), generator=g).tolist() for _ in range(4)] for _ in range(4)
    ]
    llm = LLM(
        "v41-tiny", offload="lmcache_mp", lmcache={"url": s.url, "lookup_timeout_s": timeout}, **KW
    )
    conn = llm.engine.scheduler.connector
    lat = []
    inner = conn._on_lookup

    def rec(op):
        if op.finished_at is not None:
            lat.append(op.finished_at - op.created_at)
        return inner(op)

    conn._on_lookup = rec
    print("health at start:", llm.engine.tier_health()["load_mode"])
    for i, w in enumerate(waves):
        lat.clear()
        out = llm.generate(w, SamplingParams(max_tokens=2, ignore_eos=True))
        print(
            f"wave {i}: lookup latency max {max(lat):.4f} s median "
            f"{statistics.median(lat):.4f} s n={len(lat)}"
        )
    saves = conn.tier_metrics.saves.get(outcome="done")
    print("saves done", saves, "health now:", llm.engine.tier_health()["load_mode"])
    llm.shutdown()
finally:
    s.stop()
