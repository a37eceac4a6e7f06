"""Debug: which stored image bytes land in a loaded image's units on CUDA?"""

import torch

from atom import LLM, SamplingParams

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
prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (700,)]
p = SamplingParams(max_tokens=2, ignore_eos=True)
first = LLM("v41-mini", **kw)
eng = first.engine
snap = {}


def grab(e):
    pb = e.runner.pool.view(torch.uint8).view(e.pool.num_blocks, -1)
    for c in e.store.images.values():
        if c.ready and c.position not in snap:
            snap[c.position] = [pb[u].clone() for u in c.units]


first.generate(prompts, p, on_step=grab)
print("pass1 images", sorted(snap), "units", eng.spec.units_per_image)
url = eng.tier_health()["url"]
server = eng.tier.server
eng.tier.server = None
first.shutdown()
kw.pop("lmcache")
second = LLM("v41-mini", lmcache_url=url, **kw)
conn = second.engine.scheduler.connector
inner = conn._on_load


def on_load(op):
    pb = second.engine.runner.pool.view(torch.uint8).view(second.engine.pool.num_blocks, -1)
    for j, u in enumerate(op.units):
        match = [
            (pos, k)
            for pos, units in snap.items()
            for k, b in enumerate(units)
            if torch.equal(pb[u], b)
        ]
        print(f"load [{op.start},{op.end}) unit {j} (block {u}) equals stored {match}")
    return inner(op)


conn._on_load = on_load
try:
    second.generate(prompts, p)
    print("pass2 ok")
except Exception as exc:
    print("pass2 failed:", exc)
second.shutdown()
server.stop()
