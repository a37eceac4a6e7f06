"""Engine-driven loads: copy located objects from the server's L1 into the pool (step thread).

``LocalLoads.plan`` checks what a load is about to copy, and ``copy`` copies it:
  * every object has the length this layout gives it (a chunk's pages: blocks_per_chunk x
    block_bytes; the image: units_per_image x block_bytes), and the image's header, read from
    the source bytes, carries this layout's tag and the load's own boundary;
  * the copies run in as few pieces as contiguity allows (a run of consecutive source bytes
    into consecutive pool blocks is one copy).
On CUDA the copies are issued straight into the CUDA runtime that torch loaded (cuda_copy.py:
one ``cudaMemcpyBatchAsync`` call per load where the runtime has it, else one
``cudaMemcpyAsync`` per run, about 20 us less each than ``Tensor.copy_``, which a burst of loads
of many chunks pays hundreds of times; ``Tensor.copy_`` when that runtime cannot be reached),
on a copy stream of their own. With ``copier="kernel"`` a load is instead one kernel launch
that reads the registered L1 bytes over the bus (atom/kernels/host_gather.py), where Triton
imports and every run is 16-byte aligned; the copy engines otherwise. The copy stream first
waits for the compute stream (an earlier forward may still read a block being overwritten), and
the compute stream waits on the copy's event, so the next forward (and the image restore) is
ordered after the load with no host wait: the load is complete for the scheduler as soon as it
is issued. The issue's copy, event and stream-wait calls keep the interpreter lock
(cuda_events.py: torch's let go of it, and getting it back from the tier's other threads cost
more than the calls). On CPU the copies are plain and synchronous.

The lookup's read locks on the source objects are released only after the copy completed
(``poll`` frees them when the copy's event has fired; on CPU at once), and the mapping
counts the copy as in flight until then, so neither the server nor an unmap can pull the
bytes out from under it.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from atom.kernels.host_gather import aligned
from atom.model_api import StateSpec, pool_bytes
from atom.tier.worker_side.cuda_copy import HOST_TO_DEVICE, RawCopier
from atom.tier.worker_side.cuda_events import StreamEvents
from atom.tier.worker_side.locator import Located

log = logging.getLogger("atom.offload")


class LocalLoadError(RuntimeError):
    pass


@dataclass
class _Pending:
    issued: object  # timing event recorded on an idle stream at the issue
    starts: list  # one timing event per copy stream used, after its wait for compute
    ends: list  # one timing event per copy stream used, after its last copy
    mapping: object
    on_done: Callable[[float], None]  # gets the time the copy completed
    issued_at: float  # monotonic time of the issue
    phases: dict  # host phases so far (plan, issue), seconds
    marks: list  # per copy stream, the event on compute it waited for
    held: list  # what the copies read until they completed (a gather's table)


PHASES = ("plan", "issue", "issue_cpu", "wait", "copy")
"""An engine-driven load's latency by phase (``LocalLoads.on_phases``):
  plan   host: from the decision to load (``decided_at``) to the first copy's issue (checks,
         the header read, the runs);
  issue  host: issuing the copies (the step thread's share of the load);
  issue_cpu  the step thread's CPU time within ``issue`` (for the rest of ``issue`` it waited:
         in the runtime, or for the interpreter lock); part of ``issue``, not a phase after it;
  wait   device: from the issue until the copy stream is past the compute stream's earlier
         work (0 on CPU);
  copy   device: the copies themselves (on CPU: the synchronous copy)."""


def runs(pieces: list[tuple[int, int, int]], bb: int) -> list[tuple[int, int, int]]:
    """Merge (src_offset, dst_block, blocks) pieces into maximal runs where both the source
    bytes and the destination blocks continue each other."""
    out: list[list[int]] = []
    for src, dst, n in pieces:
        if out:
            s, d, m = out[-1]
            if s + m * bb == src and d + m == dst:
                out[-1][2] += n
                continue
        out.append([src, dst, n])
    return [tuple(r) for r in out]


class LocalLoads:
    def __init__(
        self,
        spec: StateSpec,
        pool_tensor: torch.Tensor,
        chunk: int,
        streams: int = 1,
        batch: bool = True,
        copier: str = "copy_engine",
    ):
        self.spec, self.chunk = spec, chunk
        self.bb = spec.block_bytes
        self.bpc = chunk // spec.block_size
        self.blocks = pool_bytes(pool_tensor)  # [num_blocks, block_bytes] uint8 view
        self.cuda = pool_tensor.device.type == "cuda"
        dev = pool_tensor.device
        # with several streams copies alternate between them (lmcache.load_streams; a burst of
        # 16 loads of 28 chunks: the same bandwidth with 2 as with 1 on the H200, 88-89%
        # against 81-92% of a plain copy on H100s)
        self.streams = streams
        self._streams = [torch.cuda.Stream(dev) for _ in range(streams)] if self.cuda else []
        self._clock = torch.cuda.Stream(dev) if self.cuda else None  # never given work
        self._raw = RawCopier.of_runtime("loads", batch) if self.cuda else RawCopier()
        # the issue's events and stream waits keep the interpreter lock (cuda_events.py)
        self._ev = StreamEvents.of_device(dev) if self.cuda else None
        if copier not in ("copy_engine", "kernel"):
            raise ValueError(f"load copier {copier!r}: use 'copy_engine' or 'kernel'")
        self._gather = None
        if self.cuda and copier == "kernel":
            from atom.kernels.host_gather import HostGather

            self._gather = HostGather()
            if not self._gather.available:
                log.warning("load_copy=kernel: Triton does not import; loads use the copy engines")
                self._gather = None
        # the pool as 4-byte words (the gather kernel's destination)
        self._words = (
            self.blocks.view(-1).view(torch.int32)
            if self._gather is not None and self.bb % 16 == 0
            else None
        )
        self._pending: list[_Pending] = []
        self._free: list = []  # completed loads' events, reused
        # gets each completed load's phases ({phase: seconds} over ``PHASES``), or None
        self.on_phases: Callable[[dict], None] | None = None
        self.copies = 0  # copies issued (runs), for the benchmark
        self.bytes = 0

    # ---- checks (host reads of the source; no device work) --------------------------------

    def plan(self, located: Located, start: int, end: int, page_blocks, units) -> list:
        """The runs of a load of [start, end) into ``page_blocks`` and ``units``; raises
        LocalLoadError when the located objects cannot be this load."""
        if end != located.end:
            raise LocalLoadError(f"located up to {located.end}, load ends at {end}")
        bb, bpc = self.bb, self.bpc
        first, last = start // self.chunk, end // self.chunk
        if len(page_blocks) != (last - first) * bpc:
            raise LocalLoadError(f"{len(page_blocks)} blocks for chunks [{first}, {last})")
        pieces = []
        for i in range(first, last):
            off, length = located.pages[i]
            if length != bpc * bb:
                raise LocalLoadError(f"chunk {i}: object of {length} B, expected {bpc * bb}")
            base = (i - first) * bpc
            pieces += [(off + j * bb, page_blocks[base + j], 1) for j in range(bpc)]
        off, length = located.image
        k = self.spec.units_per_image
        if length != k * bb or len(units) != k:
            raise LocalLoadError(f"image object of {length} B, expected {k} x {bb}")
        self._check_header(located.mapping, off, end)
        pieces += [(off + j * bb, int(units[j]), 1) for j in range(k)]
        return runs(pieces, bb)

    def _check_header(self, mapping, image_off: int, end: int) -> None:
        tag, position = struct.unpack("<qq", mapping.read(image_off + self.spec.header_offset, 16))
        if tag != self.spec.layout_tag:
            raise LocalLoadError(f"image of another layout (tag {tag:#x})")
        if position != end:
            raise LocalLoadError(f"image of boundary {position}, expected {end}")

    # ---- the copy ----------------------------------------------------------------------------

    def copy(
        self,
        located: Located,
        plan: list,
        on_done: Callable[[float], None],
        decided_at: float | None = None,
    ) -> None:
        """Issue the copies of ``plan`` from ``located``'s mapping; ``on_done(t)`` runs (from
        ``poll``, or now on CPU) once they completed, with ``t`` the completion time on the
        monotonic clock (on CUDA: the issue time plus the GPU's own elapsed time from the
        issue to the last copy, so a late poll does not lengthen the measured load).
        ``decided_at``: when the load was decided (monotonic), for the ``plan`` phase."""
        src, dst, bb = located.mapping.data, self.blocks, self.bb
        t0, c0 = time.monotonic(), time.thread_time()
        phases = {"plan": t0 - decided_at if decided_at is not None else 0.0}
        if not self.cuda:
            for s, d, n in plan:
                dst[d : d + n].view(-1).copy_(src[s : s + n * bb])
            self._count(plan)
            t1 = time.monotonic()
            self._report(phases | {"issue": 0.0, "issue_cpu": 0.0, "wait": 0.0, "copy": t1 - t0})
            on_done(t1)
            return
        compute, ev = torch.cuda.current_stream(dst.device), self._ev
        issued = self._event()
        ev.record(issued, self._clock)  # an idle stream: it marks the issue on the GPU's clock
        starts, ends, marks, held = [], [], [], []
        for i, stream in enumerate(self._streams):
            part = plan[i :: len(self._streams)]  # runs alternate between the copy streams
            if not part:
                continue
            after = self._event()
            ev.record(after, compute)
            ev.wait(stream, after)  # an earlier forward may still read these blocks
            start = self._event()
            ev.record(start, stream)  # fires once the stream is past compute's earlier work
            table = self._kernel_copies(stream, located.mapping, part)
            if table is not None:
                held.append(table)
            elif not self._raw_copies(stream, located.mapping, dst, part):
                with torch.cuda.stream(stream):
                    for s, d, n in part:
                        dst[d : d + n].view(-1).copy_(src[s : s + n * bb], non_blocking=True)
            end = self._event()
            ev.record(end, stream)
            ev.wait(compute, end)
            starts.append(start)
            ends.append(end)
            marks.append(after)
        self._count(plan)
        located.mapping.in_flight += 1
        phases["issue"] = time.monotonic() - t0
        phases["issue_cpu"] = time.thread_time() - c0
        self._pending.append(
            _Pending(issued, starts, ends, located.mapping, on_done, t0, phases, marks, held)
        )

    def _event(self):
        """A timing event (a ``StreamEvents`` handle) from the pool of those whose loads
        completed (creating one costs the step thread a few microseconds; a load takes four)."""
        return self._free.pop() if self._free else self._ev.new()

    def _report(self, phases: dict) -> None:
        if self.on_phases is not None:
            try:
                self.on_phases(phases)
            except Exception:  # noqa: BLE001 - a metric never fails a load
                log.debug("load phases not recorded", exc_info=True)

    def _kernel_copies(self, stream, mapping, plan: list):
        """Issue ``plan`` as one gather kernel on ``stream`` (registered source, every run
        16-byte aligned); returns the table the kernel reads, or None (not issued)."""
        if self._words is None or not mapping.pinned:
            return None
        s0 = mapping.device_base
        if not s0:
            return None
        bb = self.bb
        sources = [s0 + s for s, _, _ in plan]
        if not aligned(sources, [n * bb for _, _, n in plan]):
            return None
        copies = [(a, d * bb // 4, n * bb // 4) for a, (_, d, n) in zip(sources, plan)]
        return self._gather.issue(copies, self._words, stream)

    def _raw_copies(self, stream, mapping, dst: torch.Tensor, plan: list) -> bool:
        """Issue ``plan`` straight into the CUDA runtime on ``stream`` (registered source
        only; one batched call where the runtime has it). False when the runtime is out of
        reach or refuses a copy: then the caller copies the whole plan through torch."""
        if not self._raw.available or not mapping.pinned:
            return False
        bb, s0, d0 = self.bb, mapping.data.data_ptr(), dst.data_ptr()
        copies = [(d0 + d * bb, s0 + s, n * bb) for s, d, n in plan]
        return self._raw.issue(stream.cuda_stream, copies, HOST_TO_DEVICE)

    @property
    def launches(self) -> int:
        """Runtime calls and kernels that issued copies (one per load where batching works
        or the gather kernel copies)."""
        return self._raw.launches + (self._gather.launches if self._gather is not None else 0)

    @property
    def gathers(self) -> int:
        """Loads copied by the gather kernel (``copier="kernel"``)."""
        return self._gather.launches if self._gather is not None else 0

    def _count(self, plan) -> None:
        self.copies += len(plan)
        self.bytes += sum(n for _, _, n in plan) * self.bb

    def poll(self) -> None:
        """Finish the copies whose events fired (never waits)."""
        if not self._pending:
            return
        still = []
        for p in self._pending:
            if all(self._ev.query(e) for e in p.ends):
                p.mapping.in_flight -= 1
                took = max(self._ev.elapsed_ms(p.issued, e) for e in p.ends) / 1000.0
                wait = max(self._ev.elapsed_ms(p.issued, e) for e in p.starts) / 1000.0
                self._report(p.phases | {"wait": wait, "copy": max(0.0, took - wait)})
                self._free += [p.issued, *p.starts, *p.ends, *p.marks]  # all fired
                for table in p.held:  # the gather kernels' tables, for later loads
                    self._gather.release(table)
                p.on_done(p.issued_at + took)
            else:
                still.append(p)
        self._pending = still

    def drain(self) -> None:
        """Wait for every copy (shutdown)."""
        for p in self._pending:
            for e in p.ends:
                self._ev.synchronize(e)
        self.poll()

    @property
    def in_flight(self) -> int:
        return len(self._pending)
