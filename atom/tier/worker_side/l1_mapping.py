"""The LMCache server's shared-memory L1, mapped into the engine (``L1Mapping``, ``Mappings``).

Mapped for engine-driven loads (and saves).

A load's mapping is read-only (``PROT_READ``: loads can never write the server's cache) and, on
CUDA, registered with the driver (``cudaHostRegister``, read-only flag), so host-to-device
copies from it run at pinned-memory speed on the engine's own stream. Engine-driven saves
(``local_save.py``) map the same segment a second time, writable (``writable=True``), and write
through that mapping only into spans the server reserved for them; the loads' mapping stays
read-only.

Identity: the server's locate answer names the segment with its size, device, inode and the
host's boot id. A mapping is made only of a file whose ``fstat`` matches all of them, so the
engine never reads a segment of another host or of another server that reused the name.

Lifetime (``Mappings``): a server's segment is mapped (on a thread of its own) the first time
a locate answer names it, then made current; a segment named by a new server retires the old
one. Only the step thread closes retired mappings, once no copy from them is in flight
(``close_idle``), so a copy never outlives its source. ``close_all`` at shutdown.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
import warnings
from dataclasses import dataclass

import torch

from atom.tier.server.host import boot_id
from atom.tier.worker_side.cuda_copy import clear_cuda_error

log = logging.getLogger("atom.offload")

SHM_DIR = "/dev/shm"


# cudaHostRegisterPortable | cudaHostRegisterReadOnly: pinned for every device, never written
CUDA_HOST_REGISTER_FLAGS = 1 | 8


CUDA_HOST_REGISTER_WRITABLE = 1  # cudaHostRegisterPortable (saves write the mapping)


@dataclass(frozen=True)
class SegmentId:
    """What a locate answer says of the server's segment (and which server said it)."""

    name: str
    size: int
    dev: int
    ino: int
    boot_id: str
    server_id: str

    @classmethod
    def of_answer(cls, a: dict) -> SegmentId:
        return cls(
            a["shm_name"], a["shm_size"], a["shm_dev"], a["shm_ino"], a["boot_id"], a["server_id"]
        )


class SegmentError(RuntimeError):
    pass


class L1Mapping:
    """One server's L1 segment, mapped read-only (``writable``: read-write, for saves);
    ``data`` is a uint8 tensor over it."""

    def __init__(
        self, ident: SegmentId, device: torch.device, local_boot_id: str, writable: bool = False
    ):
        if not ident.name or "/" in ident.name:
            raise SegmentError(f"the server names no usable segment ({ident.name!r})")
        if ident.boot_id != local_boot_id:
            raise SegmentError("the segment is on another host")
        self.ident = ident
        self.writable = writable
        path = os.path.join(SHM_DIR, ident.name)
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino, st.st_size) != (ident.dev, ident.ino, ident.size):
                raise SegmentError(
                    f"{path} is not the segment the server described (device/inode/size "
                    f"{st.st_dev}/{st.st_ino}/{st.st_size}, expected "
                    f"{ident.dev}/{ident.ino}/{ident.size})"
                )
            # not populated: page tables for a large L1 would take seconds; a CPU load pays a
            # minor fault on its first read of a page (on CUDA the registration pins them)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._mm = mmap.mmap(fd, ident.size, flags=mmap.MAP_SHARED, prot=prot)
        finally:
            os.close(fd)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffer: never written
            self.data = torch.frombuffer(self._mm, dtype=torch.uint8)
        flags = CUDA_HOST_REGISTER_WRITABLE if writable else CUDA_HOST_REGISTER_FLAGS
        self.pinned = False
        self.register_s = 0.0
        if device.type == "cuda":
            t0 = time.monotonic()
            with torch.cuda.device(device):
                rc = torch.cuda.cudart().cudaHostRegister(self.data.data_ptr(), ident.size, flags)
            self.pinned = int(rc) == 0
            self.register_s = time.monotonic() - t0
            if not self.pinned:
                clear_cuda_error()
                log.warning(
                    "cudaHostRegister of %s failed (error %s): %s pageable memory",
                    path,
                    int(rc),
                    "saves copy to" if writable else "loads copy from",
                )
        self.in_flight = 0  # copies from this mapping not known complete (step thread)
        self.closed = False

    def read(self, offset: int, n: int) -> bytes:
        """``n`` bytes at ``offset`` (host read of the mapping; no torch op)."""
        return self._mm[offset : offset + n]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.data.data_ptr())
            self.pinned = False
        del self.data
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere: the GC unmaps it with the view
            log.warning("L1 mapping %s still has views; left to the garbage collector", self)

    def __repr__(self) -> str:
        return f"L1Mapping({self.ident.name}, {self.ident.size} B, server {self.ident.server_id})"


class Mappings:
    """The current server's mapping and the retired ones still being copied from.

    A segment is mapped on a thread of its own (registering a large L1 with CUDA takes
    seconds, which no lookup should wait for); until it is mapped, ``for_answer`` returns
    None and loads go through the server."""

    def __init__(self, device: torch.device, writable: bool = False):
        self.device = torch.device(device)
        self.writable = writable  # saves' mappings (local_save.py); loads' are read-only
        self.boot_id = boot_id()
        self._lock = threading.Lock()
        self.current: L1Mapping | None = None
        self._retired: list[L1Mapping] = []
        self._mapping: SegmentId | None = None  # being mapped now
        self._thread: threading.Thread | None = None
        self._failed: dict[SegmentId, str] = {}
        self._closed = False
        self.mapped = 0

    def for_answer(self, ident: SegmentId) -> L1Mapping | None:
        """The mapping of the segment an answer names, or None while it is being mapped
        (started here if new). Raises SegmentError if it cannot be mapped."""
        cur = self.current
        if cur is not None and cur.ident == ident:
            return cur
        if ident.boot_id != self.boot_id:
            raise SegmentError(
                "the LMCache server runs on another host (its boot id differs): engine-driven "
                "loads and saves need the server on this host; use lmcache.load_mode="
                "lmcache_driven (and save_mode=lmcache_driven)"
            )
        with self._lock:
            if ident in self._failed:
                raise SegmentError(self._failed[ident])
            if self._mapping is not None or self._closed:
                return None  # one mapping at a time; a newer server is asked again later
            self._mapping = ident
            self._thread = threading.Thread(
                target=self._map, args=(ident,), name="atom-lmcache-l1-map", daemon=True
            )
            self._thread.start()  # under the lock: nobody sees (and joins) it unstarted
        return None

    def _map(self, ident: SegmentId) -> None:
        try:
            mapping = L1Mapping(ident, self.device, self.boot_id, self.writable)
        except Exception as exc:
            with self._lock:
                self._failed[ident] = f"cannot map the server's L1 {ident.name}: {exc}"
                self._mapping = None
            log.warning("%s", self._failed[ident])
            return
        log.info(
            "mapped LMCache L1 %s%s (%.2f GiB%s)",
            ident.name,
            " for saves (writable)" if self.writable else "",
            ident.size / 2**30,
            f", registered with CUDA in {mapping.register_s:.2f} s" if mapping.pinned else "",
        )
        with self._lock:
            self._mapping = None
            if self._closed:
                mapping.close()
                return
            if self.current is not None:
                self._retired.append(self.current)
            self.current = mapping
            self.mapped += 1

    def wait_mapped(self, timeout_s: float) -> bool:
        """Wait for a mapping in progress (benchmarks, tests); True if one is current."""
        with self._lock:  # a thread is published started (for_answer starts it under the lock)
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        return self.current is not None

    def close_idle(self) -> None:
        """Step thread: unmap retired segments no copy reads any more."""
        with self._lock:
            idle = [m for m in self._retired if m.in_flight == 0]
            self._retired = [m for m in self._retired if m.in_flight]
        for m in idle:
            m.close()

    def close_all(self, timeout_s: float = 30.0) -> None:
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)  # a mapping finishing later closes itself
        with self._lock:
            every = [*self._retired, *([self.current] if self.current else [])]
            self._retired, self.current = [], None
        for m in every:
            m.close()
