"""Pieces of benchmarks/transfer.py for engine-driven loads and for where a load's time goes.

``EngineDriven`` runs the engine's own classes (Locator, Mappings, LocalLoads) against the
benchmark's server: a lookup, the locate that the engine makes on the lookup path, then the
copy from the server's shared-memory L1 into the pool, timed from the decision to load (after
the answer) to the copy's completion event.
"""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path

import torch

from atom.tier.worker_side.local_load import LocalLoads
from atom.tier.worker_side.locator import Locator, Mappings

RETRIEVED = re.compile(r"Retrieved (\d+) tokens in ([\d.]+) seconds")


class ServerLog:
    """The server's own handler time per retrieve, from the lines it logs."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def mark(self) -> None:
        self.offset = self.path.stat().st_size

    def retrieves_s(self) -> list[float]:
        with open(self.path, errors="replace") as f:
            f.seek(self.offset)
            return [float(s) for _, s in RETRIEVED.findall(f.read())]


def write_header(pool_bytes: torch.Tensor, spec, units: list[int], position: int) -> None:
    """Give the source image a header of this layout at ``position`` (what a real image has)."""
    unit, off = divmod(spec.header_offset, spec.block_bytes)
    hdr = torch.tensor([spec.layout_tag, position], dtype=torch.int64).view(torch.uint8)
    pool_bytes[units[unit], off : off + 16] = hdr.to(pool_bytes.device)


class EngineDriven:
    def __init__(self, *, server, ctx, namespace: str, spec, pool: torch.Tensor, sched):
        self.gpu = pool.device.type == "cuda"
        self.sched = sched
        self.mappings = Mappings(pool.device)
        self.locator = Locator(
            url=server.url,
            zmq_context=ctx,
            namespace=namespace,
            world_size=1,
            chunk=256,
            mappings=self.mappings,
        )
        t0 = time.perf_counter()
        self.locator.start_probe(30.0)
        self.locator.wait_probed(30.0)
        self.mappings.wait_mapped(300.0)
        self.map_s = time.perf_counter() - t0
        if self.locator.unsupported or self.mappings.current is None:
            raise RuntimeError(f"engine-driven loads unavailable: {self.locator.unsupported}")
        self.pool = pool
        self.local = LocalLoads(spec, pool, 256)

    def lookup_locate(self, rid: str, tokens: list[int], n: int):
        """(located, lookup seconds, locate seconds), with the read locks of [0, n*256) held."""
        t0 = time.perf_counter()
        self.sched.maybe_submit_lookup_request(rid, tokens)
        hit = None
        while hit is None:
            hit = self.sched.check_lookup_result(rid)
        self.sched.cleanup_lookup_result(rid)
        t1 = time.perf_counter()
        assert hit == n * 256, f"lookup hit {hit}, stored {n * 256}"
        located = self.locator.locate(rid, tokens, hit, 30.0)
        assert located is not None, "locate failed"
        return located, t1 - t0, time.perf_counter() - t1

    def copier(self, streams: int, batch: bool = True, kind: str = "copy_engine") -> LocalLoads:
        """A LocalLoads with ``streams`` copy streams (the engine's has 1); ``batch=False``:
        one runtime call per copy instead of one batched call per load; ``kind="kernel"``:
        one gather kernel per load (``lmcache.load_copy``)."""
        return LocalLoads(
            self.local.spec, self.pool, 256, streams=streams, batch=batch, copier=kind
        )

    def issue(self, located, n: int, dst: list[int], units: list[int], done: list, local=None):
        local = local or self.local
        plan = local.plan(located, 0, n * 256, dst, units)
        local.copy(located, plan, done.append)
        return len(plan)

    def wait(self, done: list, count: int, local=None) -> None:
        local = local or self.local
        while len(done) < count:
            local.poll()

    def free(self, rid: str, tokens: list[int], n: int) -> None:
        self.sched.free_lookup_locks(tokens, 0, n * 256, rid)

    def close(self) -> None:
        self.locator.close()
        self.mappings.close_all()


def event_costs(repeats: int = 50) -> dict:
    """Median ms to create an interprocess CUDA event, record it, export its handle and open
    a handle (what the server does per lmcache_driven operation)."""
    dev = torch.device("cuda")
    out: dict[str, list[float]] = {"create": [], "record": [], "export": [], "open": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        ev = torch.cuda.Event(interprocess=True)
        t1 = time.perf_counter()
        ev.record()
        t2 = time.perf_counter()
        handle = ev.ipc_handle()
        t3 = time.perf_counter()
        try:
            torch.cuda.Event.from_ipc_handle(dev, handle)
            t4 = time.perf_counter()
            out["open"].append(t4 - t3)
        except Exception:  # opening in the creating process is refused on some drivers
            pass
        out["create"].append(t1 - t0)
        out["record"].append(t2 - t1)
        out["export"].append(t3 - t2)
    return {k: round(1e3 * statistics.median(v), 4) if v else None for k, v in out.items()}
