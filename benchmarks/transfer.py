"""Tier transfer throughput: store and load GB/s and latency per operation size, against a
plain copy of the same bytes in the same run.

    python -m benchmarks.transfer [--device cpu|cuda] [--chunks 1 4 16 28] [--repeats 10]

The pool uses a real geometry (v41-mini on CPU, v41-bench on CUDA), registered with a fresh
owned LMCache MP server exactly as the engine registers it (pages + image ordinals). Each
operation moves ``n`` page blocks plus one image (K units). A load is timed from submit to a
terminal future (lookup excluded, measured separately: the lookup that first sees a store,
which the server makes visible on a 5 ms commit timer); events come from a warm pool, as in
the engine; the plain copy is a memcpy on CPU and a
pinned host-to-device copy on CUDA, the copy a perfect load path would do.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from atom.kv_transfer.offload.events import EventPool
from atom.kv_transfer.offload.lmcache_server import LMCacheServer
from atom.kv_transfer.offload.operations import TransferOp
from atom.kv_transfer.offload.worker import (
    SpecShape,
    build_spec,
    group_infos,
    kv_caches,
    share_pool,
    unlink_segment,
)
from atom.models.deepseek_v41.pool_geometry import build_v41_pool_geometry
from atom.models.deepseek_v41.presets import preset_config
from benchmarks.common import md_table, write_results
from benchmarks.serving import plain_copy_seconds


class _Image:
    def __init__(self, units):
        self.units = units


def wait(fut) -> None:
    while not fut.query():
        time.sleep(0.0002)  # a poll interval, as the transfer thread's rounds
    assert fut.result(), "transfer failed"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 16, 28])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    import zmq
    from lmcache.integration.atom import (
        AtomMPParallelConfig,
        AtomMPSchedulerAdapter,
        AtomMPWorkerAdapter,
    )

    gpu = args.device.startswith("cuda")
    model = "v41-bench" if gpu else "v41-mini"
    kv = "bf16" if gpu else "fp32"
    geo = build_v41_pool_geometry(
        preset_config(model), kv_dtype=kv, index_dtype="fp8", block_size=256, speculative_tokens=0
    )
    spec = geo.state_spec()
    k = spec.units_per_image
    max_chunks = max(args.chunks)
    num_blocks = 2 * (max_chunks + k) + 4
    pool = torch.zeros(spec.pool_shape(num_blocks), dtype=spec.pool_dtype, device=args.device)
    segment = share_pool(pool)
    pool.view(torch.uint8).view(num_blocks, -1)[: max_chunks + k].random_(0, 255)
    l1 = max(1.0, 4 * (max_chunks + k) * spec.block_bytes * args.repeats / 2**30)
    server = LMCacheServer(chunk_size=256, l1_size_gb=min(l1, 60.0)).start()
    ctx = zmq.Context()
    ctx.linger = 0
    par = AtomMPParallelConfig(world_size=1, worker_id=0, tp_size=1)
    ns = f"atom-transfer-bench#{os.getpid()}"
    worker = AtomMPWorkerAdapter(
        server.url,
        ctx,
        ns,
        256,
        par,
        mq_timeout=30,
        heartbeat_interval=1.0,
        transfer_mode="lmcache_driven",
    )
    worker.register_kv_caches(kv_caches(pool, k), engine_group_infos=group_infos(256, 256, k))
    sched = AtomMPSchedulerAdapter(server.url, ctx, ns, 256, par, mq_timeout=30)
    events = EventPool(torch.device(args.device))
    shape = SpecShape(256, 256, k)
    rows, raw = [], []
    try:
        for n in args.chunks:
            stores, loads, lookups = [], [], []
            nbytes = (n + k) * spec.block_bytes
            for r in range(args.repeats):
                tokens = torch.randint(0, 256, (n * 256 + 1,)).tolist()
                src = list(range(n))
                src_units = list(range(max_chunks, max_chunks + k))
                dst = list(range(max_chunks + k, max_chunks + k + n))
                dst_units = list(range(2 * max_chunks + k, 2 * max_chunks + 2 * k))
                rid = f"bench-{n}-{r}"
                store = TransferOp("save", rid, tokens, 0, n * 256, src, _Image(src_units), 0)
                event = events.acquire()  # pooled and recorded, as the engine's step thread does
                t0 = time.perf_counter()
                fut = worker.submit_store_request(rid, build_spec(store, shape), event)
                wait(fut)
                stores.append(time.perf_counter() - t0)
                events.recycle(event)
                # the server commits a store on a 5 ms timer: poll until it is visible and time
                # the lookup that saw it
                while True:
                    t0 = time.perf_counter()
                    sched.maybe_submit_lookup_request(rid, tokens)
                    hit = None
                    while hit is None:
                        hit = sched.check_lookup_result(rid)
                    sched.cleanup_lookup_result(rid)
                    if hit == n * 256:
                        break
                    if hit:
                        sched.free_lookup_locks(tokens, 0, hit, rid)
                lookups.append(time.perf_counter() - t0)
                load = TransferOp("load", rid, tokens, 0, n * 256, dst, _Image(dst_units), 0)
                event = events.acquire()
                t0 = time.perf_counter()
                fut = worker.submit_retrieve_request(rid, build_spec(load, shape), event)
                wait(fut)
                loads.append(time.perf_counter() - t0)
                events.recycle(event)
                if gpu:
                    torch.cuda.synchronize()
                pb = pool.view(torch.uint8).view(num_blocks, -1)
                assert torch.equal(pb[dst], pb[src]) and torch.equal(pb[dst_units], pb[src_units])
                sched.end_session(rid)
            copy = plain_copy_seconds(nbytes, args.device)
            s50, l50 = statistics.median(stores), statistics.median(loads)
            row = {
                "chunks": n,
                "mib": round(nbytes / 2**20, 2),
                "store_p50_ms": round(1e3 * s50, 2),
                "store_gbps": round(nbytes / s50 / 1e9, 3),
                "load_p50_ms": round(1e3 * l50, 2),
                "load_gbps": round(nbytes / l50 / 1e9, 3),
                "lookup_p50_ms": round(1e3 * statistics.median(lookups), 2),
                "copy_ms": round(1e3 * copy, 3),
                "copy_gbps": round(nbytes / copy / 1e9, 2),
                "load_over_copy": round(l50 / copy, 1),
            }
            raw.append({**row, "stores_s": stores, "loads_s": loads})
            rows.append(row)
            print(row, flush=True)
    finally:
        worker.shutdown()
        sched.shutdown()
        ctx.term()
        server.stop()
        unlink_segment(segment)
    table = md_table(
        [
            "chunks",
            "MiB",
            "store p50 ms",
            "store GB/s",
            "load p50 ms",
            "load GB/s",
            "lookup p50 ms",
            "plain copy ms",
            "plain copy GB/s",
            "load / copy",
        ],
        [list(r.values()) for r in rows],
    )
    table += (
        f"\n\nGeometry: {model}, block {spec.block_bytes} B, image {k} units "
        f"({spec.state_bytes} B). Every load verified byte-exact against its source.\n"
    )
    name = args.name or ("transfer_h200" if gpu else "transfer_cpu")
    cmd = (
        f"python -m benchmarks.transfer --device {args.device} --chunks "
        f"{' '.join(map(str, args.chunks))} --repeats {args.repeats}"
    )
    print(table)
    print(write_results(name, {"geometry": geo.describe(), "rows": raw}, table, cmd))


if __name__ == "__main__":
    main()
