"""The client of atom's server module: where a lookup's hit sits in the server's L1, and
lookups that bring that answer with them (one round-trip per lookup).

Runs on the lookup thread (the step thread already waits for that answer), so the load that
follows is a local copy with no RPC on its path. One ``atom.locate`` call to the server module
(``l1_module.py``) per hit returns the byte spans of every PAGE object of [0, hit) and of the
image object at ``hit``; the lookup's read locks keep those objects in place until the engine
frees them, after its copy completed.

Whether the server has the module is found out by a probe (``start_probe``; a
``server_probe.ServerProbe``) on a thread of its own, so no lookup ever waits for it. Until it
has a verdict (``mode`` says "probing") every hit loads through the server, and so it does
while the verdict is "unknown" (the probe's call went unanswered: lmcache 0.5.6 never replies
to a method no module serves, but a server just restarted may only be slow; asked again with
backoff) or "unsupported" (a definite no: no such method, no L1 in shared memory, a segment
this engine cannot map), with one warning that says how to enable engine-driven loads. A
server change (``server_changed``: a restart, a re-registration) clears any verdict and
probes again.

The probe's answer also says whether the server serves ``atom.lookup_locate``
(``atom/tier/server/lookup_locate.py``): LMCache's own lookup (its LOOKUP, then
QUERY_PREFETCH_STATUS) and this locate in one call, where they take three. ``combined`` is True
from then on, until a server declines the call or leaves one unanswered while it answers a
noop (``decline_combined``, ``lookup_unanswered``), or the server changes. The read locks the call
takes are LMCache's (the same objects, for the same request id, recorded on the same session),
so the lookup thread frees them and ends the session with LMCache's own calls, unchanged. The
lookup thread sends it (``send_lookup``) on its scheduler adapter's own connection: the server
reads one connection in order and runs the lookup path's calls on one worker, so a free or a
session end sent after a lookup is applied after it, as with LMCache's own calls.
``read_lookup`` reads a reply without blocking; ``located_of`` reads the locate part of it.

**The L1 mapping** (``L1Mapping``, ``Mappings``): the LMCache server's shared-memory L1, mapped
into the engine for engine-driven loads.

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
from typing import Any

import msgspec
import torch

from atom.tier.operations import LookupOp, OpState
from atom.tier.server.host import boot_id
from atom.tier.worker_side.cuda_copy import clear_cuda_error, device_address
from atom.tier.worker_side.server_probe import (
    MODULE_HINT,
    SUPPORTED,
    UNSUPPORTED,
    ServerProbe,
    Unanswered,
    Unsupported,
)

log = logging.getLogger("atom.offload")

SHM_DIR = "/dev/shm"
# cudaHostRegisterPortable | cudaHostRegisterMapped | cudaHostRegisterReadOnly: pinned for
# every device, in the devices' address space (the gather kernel reads it), never written
CUDA_HOST_REGISTER_FLAGS = 1 | 2 | 8
CUDA_HOST_REGISTER_WRITABLE = 1 | 2  # without ReadOnly (saves write the mapping)


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
        # the mapping's address in the device's address space (the gather kernel's source)
        self.device_base = device_address(self.data.data_ptr()) if self.pinned else None
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


LOCATE_METHOD = "atom.locate"  # the server module's method (l1_module.LOCATE_METHOD)
LOCATE_VERSION = 1
LOOKUP_LOCATE_METHOD = "atom.lookup_locate"  # (lookup_locate.LOOKUP_LOCATE_METHOD)
LOOKUP_LOCATE_VERSION = 1  # the atom.lookup_locate version this engine speaks
UNKNOWN_METHOD = "unknown server module method"  # lmcache's router, for a method not served
PAGES_GROUP, IMAGE_GROUP = 0, 1  # lmcache's object groups: full-attention pages, the images


@dataclass(frozen=True)
class Located:
    """A hit's objects in one server's L1: ``pages[i]`` is chunk i's (offset, length).
    ``ranks``: across ranks without rank collapse, where rank r's own objects sit (r-1;
    ``rank_locator.RankLocator``); empty otherwise."""

    mapping: L1Mapping
    pages: tuple[tuple[int, int], ...]
    image: tuple[int, int]
    end: int
    at: float  # monotonic time of the answer (the read locks lapse after the server's TTL)
    ranks: tuple[Where, ...] = ()

    def where(self) -> Where:
        """What another process needs to copy the same objects (picklable: no mapping)."""
        return Where(self.mapping.ident, self.pages, self.image, self.end)


@dataclass(frozen=True)
class Where:
    """A ``Located`` as it travels to another rank: the segment's identity (which that rank
    maps itself, identity-checked) and the byte spans of the pages and the image."""

    ident: SegmentId
    pages: tuple[tuple[int, int], ...]
    image: tuple[int, int]
    end: int

    def located(self, mapping: L1Mapping, at: float) -> Located:
        if mapping.ident != self.ident:
            raise SegmentError(f"{mapping} is not the segment {self.ident.name} located in")
        return Located(mapping, self.pages, self.image, self.end, at)


@dataclass
class Call:
    """One ``atom.lookup_locate`` call in flight for ``op``; ``poll``: a poll of a lookup the
    server already runs (LMCache's prefetch from L2)."""

    op: LookupOp
    fut: Any
    poll: bool
    give_up_at: float  # monotonic: not answered by then, the call failed


@dataclass(frozen=True)
class Reply:
    """A call's answer. ``kind``: "hit" (``hit`` tokens, 0 for a miss; ``located`` or None),
    "pending" (the lookup runs: poll), "declined" (nothing was looked up: use LMCache's own
    lookup) or "failed" (``error``; whether the lookup ran is unknown)."""

    kind: str
    hit: int = 0
    located: Any = None
    error: str = ""


class Locator:
    def __init__(
        self, *, url: str, zmq_context, namespace: str, world_size: int, chunk: int, mappings
    ):
        self.url, self.ctx, self.namespace = url, zmq_context, namespace
        self.world_size, self.chunk = world_size, chunk
        self.mappings: Mappings = mappings
        self._client = None  # the lookup thread's (the probe has its own)
        self.probe = ServerProbe(
            url=url, method=LOCATE_METHOD, path="hits load", ask=self._ask, wait_s=0.0
        )
        self.declined = ""  # why the server declined atom.lookup_locate (not sent again to it)
        self.calls = 0
        self.locates = 0  # locate calls sent for hits (the probe's excluded)
        self._closing = threading.Event()

    @property
    def mode(self) -> str:
        """'probing', then 'engine_driven' or 'lmcache_driven (unknown|unsupported: why)'."""
        return self.probe.mode()

    @property
    def unsupported(self) -> str:
        """Why this server cannot serve engine-driven loads ("" unless that is definite)."""
        return self.probe.why if self.probe.state == UNSUPPORTED else ""

    @property
    def lookup_locate(self) -> int:
        """The ``atom.lookup_locate`` version the probe found (0: none, or no verdict)."""
        return int(self.probe.answer.get("lookup_locate", 0))  # absent: an older module

    @property
    def combined(self) -> bool:
        """True when lookups may go as one ``atom.lookup_locate`` call: the probe found this
        engine's version, engine-driven loads are on, and the server has not declined it.
        (Supported, this reads attributes only: it runs on every lookup.)"""
        probe = self.probe
        if probe.state != SUPPORTED:
            probe.ready()  # asks again when a retry is due
            return False
        version = probe.answer.get("lookup_locate", 0)  # (not self.lookup_locate: no call)
        return not self.declined and version == LOOKUP_LOCATE_VERSION

    def decline_combined(self, why: str) -> None:
        """The server did not handle ``atom.lookup_locate``: lookups use LMCache's own calls
        and ``atom.locate`` until the server changes (logged once)."""
        if not self.declined:
            self.declined = why or "declined"
            log.info("lookups against %s use two calls: %s", self.url, self.declined)

    def server_changed(self, why: str) -> None:
        """The server may be another one (a restart, a re-registration): whatever was learnt
        of the old one is forgotten, and the probe asks again (any thread)."""
        self.declined = ""
        self.probe.server_changed(why)

    def _send(self, payload: dict, client=None):
        """Send one locate call (on the lookup thread's client, or ``client``); its future."""
        from lmcache.v1.multiprocess.protocols.server_module import ServerModuleCallRequest

        if client is None:
            if self._client is None:
                from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

                self._client = RequestClientFactory.create(self.url, context=self.ctx)
            client = self._client
        self.calls += 1
        req = ServerModuleCallRequest(LOCATE_METHOD, msgspec.msgpack.encode(payload))
        return client.server_module_call(req)

    @staticmethod
    def _checked(resp) -> dict:
        """A reply's decoded answer; raises ``Unsupported`` for the server's definite no (no
        such method, no shared-memory L1), RuntimeError for another failure."""
        if not resp.success:
            if UNKNOWN_METHOD in resp.error:  # other modules, not atom's
                raise Unsupported(f"the server has no {LOCATE_METHOD} module ({MODULE_HINT})")
            raise RuntimeError(f"locate failed on the server: {resp.error}")
        answer = msgspec.msgpack.decode(resp.payload)
        if not answer.get("shm_name"):
            raise Unsupported(answer.get("error") or "the server's L1 is not in shared memory")
        return answer

    def _answer(self, fut, deadline: float) -> dict:
        """A locate call's decoded answer; raises when there is none (a definite no turns
        engine-driven loads off; a call unanswered while the server answers asks again)."""
        if not self._wait(fut, deadline):
            self._reset_client()  # a reply that comes later must not answer another
            if self._server_answers():  # lmcache 0.5.6 never replies to an unserved method
                self.probe.doubt(f"the server answers but not {LOCATE_METHOD}")
            raise TimeoutError("locate not answered in time")
        try:
            return self._checked(fut.result())
        except Unsupported as exc:
            self.probe.refuse(str(exc))
            raise RuntimeError(str(exc)) from None

    def _wait(self, fut, deadline: float) -> bool:
        """Wait for ``fut`` until ``deadline``, in slices, so ``close`` ends the wait."""
        while not fut.wait(min(max(deadline - time.monotonic(), 0.001), 0.1)):
            if time.monotonic() >= deadline or self._closing.is_set():
                return False
        return True

    def _server_answers(self, timeout_s: float = 0.5) -> bool:
        from atom.tier.server.lmcache_server import probe

        return probe(self.url, timeout_s)

    def _reset_client(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
            self._client = None

    def _request(self, lmc_id: str, tokens: list[int], start: int, end: int, groups) -> dict:
        return {
            "v": LOCATE_VERSION,
            "model_name": self.namespace,
            "world_size": self.world_size,
            "worker_id": 0,
            "request_id": lmc_id,
            "token_ids": list(tokens[:end]),
            "start": start,
            "end": end,
            "groups": groups,
        }

    def start_probe(self, timeout_s: float) -> None:
        """Ask the server, on a thread of its own, whether it serves ``atom.locate`` (waiting
        ``timeout_s`` for its answer), and start mapping its segment before the first hit
        needs it; returns at once."""
        self.probe.wait_s = timeout_s
        self.probe.start()

    def wait_probed(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a definite verdict (module or not); True if there is
        one. For tools that need the answer before their first hit (the engine never waits)."""
        return self.probe.wait(timeout_s)

    def _ask(self, client, wait) -> dict:
        """The probe's call (``ServerProbe``'s ``ask``): an ``atom.locate`` of nothing, which
        answers the segment's identity; its segment starts being mapped."""
        fut = self._send(self._request("atom-locate-probe", [], 0, 0, []), client)
        if not wait(fut):
            raise Unanswered()
        answer = self._checked(fut.result())
        try:
            self.mappings.for_answer(SegmentId.of_answer(answer))
        except SegmentError as exc:
            raise Unsupported(str(exc)) from None
        return answer

    def locate_many(self, hits: list[tuple[str, list[int], int]], timeout_s: float) -> list:
        """Where each (lmc_id, tokens, hit)'s objects sit: a ``Located`` or None (then that
        load goes through the server). The calls are sent together, then collected. Until a
        probe found the module, none is sent (a server without it would hold each one to its
        deadline, and the lookup's answer with it); a probe that learnt nothing is sent again
        when its backoff allows."""
        if not self.probe.ready():
            return [None] * len(hits)
        groups = [[PAGES_GROUP, -1], [IMAGE_GROUP, 1]]
        sent = []
        try:
            for lmc_id, tokens, hit in hits:
                hit = hit // self.chunk * self.chunk  # as the connector floors it
                req = self._request(lmc_id, tokens, 0, hit, groups)
                sent.append((hit, self._send(req) if hit > 0 else None))
                self.locates += hit > 0
        except Exception as exc:
            log.debug("locate: %s", exc)
            self._reset_client()
            return [None] * len(hits)
        deadline = time.monotonic() + timeout_s
        return [self._collect(hit, fut, deadline) if fut else None for hit, fut in sent]

    def _collect(self, hit: int, fut, deadline: float) -> Located | None:
        try:
            answer = self._answer(fut, deadline)
        except Exception as exc:
            log.debug("locate [0, %d): %s", hit, exc)
            return None
        return self.located_of(answer, hit)

    def located_of(self, answer: dict, hit: int) -> Located | None:
        """The ``Located`` of an ``atom.locate`` answer for [0, ``hit``) (``hit`` on this
        engine's chunk grid), or None (then that load goes through the server). An answer
        without a shared-memory segment, or naming a segment this engine cannot map, turns
        engine-driven loads off."""
        try:
            if not answer.get("shm_name"):
                raise Unsupported(answer.get("error") or "the server's L1 is not in shared memory")
            if not answer.get("found"):
                raise RuntimeError(answer.get("error") or "not found")
            mapping = self.mappings.for_answer(SegmentId.of_answer(answer))
        except (SegmentError, Unsupported) as exc:
            self.probe.refuse(str(exc))
            return None
        except Exception as exc:
            log.debug("locate [0, %d): %s", hit, exc)
            return None
        if mapping is None:
            return None  # being mapped: this load goes through the server
        pages, images = answer["objects"]
        if len(pages) != hit // self.chunk or len(images) != 1:
            return None
        return Located(
            mapping,
            tuple((int(o), int(n)) for o, n in pages),
            (int(images[0][0]), int(images[0][1])),
            hit,
            time.monotonic(),
        )

    def lookup_request(self, op: LookupOp, poll: bool, readers: int, chunk: int) -> dict:
        """The ``atom.lookup_locate`` request for ``op`` (``chunk``: LMCache's, by which the
        adapter aligns a lookup's end). A poll asks for the located objects only while the
        step thread still waits for the op."""
        return {
            "v": LOOKUP_LOCATE_VERSION,
            "op": "poll" if poll else "lookup",
            "model_name": self.namespace,
            "world_size": self.world_size,
            "request_id": op.lmc_id,
            "token_ids": op.token_ids,  # the op's own slice (sliced once: polls resend it)
            "end": op.length // chunk * chunk,
            "readers": readers,
            "grid": self.chunk,
            "locate": op.state is not OpState.LATE,
        }

    def send_lookup(self, adapter, op: LookupOp, poll: bool, readers: int, timeout_s) -> Call:
        """Send ``op``'s lookup (or a poll of it) on ``adapter``'s connection, without waiting
        (``scheduler_adapter_class``'s ``module_call``); raises if it cannot be sent."""
        req = self.lookup_request(op, poll, readers, adapter.lmcache_tokens_per_chunk)
        fut = adapter.module_call(LOOKUP_LOCATE_METHOD, msgspec.msgpack.encode(req))
        return Call(op, fut, poll, time.monotonic() + timeout_s)

    def read_lookup(self, call: Call) -> Reply | None:
        """``call``'s reply, or None while it is unanswered (never blocks)."""
        if not call.fut.query():
            return None
        try:
            resp = call.fut.result(0)
        except Exception as exc:
            return Reply("failed", error=f"lookup_locate failed: {exc!r}")
        if not resp.success:
            if UNKNOWN_METHOD in resp.error:  # a module without the method
                return self._declined(resp.error)
            return Reply("failed", error=f"lookup_locate failed on the server: {resp.error}")
        try:
            answer = msgspec.msgpack.decode(resp.payload)
            if not answer.get("handled"):
                return self._declined(answer.get("error") or "not handled")
            if answer.get("pending"):
                return Reply("pending")
            hit = int(answer["hit"])
        except Exception as exc:
            return Reply("failed", error=f"lookup_locate answer unreadable: {exc!r}")
        located = None
        if answer.get("located") is not None:
            end = hit // self.chunk * self.chunk  # as the connector floors it
            located = self.located_of(answer["located"], end)
        return Reply("hit", hit=hit, located=located)

    def lookup_unanswered(self) -> None:
        """A lookup call went unanswered: if the server answers otherwise, it does not serve
        the method (lmcache 0.5.6 never replies to a method no module serves: a server
        replaced by one without the module), so lookups go LMCache's way until it changes."""
        if not self.declined and self._server_answers():
            self.decline_combined(f"the server answers but not {LOOKUP_LOCATE_METHOD}")

    def _declined(self, why: str) -> Reply:
        self.decline_combined(f"the server declined {LOOKUP_LOCATE_METHOD}: {why}")
        return Reply("declined", error=why)

    def locate(self, lmc_id: str, tokens: list[int], hit: int, timeout_s: float):
        """One hit's ``Located`` or None."""
        return self.locate_many([(lmc_id, tokens, hit)], timeout_s)[0]

    def close(self) -> None:
        self._closing.set()
        self.probe.close()  # its waits are sliced: it stops at once
        self._reset_client()
