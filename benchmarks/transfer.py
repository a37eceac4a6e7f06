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

``--burst B`` also submits B loads of the largest size at once (as a wave of requests admitted
together does in serving) and reports each one's latency and the aggregate GB/s: whether the
server overlaps loads or serves them one after another. The same B loads engine-driven run in
each copier variant ``--burst-rounds`` times (default 5), alternating, with their median and
range, and the median as a share of a plain copy's bandwidth.

Both load modes run side by side on the same stored objects: lmcache_driven (the server's
retrieve; its own handler time, from the "Retrieved N tokens in S seconds" lines it logs, is
reported next to the client's latency) and engine_driven (benchmarks/transfer_local.py: the
locate on the lookup path, then the engine's copy from the server's shared-memory L1, timed
from the decision to load to the copy's completion event). On CUDA the cost of an
interprocess event (create, record, export, open), which the server pays per operation, is
measured too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from atom.models.deepseek_v41.pool_geometry import build_v41_pool_geometry
from atom.models.deepseek_v41.presets import preset_config
from atom.tier.operations import TransferOp
from atom.tier.server.lmcache_server import LMCacheServer
from atom.tier.worker_side.events import EventPool
from atom.tier.worker_side.layout import (
    SpecShape,
    build_spec,
    group_infos,
    kv_caches,
    share_pool,
    unlink_segment,
)
from benchmarks.common import md_table, write_results
from benchmarks.serving import plain_copy_seconds
from benchmarks.transfer_local import EngineDriven, ServerLog, event_costs, write_header


class _Image:
    def __init__(self, units):
        self.units = units


def wait(fut) -> None:
    while not fut.query():
        time.sleep(0.0002)  # a poll interval, as the transfer thread's rounds
    assert fut.result(), "transfer failed"


def share(gbps: float, row: dict) -> str:
    """``gbps`` as a percentage of the plain copy's GB/s in ``row`` (same chunks)."""
    return f"{100 * gbps / row['copy_gbps']:.0f}%"


def burst_summary(runs: list[dict]) -> dict:
    """One engine-driven variant's burst rounds: its counts (the same every round), the median
    of each timing, and every round's aggregate GB/s (their spread)."""
    gbps = [r["aggregate_gbps"] for r in runs]
    out = {key: runs[0][key] for key in ("streams", "copier", "gathers", "batched")}
    out |= {key: runs[0][key] for key in ("launches", "copies")}
    for key in ("issue_all_ms", "p50_ms", "max_ms"):
        out[key] = round(statistics.median(r[key] for r in runs), 3)
    out["aggregate_gbps"] = round(statistics.median(gbps), 3)
    out["rounds_gbps"] = [round(g, 3) for g in gbps]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 16, 28])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--burst", type=int, default=0, help="loads submitted at once (0: none)")
    ap.add_argument(
        "--burst-rounds",
        type=int,
        default=5,
        help="measured rounds of each engine-driven burst variant (their median and range)",
    )
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    if args.burst_rounds < 1:
        ap.error(f"--burst-rounds {args.burst_rounds}: give at least 1")
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
    num_blocks = (2 + args.burst) * (max_chunks + k) + 4
    pool = torch.zeros(spec.pool_shape(num_blocks), dtype=spec.pool_dtype, device=args.device)
    segment = share_pool(pool)
    pool.view(torch.uint8).view(num_blocks, -1)[: max_chunks + k].random_(0, 255)
    l1 = max(1.0, 4 * (max_chunks + k) * spec.block_bytes * args.repeats / 2**30)
    server = LMCacheServer(chunk_size=256, l1_size_gb=min(l1, 60.0), shared_l1=True).start()
    slog = ServerLog(server.log_path)
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
    local = EngineDriven(server=server, ctx=ctx, namespace=ns, spec=spec, pool=pool, sched=sched)
    pbytes = pool.view(torch.uint8).view(num_blocks, -1)

    def store_visible(rid, tokens, n, src, src_units) -> tuple[float, float]:
        """Store n chunks + an image; returns (store seconds, seconds of the lookup that first
        saw it: the server commits a store on a 5 ms timer)."""
        store = TransferOp("save", rid, tokens, 0, n * 256, src, _Image(src_units), 0)
        event = events.acquire()  # pooled and recorded, as the engine's step thread does
        t0 = time.perf_counter()
        wait(worker.submit_store_request(rid, build_spec(store, shape), event))
        store_s = time.perf_counter() - t0
        events.recycle(event)
        while True:
            t0 = time.perf_counter()
            sched.maybe_submit_lookup_request(rid, tokens)
            hit = None
            while hit is None:
                hit = sched.check_lookup_result(rid)
            sched.cleanup_lookup_result(rid)
            if hit == n * 256:
                return store_s, time.perf_counter() - t0
            if hit:
                sched.free_lookup_locks(tokens, 0, hit, rid)

    def burst(n: int, b: int) -> dict:
        """b stored prompts loaded at once into distinct blocks; every load verified."""
        src, src_units = list(range(n)), list(range(max_chunks, max_chunks + k))
        write_header(pbytes, spec, src_units, n * 256)
        base = 2 * (max_chunks + k)
        jobs = []
        for i in range(b):
            tokens = torch.randint(0, 256, (n * 256 + 1,)).tolist()
            rid = f"burst-{n}-{i}"
            store_visible(rid, tokens, n, src, src_units)
            dst = list(range(base + i * (n + k), base + i * (n + k) + n))
            units = list(range(dst[-1] + 1, dst[-1] + 1 + k))
            op = TransferOp("load", rid, tokens, 0, n * 256, dst, _Image(units), 0)
            jobs.append((rid, op, events.acquire()))
        slog.mark()
        t0 = time.perf_counter()
        futs = [
            worker.submit_retrieve_request(rid, build_spec(op, shape), ev) for rid, op, ev in jobs
        ]
        submitted = time.perf_counter() - t0
        done: dict[int, float] = {}
        while len(done) < b:
            for i, fut in enumerate(futs):
                if i not in done and fut.query():
                    assert fut.result(), "transfer failed"
                    done[i] = time.perf_counter() - t0
            time.sleep(0.0002)
        if gpu:
            torch.cuda.synchronize()
        handler = slog.retrieves_s()
        pb = pool.view(torch.uint8).view(num_blocks, -1)
        for _, op, ev in jobs:
            assert torch.equal(pb[op.page_blocks], pb[src])
            assert torch.equal(pb[op.image.units], pb[src_units])
            events.recycle(ev)
        # the same b loads engine-driven: one copy stream with one batched runtime call per
        # load (the engine's), one call per run, and two copy streams; lookups and locates
        # first (the answers), then every copy issued at once, timed to the last completion
        # (each load's completion from the GPU's own clock). Each variant once unmeasured (its
        # streams' first use, the gather kernel's compile), then ``--burst-rounds`` measured
        # rounds, the variants' order reversed every other round
        nbytes = (n + k) * spec.block_bytes

        def ed_round(streams: int, batch: bool, kind: str) -> dict:
            copier = local.copier(streams, batch, kind)
            located = []
            for rid, op, _ in jobs:
                pb[op.page_blocks] = 0
                pb[op.image.units] = 0
                located.append(local.lookup_locate(rid, op.token_ids, n)[0])
            got: list[float] = []
            t1 = time.monotonic()
            for loc, (_, op, _) in zip(located, jobs):
                local.issue(loc, n, op.page_blocks, op.image.units, got, copier)
            issued = time.monotonic() - t1
            local.wait(got, b, copier)
            ed_lat = sorted(t - t1 for t in got)
            for rid, op, _ in jobs:
                assert torch.equal(pb[op.page_blocks], pb[src])
                assert torch.equal(pb[op.image.units], pb[src_units])
                local.free(rid, op.token_ids, n)
            return {
                "streams": streams,
                "copier": kind,
                "gathers": copier.gathers,
                "batched": copier.launches < copier.copies,
                "launches": copier.launches,
                "copies": copier.copies,
                "issue_all_ms": 1e3 * issued,
                "p50_ms": 1e3 * statistics.median(ed_lat),
                "max_ms": 1e3 * ed_lat[-1],
                "aggregate_gbps": b * nbytes / ed_lat[-1] / 1e9,
            }

        variants = [
            (1, True, "copy_engine"),
            (1, False, "copy_engine"),
            (2, True, "copy_engine"),
            (1, True, "kernel"),
        ]
        for v in variants:
            ed_round(*v)
        measured: dict[tuple, list[dict]] = {v: [] for v in variants}
        for r in range(args.burst_rounds):
            for v in variants if r % 2 == 0 else variants[::-1]:
                measured[v].append(ed_round(*v))
        ed = [burst_summary(runs) for runs in measured.values()]
        for rid, _, _ in jobs:
            sched.end_session(rid)
        lat = sorted(done.values())
        return {
            "server_handler_ms": [round(1e3 * h, 2) for h in handler],
            "server_handler_sum_ms": round(1e3 * sum(handler), 2),
            "engine_driven": ed,
            "burst": b,
            "chunks": n,
            "mib_each": round(nbytes / 2**20, 2),
            "submit_all_ms": round(1e3 * submitted, 2),
            "latency_p50_ms": round(1e3 * statistics.median(lat), 2),
            "latency_max_ms": round(1e3 * lat[-1], 2),
            "aggregate_gbps": round(b * nbytes / lat[-1] / 1e9, 3),
        }

    bursts = []
    try:
        for n in args.chunks:
            stores, loads, lookups = [], [], []
            handler, ed_loads, ed_lookups, ed_locates, ed_runs = [], [], [], [], []
            nbytes = (n + k) * spec.block_bytes
            for r in range(args.repeats):
                tokens = torch.randint(0, 256, (n * 256 + 1,)).tolist()
                src = list(range(n))
                src_units = list(range(max_chunks, max_chunks + k))
                dst = list(range(max_chunks + k, max_chunks + k + n))
                dst_units = list(range(2 * max_chunks + k, 2 * max_chunks + 2 * k))
                rid = f"bench-{n}-{r}"
                write_header(pbytes, spec, src_units, n * 256)
                store_s, lookup_s = store_visible(rid, tokens, n, src, src_units)
                stores.append(store_s)
                lookups.append(lookup_s)
                load = TransferOp("load", rid, tokens, 0, n * 256, dst, _Image(dst_units), 0)
                event = events.acquire()
                slog.mark()
                t0 = time.perf_counter()
                fut = worker.submit_retrieve_request(rid, build_spec(load, shape), event)
                wait(fut)
                loads.append(time.perf_counter() - t0)
                handler += slog.retrieves_s()
                events.recycle(event)
                if gpu:
                    torch.cuda.synchronize()
                pb = pool.view(torch.uint8).view(num_blocks, -1)
                assert torch.equal(pb[dst], pb[src]) and torch.equal(pb[dst_units], pb[src_units])
                # the same load, engine-driven, into the zeroed destination
                pb[dst] = 0
                pb[dst_units] = 0
                located, lk_s, loc_s = local.lookup_locate(rid, tokens, n)
                got: list[float] = []
                t0 = time.monotonic()
                ed_runs.append(local.issue(located, n, dst, dst_units, got))
                local.wait(got, 1)
                ed_loads.append(got[0] - t0)
                ed_lookups.append(lk_s)
                ed_locates.append(loc_s)
                assert torch.equal(pb[dst], pb[src]) and torch.equal(pb[dst_units], pb[src_units])
                local.free(rid, tokens, n)
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
                "server_handler_p50_ms": (
                    round(1e3 * statistics.median(handler), 2) if handler else None
                ),
                "copy_ms": round(1e3 * copy, 3),
                "copy_gbps": round(nbytes / copy / 1e9, 2),
                "load_over_copy": round(l50 / copy, 1),
                "ed_locate_p50_ms": round(1e3 * statistics.median(ed_locates), 3),
                "ed_load_p50_ms": round(1e3 * statistics.median(ed_loads), 3),
                "ed_load_gbps": round(nbytes / statistics.median(ed_loads) / 1e9, 3),
                "ed_load_over_copy": round(statistics.median(ed_loads) / copy, 2),
                "ed_copies": ed_runs[0],
            }
            raw.append(
                {
                    **row,
                    "stores_s": stores,
                    "loads_s": loads,
                    "server_handler_s": handler,
                    "ed_loads_s": ed_loads,
                    "ed_lookups_s": ed_lookups,
                    "ed_locates_s": ed_locates,
                }
            )
            rows.append(row)
            print(row, flush=True)
        if args.burst:
            bursts.append(burst(max_chunks, args.burst))
            print(bursts[-1], flush=True)
        events_ms = event_costs() if gpu else None
    finally:
        local.close()
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
            "server handler p50 ms",
            "plain copy ms",
            "plain copy GB/s",
            "load / copy",
            "ED locate p50 ms",
            "ED load p50 ms",
            "ED load GB/s",
            "ED load / copy",
            "ED copies",
        ],
        [list(r.values()) for r in rows],
    )
    table += (
        f"\n\nGeometry: {model}, block {spec.block_bytes} B, image {k} units "
        f"({spec.state_bytes} B). Every load verified byte-exact against its source.\n"
        "\nLoad = lmcache_driven (the server's retrieve, submit to terminal future); server "
        "handler = the retrieve's own time as the server logs it. ED = engine_driven: locate = "
        "the RPC on the lookup path that says where the objects sit; load = the decision to "
        "load to the copy's completion event (the copy from the server's shared-memory L1 "
        "into the pool; 'copies' = copies after merging contiguous runs, one runtime call per "
        f"load where the CUDA runtime batches). Mapping the "
        f"L1 ({server.l1_size_gb:g} GiB) took {local.map_s:.2f} s at start.\n"
    )
    if events_ms is not None:
        table += (
            f"\nInterprocess CUDA event, median ms: create {events_ms['create']}, record "
            f"{events_ms['record']}, export handle {events_ms['export']}, open handle "
            f"{events_ms['open']} (the server creates, exports and opens one per operation).\n"
        )
    for row in bursts:
        single = next(r for r in rows if r["chunks"] == row["chunks"])
        table += (
            f"\n{row['burst']} loads of {row['chunks']} chunks ({row['mib_each']} MiB each) "
            f"submitted at once (in {row['submit_all_ms']} ms): latency p50 "
            f"{row['latency_p50_ms']} ms, last {row['latency_max_ms']} ms, aggregate "
            f"{row['aggregate_gbps']} GB/s (one load alone: {single['load_p50_ms']} ms, "
            f"{single['load_gbps']} GB/s). The server's handler times sum to "
            f"{row['server_handler_sum_ms']} ms (each: {row['server_handler_ms']}).\n"
            + f"Engine-driven, the same {row['burst']} loads issued at once, medians over "
            f"{args.burst_rounds} rounds (each variant once more first, unmeasured):\n"
            + "".join(
                f"- {e['streams']} copy stream{'s' if e['streams'] > 1 else ''}, {e['copies']} "
                f"copies in {e['launches']} runtime calls"
                + (f" ({e['gathers']} of them gather kernels)" if e["gathers"] else "")
                + f" (issued in {e['issue_all_ms']} ms): p50 {e['p50_ms']} ms, last "
                f"{e['max_ms']} ms, aggregate {e['aggregate_gbps']} GB/s "
                f"({share(e['aggregate_gbps'], single)} of a plain copy; rounds "
                f"{min(e['rounds_gbps'])}-{max(e['rounds_gbps'])} GB/s).\n"
                for e in row["engine_driven"]
            )
        )
    name = args.name or ("transfer_h200" if gpu else "transfer_cpu")
    cmd = (
        f"python -m benchmarks.transfer --device {args.device} --chunks "
        f"{' '.join(map(str, args.chunks))} --repeats {args.repeats}"
        + (f" --burst {args.burst} --burst-rounds {args.burst_rounds}" if args.burst else "")
    )
    print(table)
    data = {"geometry": geo.describe(), "rows": raw, "bursts": bursts, "event_ms": events_ms}
    print(write_results(name, data, table, cmd))


if __name__ == "__main__":
    main()
