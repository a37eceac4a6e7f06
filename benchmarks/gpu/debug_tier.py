"""Debug: do pass-1 images hold their own boundary on CUDA, with and without a sync?"""

import sys

import torch

from atom import LLM, SamplingParams

sync = sys.argv[1] == "sync"
kw = dict(
    block_size=256,
    num_blocks=64,
    max_num_seqs=4,
    max_num_batched_tokens=1024,
    device="cuda",
    dtype="bfloat16",
    offload="lmcache_mp",
    lmcache={"l1_size_gb": 2.0},
)
g = torch.Generator().manual_seed(1)
prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (700, 1030, 300)]
p = SamplingParams(max_tokens=8, ignore_eos=True)
first = LLM("v41-mini", **kw)
eng = first.engine
conn = eng.scheduler.connector
if sync:
    inner = conn._launch

    def launch(st, op):
        torch.cuda.synchronize()
        inner(st, op)

    conn._launch = launch
geo = eng.runtime.geometry
cur = geo.field("cursor")
bad = []


def check(e):
    for c in e.store.images.values():
        if c.ready:
            unit, off = divmod(cur.offset, e.spec.block_bytes)
            raw = e.runner.pool.view(torch.uint8).view(e.pool.num_blocks, -1)[c.units[unit]]
            pos = int(raw[off : off + 8].cpu().view(torch.int64)[0])
            if pos != c.position:
                bad.append((c.position, pos))


out1 = first.generate(prompts, p, on_step=check)
print("sync" if sync else "nosync", "local images with a wrong cursor:", bad[:5], len(bad))
url = eng.tier_health()["url"]
server = eng.tier.server
eng.tier.server = None
first.shutdown()
kw.pop("lmcache")
second = LLM("v41-mini", lmcache_url=url, **kw)
try:
    out2 = second.generate(prompts, p)
    print(
        "pass2 ok",
        [o.tier_hit_tokens for o in out2],
        [a.token_ids == b.token_ids for a, b in zip(out1, out2)],
    )
except Exception as exc:
    print("pass2 failed:", exc)
second.shutdown()
server.stop()
