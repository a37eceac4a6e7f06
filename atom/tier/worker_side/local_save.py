"""Engine-driven saves: the engine copies a save's objects into space the server reserved in
its shared-memory L1, then commits them (the transfer thread).

The server side is atom's server module (``atom/tier/server/l1_saves.py``): ``atom.reserve``
stages an object per chunk of the save that the server does not hold yet (LMCache's own
staging objects, invisible to lookups) and says where each sits in the segment;
``atom.commit`` admits them, ``atom.abort`` discards them. One save:

  reserve (batched: one call per transfer round) -> copy -> commit (batched the same way)

  * The reserve answer names the segment (name, size, device, inode, boot id, server id, as
    ``atom.locate`` does); the engine writes only through its own writable mapping of a
    segment whose ``fstat`` matches that identity (``locator.Mappings(writable=True)``; the
    loads' mapping stays read-only), and only into the spans the answer gave, each checked
    against the length this layout gives the object (a chunk's pages: blocks_per_chunk x
    block_bytes, in block order; the image: units_per_image x block_bytes, in ordinal order,
    byte for byte what the server's own store writes).
  * On CPU the copies are plain (the save's blocks were written before it was submitted and
    stay leased until it is terminal). On CUDA they are device-to-host ``cudaMemcpyAsync``
    calls on a copy stream of their own that first waits for the save's event (recorded
    after the forward that wrote the blocks); the commit is sent once the copy's event fired.
  * A save whose reserve the server refuses (out of L1, no registration yet, a version this
    engine does not speak), whose segment is not mapped yet, or which went to a server
    without the module, is the server's store instead (``fallback``, counted ``via_server``):
    it loses nothing. A save that goes LATE before its copy is aborted, never copied; one
    whose commit fails (the server released the reservation) is FAILED and stored again
    later; the transfer thread's deadlines, quarantine and "lost" rules apply unchanged (the
    op's future is an ``EngineSave``).
  * The engine never writes into a reservation past its lease (``ttl_s``, granted by the
    server, which may then release it and give its memory to another object): a copy is issued
    only while the op is within its deadline and at least half the lease remains. A reservation
    that is never committed (an engine killed mid-copy) is released by the server when the
    engine's process is gone, or when the lease runs out.

Whether the server serves the methods is found out by a probe on a thread of its own (as for
``atom.locate``: lmcache 0.5.6 never answers a method no module serves); until then every save
is the server's store.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from atom.model_api import pool_bytes
from atom.tier.operations import OpState, TransferOp
from atom.tier.server.l1_saves import own_identity
from atom.tier.worker_side.local_load import runs
from atom.tier.worker_side.locator import (
    IMAGE_GROUP,
    PAGES_GROUP,
    UNKNOWN_METHOD,
    Mappings,
    SegmentError,
    SegmentId,
    clear_cuda_error,
)

log = logging.getLogger("atom.offload")

RESERVE_METHOD, COMMIT_METHOD, ABORT_METHOD = "atom.reserve", "atom.commit", "atom.abort"
SAVES_VERSION = 1  # the atom.reserve/commit/abort version this engine speaks
PROBE_WAIT_S = 10.0  # how long the probe waits for atom.reserve's answer (at least)
CUDA_MEMCPY_DEVICE_TO_HOST = 2
MODULE_HINT = (
    'start it with --server-module \'{"module_path": "atom.tier.server.l1_module"}\' and '
    "--shm-name"
)


def _cuda_memcpy_async():
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            fn = ctypes.CDLL(name).cudaMemcpyAsync
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.argtypes += [ctypes.c_void_p]
        fn.restype = ctypes.c_int
        return fn
    return None


@dataclass(eq=False)
class _Call:
    """One reserve or commit call for several saves."""

    fut: Any
    sent_at: float
    answer: dict | None = None
    error: str = ""
    done: bool = False

    def read(self) -> bool:
        """True once answered (``answer`` or ``error`` set); never blocks."""
        if self.done:
            return True
        if not self.fut.query():
            return False
        self.done = True
        try:
            resp = self.fut.result(0)
        except Exception as exc:
            self.error = f"{exc!r}"
            return True
        if not resp.success:
            self.error = resp.error or "failed on the server"
            return True
        try:
            self.answer = msgspec.msgpack.decode(resp.payload)
        except Exception as exc:
            self.error = f"unreadable answer: {exc!r}"
        return True


@dataclass(eq=False)
class EngineSave:
    """One save's future, as the transfer thread polls it (``query``, ``result``;
    ``give_up`` when the server that held it is gone)."""

    saves: EngineSaves
    op: TransferOp
    reserve: _Call
    index: int  # this save's item in the reserve call
    state: str = "reserving"  # reserving -> copying -> committing -> done | server
    ok: bool = False
    error: str = ""
    rid: int = 0
    via_server: bool = False
    server: Any = None  # the server's store future, once it took the save over
    commit: _Call | None = None
    commit_index: int = 0
    event: Any = None  # CUDA: the copy's completion event
    mapping: Any = None
    plan: list = field(default_factory=list)

    # ---- the future's interface (the transfer thread) --------------------------------------

    def query(self) -> bool:
        if self.state == "server":
            return bool(self.server.query())
        try:
            self._advance()
        except Exception as exc:  # the reservation is discarded, the save fails
            log.warning("engine-driven save %s failed: %r", self.op, exc)
            self._release()
            self._done(False, f"engine save raised: {exc!r}", "failed")
        return self.state == "done"

    def result(self, timeout=None) -> bool:
        if self.state == "server":
            return bool(self.server.result(timeout))
        return self.ok

    def give_up(self) -> None:
        """The server that held this save is gone (or the engine shuts down): resolve it
        failed, discard its reservation if the server can still hear it."""
        if self.state == "server":
            fail_future(self.server)
            return
        if self.state == "done":
            return
        if self.state == "reserving":  # what an answer still to come grants is aborted
            self.saves.orphan_item(self.reserve, self.index)
        self._release()
        self._done(False, "given up", "failed")

    # ---- the steps ---------------------------------------------------------------------

    def _advance(self) -> None:
        if self.state == "reserving":
            self._reserved()
        if self.state == "copying" and self.event is not None and self.event.query():
            self.mapping.in_flight -= 1
            self.event = None
            self.saves.commit_later(self)
            self.state = "committing"
        if self.state == "committing" and self.commit is not None and self.commit.read():
            self._committed()

    def _reserved(self) -> None:
        call, saves = self.reserve, self.saves
        if not call.read():
            if time.monotonic() > call.sent_at + saves.rpc_timeout_s:
                saves.unanswered(call, self.index)
                self._to_server("reserve not answered in time")
            return
        answer = call.answer
        if answer is None or answer.get("error"):
            why = call.error or answer.get("error") or "refused"
            if UNKNOWN_METHOD in why:
                saves.unsupported_by_server(f"the server has no {RESERVE_METHOD} ({MODULE_HINT})")
            elif answer is not None and answer.get("v") != SAVES_VERSION:
                saves.unsupported_by_server(why)
            self._to_server(why)
            return
        item = answer["items"][self.index]
        if not item["ok"]:
            self._to_server(item["error"] or "reserve refused")
            return
        self.rid = int(item["rid"])
        if self.rid == 0:  # every object is resident already: the tier holds this save
            self._done(True, "", "resident")
            return
        now = time.monotonic()
        late = self.op.state is OpState.LATE or now > self.op.deadline
        if late or now > call.sent_at + saves.write_by_s(answer):
            self._release()
            self._done(False, "late before its copy (never copied)", "aborted")
            return
        try:
            mapping = saves.mappings.for_answer(SegmentId.of_answer(answer))
        except SegmentError as exc:
            saves.unsupported_by_server(str(exc))
            mapping = None
        if mapping is None:  # being mapped (or unmappable): the server stores this one
            self._release()
            self._to_server("the server's segment is not mapped (yet)")
            return
        try:
            plan = saves.plan(self.op, item["objects"], mapping)
        except ValueError as exc:
            saves.unsupported_by_server(f"reserved objects are not this layout's: {exc}")
            self._release()
            self._to_server(str(exc))
            return
        self.mapping, self.plan = mapping, plan
        self.event, error = saves.copy(self.op, plan, mapping)
        if error:
            self._release()  # once a CUDA copy that may have started is over
            self._done(False, error, "failed")
            return
        self.state = "copying"
        if self.event is None:  # CPU: the copy is complete
            self.saves.commit_later(self)
            self.state = "committing"

    def _committed(self) -> None:
        call = self.commit
        results = (call.answer or {}).get("results") or []
        if call.error or self.commit_index >= len(results):
            self._done(False, f"commit failed: {call.error or 'no result'}", "failed")
            return
        _, ok, error = results[self.commit_index]
        if ok:
            self._done(True, "", "copied")
        else:
            self._done(False, f"commit refused: {error}", "failed")

    # ---- ends ----------------------------------------------------------------------------

    def _to_server(self, why: str) -> None:
        """This save becomes the server's store (the bytes are still leased)."""
        log.debug("save %s through the server: %s", self.op, why)
        self.via_server = True
        self.saves.count("via_server")
        try:
            self.server = self.saves.fallback(self.op)
        except Exception as exc:
            self._done(False, f"the server's store refused: {exc!r}", None)
            return
        self.state = "server"

    def _release(self) -> None:
        """Give the reservation back (``atom.abort``): at once, or, while a CUDA copy may
        still write into it, once the copy's event fired (the server may give released
        memory to another object)."""
        rid, self.rid = self.rid, 0
        if self.event is not None:
            self.saves.after_copy(self.event, self.mapping, rid)
            self.event = None
        elif rid and self.state != "done":
            self.saves.abort(rid)

    def _done(self, ok: bool, error: str, outcome: str | None) -> None:
        self.state, self.ok, self.error = "done", ok, error
        if outcome:
            self.saves.count(outcome)


class EngineSaves:
    """Engine-driven saves of one transfer thread: its client of the server module, its
    writable mapping of the server's segment, its copy stream. Every method but the probe's
    runs on the transfer thread."""

    def __init__(
        self,
        *,
        url: str,
        zmq_context,
        namespace: str,
        world_size: int,
        worker_id: int,
        pool: torch.Tensor,
        block_size: int,
        chunk_size: int,
        units_per_image: int,
        rpc_timeout_s: float,
        transfer_timeout_s: float,
    ):
        self.url, self.ctx, self.namespace = url, zmq_context, namespace
        self.world_size, self.worker_id = world_size, worker_id
        self.blocks = pool_bytes(pool)  # [num_blocks, block_bytes] uint8 view of the pool
        self.bb = self.blocks.shape[1]
        self.bpc = chunk_size // block_size
        self.chunk, self.units = chunk_size, units_per_image
        self.rpc_timeout_s = rpc_timeout_s
        # the lease asked for: well past a save's deadline (copies are issued only before it)
        self.ttl_s = max(30.0, 4 * transfer_timeout_s)
        self.cuda = pool.device.type == "cuda"
        self.mappings = Mappings(pool.device, writable=True)
        self._stream = torch.cuda.Stream(pool.device) if self.cuda else None
        self._memcpy = _cuda_memcpy_async() if self.cuda else None
        self._owner = own_identity()
        self._client = None
        self._commits: list[EngineSave] = []
        self._aborts: list[int] = []
        # reserves given up (call, item): what a late answer grants is aborted
        self._orphan_calls: list[tuple[_Call, int]] = []
        # CUDA copies of saves given up: (event, mapping, rid to abort once it fired)
        self._orphan_copies: list[tuple[Any, Any, int]] = []
        self.unsupported = ""  # why this server cannot take engine-driven saves
        self.counts = {"copied": 0, "resident": 0, "via_server": 0, "aborted": 0, "failed": 0}
        self.calls = {"reserve": 0, "commit": 0, "abort": 0}
        self.bytes = 0
        self._known = threading.Event()
        self._closing = threading.Event()
        self._probe_thread: threading.Thread | None = None
        self._probe_lock = threading.Lock()
        self._probe_timeout_s = rpc_timeout_s
        self.fallback = None  # set by the transfer thread: op -> the server's store future

    # ---- mode ----------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        """'probing' until a probe found out, then 'engine_driven' or 'lmcache_driven (why)'
        (asking sends a probe that learnt nothing again, as ``ready`` does)."""
        if self.unsupported:
            return f"lmcache_driven ({self.unsupported})"
        if not self._known.is_set():
            self._probe_again()
            return "probing (saves go through the server until the server's module answers)"
        return "engine_driven"

    @property
    def ready(self) -> bool:
        """Saves may be reserved now (else they are the server's stores); a probe that
        learnt nothing (the server was down) is sent again."""
        if self.unsupported:
            return False
        if not self._known.is_set():
            self._probe_again()
            return False
        return True

    def _probe_again(self) -> None:
        with self._probe_lock:
            thread = self._probe_thread
            if thread is not None and not thread.is_alive() and not self._closing.is_set():
                self.start_probe(self._probe_timeout_s)

    def unsupported_by_server(self, why: str) -> None:
        if not self.unsupported:
            self.unsupported = why
            log.warning("engine-driven saves are off for %s: %s", self.url, why)

    def count(self, outcome: str) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1

    # ---- the probe (a thread of its own, its own zmq context) -----------------------------

    def start_probe(self, timeout_s: float) -> None:
        self._probe_timeout_s = timeout_s
        self._probe_thread = threading.Thread(
            target=self._probe, args=(timeout_s,), name="atom-saves-probe", daemon=True
        )
        self._probe_thread.start()

    def _probe(self, timeout_s: float) -> None:
        import zmq
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        from atom.tier.server.lmcache_server import probe

        ctx = zmq.Context()
        ctx.linger = 0
        client = None
        try:
            client = RequestClientFactory.create(self.url, context=ctx)
            call = _Call(self._send(RESERVE_METHOD, self._reserve_request([]), client), 0.0)
            # nothing waits for the probe (saves are the server's stores meanwhile), and only
            # its deadline says "no such method": wait longer than one RPC, so that a server
            # just restarted on a busy machine is not taken for one without the module (in CI
            # one answered a noop but not the reserve within 3 s, and saves stayed off)
            deadline = time.monotonic() + max(timeout_s, PROBE_WAIT_S)
            while not call.read():
                if self._closing.is_set():
                    return
                if time.monotonic() >= deadline:
                    if probe(self.url, 0.5):  # lmcache 0.5.6 never replies to such a call
                        self.unsupported_by_server(
                            f"the server answers but not {RESERVE_METHOD} ({MODULE_HINT})"
                        )
                    return
                call.fut.wait(0.1)
            answer = call.answer
            if answer is None:
                why = call.error
                if UNKNOWN_METHOD in why:
                    why = f"the server has no {RESERVE_METHOD} ({MODULE_HINT})"
                self.unsupported_by_server(why)
                return
            if answer.get("v") != SAVES_VERSION or answer.get("error"):
                self.unsupported_by_server(answer.get("error") or f"saves version {answer['v']}")
                return
            self.mappings.for_answer(SegmentId.of_answer(answer))  # map it before the first save
            self._known.set()
        except SegmentError as exc:
            self.unsupported_by_server(str(exc))
        except Exception as exc:
            log.debug("saves probe of %s: %s", self.url, exc)
        finally:
            if client is not None:
                client.close()
            ctx.destroy(linger=0)
            if self.unsupported:
                self._known.set()

    # ---- calls ---------------------------------------------------------------------------

    def _send(self, method: str, payload: dict, client=None):
        from lmcache.v1.multiprocess.protocols.server_module import ServerModuleCallRequest

        if client is None:
            if self._client is None:
                from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

                self._client = RequestClientFactory.create(self.url, context=self.ctx)
            client = self._client
        req = ServerModuleCallRequest(method, msgspec.msgpack.encode(payload))
        return client.server_module_call(req)

    def _reserve_request(self, ops: list[TransferOp]) -> dict:
        return {
            "v": SAVES_VERSION,
            "model_name": self.namespace,
            "world_size": self.world_size,
            "worker_id": self.worker_id,
            "ttl_s": self.ttl_s,
            "owner": self._owner,
            "items": [
                {
                    "request_id": op.lmc_id,
                    "token_ids": list(op.token_ids[: op.end]),
                    "start": op.start,
                    "end": op.end,
                    "groups": [[PAGES_GROUP, -1], [IMAGE_GROUP, 1]],
                }
                for op in ops
            ],
        }

    def reserve(self, ops: list[TransferOp]) -> list[EngineSave]:
        """One reserve call for ``ops``; their futures (raises if it cannot be sent)."""
        try:
            fut = self._send(RESERVE_METHOD, self._reserve_request(ops))
        except Exception:
            self._reset_client()
            raise
        self.calls["reserve"] += 1
        call = _Call(fut, time.monotonic())
        return [EngineSave(self, op, call, i) for i, op in enumerate(ops)]

    def write_by_s(self, answer: dict) -> float:
        """Seconds after the reserve was sent by which a copy must be issued: half the lease
        granted (the server counts it from later, when it handled the call)."""
        return float(answer.get("ttl_s") or 0.0) / 2

    def commit_later(self, save: EngineSave) -> None:
        self._commits.append(save)

    def abort(self, rid: int) -> None:
        self._aborts.append(rid)

    def unanswered(self, call: _Call, index: int) -> None:
        """Item ``index`` of a reserve went unanswered past the RPC timeout: what it grants,
        if an answer comes, is aborted; whether the server serves the method is asked again
        (saves are the server's stores meanwhile)."""
        self.orphan_item(call, index)
        if self._known.is_set() and not self.unsupported:
            self._known.clear()
            self._probe_again()

    def orphan_item(self, call: _Call, index: int) -> None:
        self._orphan_calls.append((call, index))

    def after_copy(self, event, mapping, rid: int) -> None:
        """Abort ``rid`` once ``event`` (a copy into it) fired."""
        self._orphan_copies.append((event, mapping, rid))

    def flush(self):
        """End of a transfer round: send the round's commits (one call) and aborts (one
        call); abort what late answers to given-up reserves granted; retire finished copies
        of given-up saves and unmap retired segments no copy writes. Returns the abort call's
        future (None: none sent)."""
        aborted = None
        for entry in list(self._orphan_calls):
            call, index = entry
            if call.read():
                self._orphan_calls.remove(entry)
                items = (call.answer or {}).get("items") or []
                if index < len(items) and items[index].get("rid"):
                    self._aborts.append(int(items[index]["rid"]))
        for entry in list(self._orphan_copies):
            event, mapping, rid = entry
            if event.query():
                mapping.in_flight -= 1
                self._orphan_copies.remove(entry)
                if rid:
                    self._aborts.append(rid)
        try:
            saves = [s for s in self._commits if s.state == "committing" and s.rid]
            self._commits = []
            if saves:
                fut = self._send(
                    COMMIT_METHOD, {"v": SAVES_VERSION, "rids": [s.rid for s in saves]}
                )
                self.calls["commit"] += 1
                call = _Call(fut, time.monotonic())
                for i, s in enumerate(saves):
                    s.commit, s.commit_index = call, i
            if self._aborts:
                rids, self._aborts = self._aborts, []
                aborted = self._send(ABORT_METHOD, {"v": SAVES_VERSION, "rids": rids})
                self.calls["abort"] += 1  # not awaited (but at shutdown)
        except Exception as exc:  # a save whose commit was not sent goes late, then is lost
            log.debug("saves: a commit or abort could not be sent: %r", exc)
            self._reset_client()
        self.mappings.close_idle()
        return aborted

    def _reset_client(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
            self._client = None

    # ---- the copy ----------------------------------------------------------------------------

    def plan(self, op: TransferOp, objects: list, mapping) -> list[tuple[int, int, int]]:
        """The copies of ``op`` into the reserved spans ``objects`` (per group, nil for a
        resident object): runs of (destination offset, source block, blocks). Raises
        ValueError when a span is not what this layout writes there."""
        pages, images = objects
        n = (op.end - op.start) // self.chunk
        if len(pages) != n or len(images) != 1:
            raise ValueError(f"{len(pages)} page spans for {n} chunks, {len(images)} images")
        bb, bpc, size = self.bb, self.bpc, mapping.ident.size
        blocks = list(op.page_blocks) + list(op.units)
        if any(not 0 <= b < self.blocks.shape[0] for b in blocks):
            raise ValueError(f"a source block outside the pool: {blocks}")  # memmove checks none
        pieces = []
        for i, span in enumerate(pages):
            if span is None:
                continue
            off, length = int(span[0]), int(span[1])
            if length != bpc * bb or off < 0 or off + length > size:
                raise ValueError(f"chunk {i}: span ({off}, {length}), expected {bpc * bb} B")
            pieces += [(off + j * bb, op.page_blocks[i * bpc + j], 1) for j in range(bpc)]
        span = images[0]
        if span is not None:
            off, length = int(span[0]), int(span[1])
            if length != self.units * bb or off < 0 or off + length > size:
                raise ValueError(f"image span ({off}, {length}), expected {self.units * bb} B")
            pieces += [(off + j * bb, int(u), 1) for j, u in enumerate(op.units)]
        return runs(pieces, bb)

    def copy(self, op: TransferOp, plan: list, mapping) -> tuple[Any, str]:
        """Issue ``plan``: (None, "") when complete (CPU), else (the copy's CUDA event, "");
        an error instead of "" when it failed (on CUDA the event still marks the end of what
        was issued: the reservation is given back only after it)."""
        dst, src, bb = mapping.data, self.blocks, self.bb
        if not self.cuda:
            # memmove, not Tensor.copy_: torch splits a copy over its intra-op threads, and on
            # a host whose cores are busy (the step thread's forwards, the server) a 290 KB
            # block took 4-12 ms that way on this 2-core machine instead of ~0.05 ms; ctypes
            # releases the GIL for the call
            d0, s0 = dst.data_ptr(), src.data_ptr()
            try:
                for d, s, n in plan:
                    ctypes.memmove(d0 + d, s0 + s * bb, n * bb)
            except Exception as exc:
                return None, f"copy failed: {exc!r}"
            self.bytes += sum(n for _, _, n in plan) * bb
            return None, ""
        stream, error = self._stream, ""
        with torch.cuda.device(src.device), torch.cuda.stream(stream):
            try:
                if op.event is not None:
                    stream.wait_event(op.event)  # the forward that wrote the blocks
                if not self._raw_copies(stream, mapping, plan):
                    for d, s, n in plan:
                        dst[d : d + n * bb].copy_(src[s : s + n].view(-1), non_blocking=True)
            except Exception as exc:
                error = f"copy failed: {exc!r}"
            event = torch.cuda.Event()
            event.record(stream)
        mapping.in_flight += 1
        if not error:
            self.bytes += sum(n for _, _, n in plan) * bb
        return event, error

    def _raw_copies(self, stream, mapping, plan: list) -> bool:
        if self._memcpy is None or not mapping.pinned:
            return False
        bb, fn, handle = self.bb, self._memcpy, stream.cuda_stream
        d0, s0 = mapping.data.data_ptr(), self.blocks.data_ptr()
        for d, s, n in plan:
            rc = fn(d0 + d, s0 + s * bb, n * bb, CUDA_MEMCPY_DEVICE_TO_HOST, handle)
            if rc != 0:
                clear_cuda_error()
                log.warning("cudaMemcpyAsync refused (error %d): saves copy through torch", rc)
                self._memcpy = None
                return False
        return True

    # ---- end ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Shutdown (the transfer thread, after its last round): abort what is reserved,
        wait for copies still writing, unmap."""
        self._closing.set()
        if self._probe_thread is not None:
            self._probe_thread.join(2.0)
        for event, _, _ in self._orphan_copies:
            event.synchronize()
        aborted = self.flush()
        if aborted is not None:  # closing the client drops what it has not sent yet
            aborted.wait(min(1.0, self.rpc_timeout_s))
        self._reset_client()
        self.mappings.close_all()


def fail_future(fut) -> None:
    """Resolve a future the server will never answer, so adapter.shutdown() cannot hang on it
    (``set_result``, not ``set_exception``: a stored traceback pins the adapter's frames); an
    engine-driven save gives up (``EngineSave.give_up``)."""
    give_up = getattr(fut, "give_up", None)
    if give_up is not None:
        give_up()
        return
    raw = getattr(fut, "raw_future_", None)
    try:
        if raw is not None and not raw.query():
            raw.set_result((b"", False))
    except Exception:  # already resolved by the server in the meantime
        pass
