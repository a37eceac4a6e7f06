"""Tier save latency in both save modes, per save size, against a plain copy of the same bytes.

    python -m benchmarks.transfer_saves [--device cpu|cuda] [--chunks 1 4 16 28] [--repeats 10]
                                        [--burst 16]

The pool uses a real geometry (v41-mini on CPU, v41-bench on CUDA), registered with a fresh
owned LMCache MP server (L1 in shared memory, atom's server module) exactly as the engine
registers it. Each save moves ``n`` page blocks plus one image (K units) of new tokens:

  * lmcache_driven: the server's store (``submit_store_request``), timed from submit to a
    terminal future, as the transfer thread sees it;
  * engine_driven: the engine's own ``EngineSaves`` (worker_side/local_save.py): one
    ``atom.reserve``, the engine's copy into the reserved spans, one ``atom.commit``, timed
    from the reserve's send to the commit's answer, polled as the transfer thread's rounds
    poll (its ``flush`` sends the commit).

Every engine-driven save is checked: a lookup sees it whole, and the located objects hold the
pool's bytes. The plain copy is a memcpy on CPU and a device-to-pinned-host copy on CUDA, of
random bytes into memory already touched (what a save must move at least; a save writes L1
memory the server may never have touched, whose first write faults its pages in).
``--burst B`` also saves B prompts of the largest size at once (one reserve call and one
commit call for all of them, engine-driven; B stores at once, lmcache_driven) and reports the
latency of the last and the aggregate GB/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from atom.models.deepseek_v41.pool_geometry import build_v41_pool_geometry
from atom.models.deepseek_v41.presets import preset_config
from atom.tier.operations import SaveAhead, TransferOp
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
from atom.tier.worker_side.local_save import EngineSaves
from atom.tier.worker_side.locator import Locator, Mappings
from benchmarks.common import md_table, write_results
from benchmarks.transfer_local import write_header

CHUNK = 256


class _Image:
    def __init__(self, units):
        self.units = units


def poll(futs: list, saves: EngineSaves | None = None) -> list[float]:
    """Poll ``futs`` as the transfer thread does (query each, then the round's flush) until
    every one is terminal; each one's seconds from the call."""
    t0, done = time.perf_counter(), {}
    while len(done) < len(futs):
        for i, fut in enumerate(futs):
            if i not in done and fut.query():
                assert fut.result(), f"save failed: {getattr(fut, 'error', '')}"
                done[i] = time.perf_counter() - t0
        if saves is not None:
            saves.flush()
        time.sleep(0.0002)  # a poll interval, as the transfer thread's rounds
    return [done[i] for i in range(len(futs))]


SAVE_PHASES = ("queued", "reserve", "copy", "to_commit", "commit")


def phase_ms(phases: list[dict], phase: str) -> float | str:
    got = [p[phase] for p in phases if phase in p]
    return round(1e3 * statistics.median(got), 3) if got else ""


def copy_seconds(nbytes: int, device: str, repeats: int = 20) -> float:
    """Median plain copy of ``nbytes`` in a save's direction (device -> pinned host on GPU)."""
    gpu = device.startswith("cuda")
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.ones(nbytes, dtype=torch.uint8, pin_memory=gpu)  # touched: no first faults
    times = []
    for _ in range(repeats):
        if gpu:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1000)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 16, 28])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--burst", type=int, default=0, help="saves submitted at once (0: none)")
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
    model, kv = ("v41-bench", "bf16") if gpu else ("v41-mini", "fp32")
    geo = build_v41_pool_geometry(
        preset_config(model), kv_dtype=kv, index_dtype="fp8", block_size=CHUNK, speculative_tokens=0
    )
    spec = geo.state_spec()
    k, max_chunks = spec.units_per_image, max(args.chunks)
    num_blocks = max_chunks + k + 4
    pool = torch.zeros(spec.pool_shape(num_blocks), dtype=spec.pool_dtype, device=args.device)
    segment = share_pool(pool)
    pbytes = pool.view(torch.uint8).view(num_blocks, -1)
    pbytes[: max_chunks + k].random_(0, 255)
    src, units = list(range(max_chunks)), list(range(max_chunks, max_chunks + k))
    saves_per_size = 2 * args.repeats + 2 * args.burst
    l1 = 2 * saves_per_size * (max_chunks + k) * spec.block_bytes * len(args.chunks) / 2**30
    server = LMCacheServer(chunk_size=CHUNK, l1_size_gb=min(max(1.0, l1), 60.0), shared_l1=True)
    server.start()
    ctx = zmq.Context()
    ctx.linger = 0
    par = AtomMPParallelConfig(world_size=1, worker_id=0, tp_size=1)
    ns = f"atom-transfer-saves-bench#{os.getpid()}"
    worker = AtomMPWorkerAdapter(
        server.url, ctx, ns, CHUNK, par, mq_timeout=30, heartbeat_interval=1.0,
        transfer_mode="lmcache_driven",
    )  # fmt: skip
    worker.register_kv_caches(kv_caches(pool, k), engine_group_infos=group_infos(CHUNK, CHUNK, k))
    sched = AtomMPSchedulerAdapter(server.url, ctx, ns, CHUNK, par, mq_timeout=30)
    events = EventPool(torch.device(args.device))
    shape = SpecShape(CHUNK, CHUNK, k)

    def store(op):
        return worker.submit_store_request(op.lmc_id, build_spec(op, shape), op.event)

    saves = EngineSaves(
        url=server.url, zmq_context=ctx, namespace=ns, world_size=1, worker_id=0, pool=pool,
        block_size=CHUNK, chunk_size=CHUNK, units_per_image=k, rpc_timeout_s=30.0,
        transfer_timeout_s=30.0,
    )  # fmt: skip
    saves.fallback = store
    saves.start_probe(30.0)
    mappings = Mappings(pool.device)  # read-only: the check reads what the engine wrote
    locator = Locator(
        url=server.url, zmq_context=ctx, namespace=ns, world_size=1, chunk=CHUNK, mappings=mappings
    )
    locator.start_probe(30.0)
    deadline = time.monotonic() + 300
    while saves.mode != "engine_driven" or saves.mappings.current is None or not mappings.current:
        assert time.monotonic() < deadline, (saves.mode, locator.mode)
        time.sleep(0.05)  # a poll round: the probes and the mappings run on threads of their own
    ids = iter(range(10**9))

    def new_op(n: int) -> TransferOp:
        tokens = torch.randint(0, 256, (n * CHUNK + 1,)).tolist()
        op = TransferOp(
            "save", f"save-{next(ids)}", tokens, 0, n * CHUNK, src[:n], _Image(units), 0
        )
        op.deadline = time.monotonic() + 60.0
        op.event = events.acquire()  # recorded after the pool's writes, as the step thread does
        return op

    def check(op: TransferOp, n: int) -> None:
        """A lookup sees the save whole; the located objects hold the pool's bytes."""
        sched.maybe_submit_lookup_request(op.lmc_id, op.token_ids)
        hit = None
        while hit is None:
            hit = sched.check_lookup_result(op.lmc_id)
        sched.cleanup_lookup_result(op.lmc_id)
        assert hit == n * CHUNK, f"lookup hit {hit} of {n * CHUNK}"
        located = locator.locate(op.lmc_id, op.token_ids, hit, 30.0)
        assert located is not None, "locate failed"
        bb, host = spec.block_bytes, pbytes.cpu()
        for i, (off, length) in enumerate(located.pages):
            assert located.mapping.read(off, length) == host[i].numpy().tobytes()
        off, length = located.image
        assert located.mapping.read(off, length) == host[units].numpy().tobytes()
        assert length == k * bb
        sched.free_lookup_locks(op.token_ids, 0, hit, op.lmc_id)
        sched.end_session(op.lmc_id)

    rows, raw, bursts, phase_rows = [], [], [], []
    try:
        for n in args.chunks:
            write_header(pbytes, spec, units, n * CHUNK)
            nbytes = (n + k) * spec.block_bytes
            server_s, engine_s, phases = [], [], []
            hold_s, visible_s, ahead_phases = [], [], []
            saves.on_phases = phases.append  # each copied save's phases (EngineSave.phases)
            for _ in range(args.repeats):
                op = new_op(n)
                server_s += poll([store(op)])
                events.recycle(op.event)
                op = new_op(n)
                before = dict(saves.counts)
                engine_s += poll(saves.reserve([op]), saves)
                assert saves.counts["copied"] == before["copied"] + 1, saves.counts
                events.recycle(op.event)
                check(op, n)
                # reserved ahead, as the engine reserves a step's saves before its forward:
                # timed from the save's submission once the reserve was answered
                op = new_op(n)
                call = saves.send_reserve([SaveAhead(op.lmc_id, op.token_ids, op.start, op.end)])
                while not call.read():
                    time.sleep(0.0002)  # the forward's time, during which the answer comes
                op.submitted_at = time.monotonic()
                save = saves.claim(op, call, 0)
                saves.on_phases = ahead_phases.append
                visible_s += poll([save], saves)
                saves.on_phases = phases.append
                hold_s.append(save.copied_at - op.submitted_at)
                events.recycle(op.event)
                check(op, n)
            copy = copy_seconds(nbytes, args.device)
            s50, e50 = statistics.median(server_s), statistics.median(engine_s)
            h50, v50 = statistics.median(hold_s), statistics.median(visible_s)
            row = {
                "chunks": n,
                "mib": round(nbytes / 2**20, 2),
                "server_store_p50_ms": round(1e3 * s50, 3),
                "engine_save_p50_ms": round(1e3 * e50, 3),
                "engine_over_server": round(e50 / s50, 2),
                "copy_ms": round(1e3 * copy, 3),
                "server_over_copy": round(s50 / copy, 1),
                "engine_over_copy": round(e50 / copy, 1),
                "ahead_hold_p50_ms": round(1e3 * h50, 3),
                "ahead_hold_over_copy": round(h50 / copy, 1),
                "ahead_visible_p50_ms": round(1e3 * v50, 3),
            }
            rows.append(row)
            phase_rows.append([n] + [phase_ms(phases, p) for p in SAVE_PHASES])
            raw.append(
                {**row, "server_store_s": server_s, "engine_save_s": engine_s, "phases": phases,
                 "ahead_hold_s": hold_s, "ahead_visible_s": visible_s,
                 "ahead_phases": ahead_phases}
            )  # fmt: skip
            print(row, flush=True)
        if args.burst:
            n, b = max_chunks, args.burst
            write_header(pbytes, spec, units, n * CHUNK)
            nbytes = (n + k) * spec.block_bytes
            ops = [new_op(n) for _ in range(b)]
            server_lat = poll([store(op) for op in ops])
            ops2 = [new_op(n) for _ in range(b)]
            engine_lat = poll(saves.reserve(ops2), saves)
            for op in ops + ops2:
                events.recycle(op.event)
            for op in ops2:
                check(op, n)
            bursts.append(
                {
                    "burst": b,
                    "chunks": n,
                    "mib_each": round(nbytes / 2**20, 2),
                    "server_last_ms": round(1e3 * max(server_lat), 2),
                    "server_gbps": round(b * nbytes / max(server_lat) / 1e9, 3),
                    "engine_last_ms": round(1e3 * max(engine_lat), 2),
                    "engine_gbps": round(b * nbytes / max(engine_lat) / 1e9, 3),
                }
            )
            print(bursts[-1], flush=True)
    finally:
        saves.close()
        locator.close()
        mappings.close_all()
        worker.shutdown()
        sched.shutdown()
        ctx.term()
        server.stop()
        unlink_segment(segment)
    table = md_table(
        [
            "chunks",
            "MiB",
            "server store p50 ms",
            "engine save p50 ms",
            "engine / server",
            "plain copy ms",
            "server / copy",
            "engine / copy",
            "ahead: hold p50 ms",
            "hold / copy",
            "ahead: visible p50 ms",
        ],
        [list(r.values()) for r in rows],
    )
    table += (
        "\n\nengine save: the reserve sent when the save is submitted, timed to the commit's "
        "answer. ahead: the reserve sent before the save exists and answered (as the engine "
        "sends a step's reserves before its forward); hold = the save's submission to its "
        "copy's completion (when its blocks are released), visible = to the commit's answer "
        "(lookups see it)."
    )
    table += (
        "\n\nWhere an engine-driven save's time goes (p50 ms per phase, as the polling loop "
        "saw each step: queued = submission to the reserve's send, reserve = the call's "
        "round-trip, copy = issue to completion seen, to_commit = completion to the round's "
        "commit call, commit = its round-trip):\n\n"
        + md_table(["chunks", *SAVE_PHASES], phase_rows)
    )
    if bursts:
        table += "\n\n" + md_table(
            ["burst", "chunks", "MiB each", "server last ms", "server GB/s", "engine last ms",
             "engine GB/s"],
            [list(r.values()) for r in bursts],
        )  # fmt: skip
    name = args.name or f"transfer_saves_{'h200' if gpu else 'cpu'}"
    cmd = f"python -m benchmarks.transfer_saves --device {args.device} --chunks " + " ".join(
        map(str, args.chunks)
    )
    cmd += f" --repeats {args.repeats}" + (f" --burst {args.burst}" if args.burst else "")
    path = write_results(name, {"rows": raw, "bursts": bursts}, table, cmd)
    print(table)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
