"""Probe: which image lands in the units when a multi-chunk load follows per-chunk stores?"""

import os

import torch
import zmq
from lmcache.integration.atom import (
    AtomMPParallelConfig,
    AtomMPSchedulerAdapter,
    AtomMPWorkerAdapter,
)

from atom.kv_transfer.offload.events import EventPool
from atom.kv_transfer.offload.lmcache_server import LMCacheServer
from atom.kv_transfer.offload.operations import TransferOp
from atom.kv_transfer.offload.worker import (
    SpecShape,
    build_spec,
    group_infos,
    kv_caches,
    share_pool,
)

dev = os.environ.get("DEV", "cuda")
B, K, NB, R = 256, 2, 32, 64
pool = torch.zeros(NB, B, R, dtype=torch.int32, device=dev)
share_pool(pool)
pb = pool.view(torch.uint8).view(NB, -1)
for b in range(NB):
    pb[b].fill_(b)
srv = LMCacheServer(chunk_size=B, l1_size_gb=1).start()
ctx = zmq.Context()
ctx.linger = 0
par = AtomMPParallelConfig(world_size=1, worker_id=0, tp_size=1)
w = AtomMPWorkerAdapter(
    srv.url,
    ctx,
    "probe",
    B,
    par,
    mq_timeout=30,
    heartbeat_interval=1,
    transfer_mode="lmcache_driven",
)
w.register_kv_caches(kv_caches(pool, K), engine_group_infos=group_infos(B, B, K))
s = AtomMPSchedulerAdapter(srv.url, ctx, "probe", B, par, mq_timeout=30)
ev = EventPool(torch.device(dev))
shape = SpecShape(B, B, K)


class Img:
    def __init__(self, u):
        self.units = u


def run(kind, rid, toks, start, end, pages, units):
    op = TransferOp(kind, rid, toks, start, end, pages, Img(units), 0)
    f = (w.submit_store_request if kind == "save" else w.submit_retrieve_request)(
        rid, build_spec(op, shape), ev.acquire()
    )
    ok = f.result(30)
    torch.cuda.synchronize() if dev == "cuda" else None
    return ok


def lookup(rid, toks, want):
    for i in range(500):  # a store becomes visible to lookups a few ms after it resolves
        s.maybe_submit_lookup_request(f"{rid}-{i}", toks)
        while (h := s.check_lookup_result(f"{rid}-{i}")) is None:
            pass
        s.cleanup_lookup_result(f"{rid}-{i}")
        if h == want:
            return h, f"{rid}-{i}"
        if h:
            s.free_lookup_locks(toks, 0, h, f"{rid}-{i}")
    return h, f"{rid}-{i}"


for case in ("per-chunk stores", "one store"):
    toks = torch.randint(0, 200, (3 * B,)).tolist()
    rid = case.replace(" ", "-")
    if case == "per-chunk stores":
        print(
            case,
            run("save", rid, toks, 0, B, [0], [10, 11]),
            run("save", rid, toks, B, 2 * B, [1], [12, 13]),
        )
    else:
        print(case, run("save", rid, toks, 0, 2 * B, [0, 1], [12, 13]))
    for start in (0, B):
        r2 = f"{rid}-load{start}"
        h, r3 = lookup(r2, toks[: 2 * B + 1], 2 * B)
        pages = [20, 21][start // B :]
        for b in pages + [22, 23]:
            pb[b].fill_(255)
        ok = run("load", r3, toks, start, 2 * B, pages, [22, 23])
        got = [int(pb[b][0]) for b in pages + [22, 23]]
        print(f"  lookup {h} load [{start},{2*B}) ok={ok} pages,units first bytes={got}")
w.shutdown()
s.shutdown()
srv.stop()
