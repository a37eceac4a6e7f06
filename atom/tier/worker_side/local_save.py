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
  * One save's path, its fallbacks and its lease: ``engine_save.py``.

This file is the manager (``EngineSaves``: the transfer thread's client of the server module,
its writable mapping, its copy stream, the round's batched commits and aborts, the counters).

Whether the server serves the methods is found out by a probe (a ``server_probe.ServerProbe``,
on a thread of its own, as for ``atom.locate``); until it says so every save is the server's
store. A probe whose call goes unanswered (lmcache 0.5.6 never answers a method no module
serves, but a server just restarted may only be slow) leaves the verdict unknown and is sent
again with backoff; a definite no (no such method, another version, no L1 in shared memory, a
segment or spans this engine cannot use) turns engine-driven saves off until the server
changes (``server_changed``: a restart, a re-registration), which clears any verdict.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
import torch

from atom.model_api import pool_bytes
from atom.tier.operations import TransferOp
from atom.tier.server.l1_saves import own_identity
from atom.tier.worker_side.engine_save import (
    ABORT_METHOD,
    COMMIT_METHOD,
    RESERVE_METHOD,
    SAVES_VERSION,
    EngineSave,
    SaveCall,
)
from atom.tier.worker_side.locator import (
    IMAGE_GROUP,
    PAGES_GROUP,
    UNKNOWN_METHOD,
    Mappings,
    SegmentError,
    SegmentId,
)
from atom.tier.worker_side.save_copy import SaveCopy
from atom.tier.worker_side.server_probe import (
    MODULE_HINT,
    SUPPORTED,
    UNSUPPORTED,
    ServerProbe,
    Unanswered,
    Unsupported,
)

log = logging.getLogger("atom.offload")

# How long the probe waits for atom.reserve's answer (at least): a server just restarted on a
# busy machine may be slow (in CI one answered a noop but not the reserve within 3 s)
PROBE_WAIT_S = 10.0


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
        self._copier = SaveCopy(self.blocks, pool.device)
        self.waiter = None  # copy_waiter.CopyWaiter: set by the transfer thread that owns this
        self.mappings = Mappings(pool.device, writable=True)
        self._owner = own_identity()
        self._client = None
        self._commits: list[EngineSave] = []
        self._aborts: list[int] = []
        # reserves given up (call, item): what a late answer grants is aborted
        self._orphan_calls: list[tuple[SaveCall, int]] = []
        # CUDA copies of saves given up: (event, mapping, rid to abort once it fired)
        self._orphan_copies: list[tuple[Any, Any, int]] = []
        self.counts = {"copied": 0, "resident": 0, "via_server": 0, "aborted": 0, "failed": 0}
        self.calls = {"reserve": 0, "commit": 0, "abort": 0}
        # reservations sent before the step's forward: claimed by its saves, or given back
        self.ahead = {"claimed": 0, "answered_before": 0, "unclaimed": 0}
        self.probe = ServerProbe(
            url=url,
            method=RESERVE_METHOD,
            path="saves go",
            ask=self._ask,
            wait_s=max(rpc_timeout_s, PROBE_WAIT_S),
        )
        self.fallback = None  # set by the transfer thread: op -> the server's store future
        # gets each copied save's phases ({phase: seconds}, ``EngineSave.phases``), or None
        self.on_phases = None
        # gets a save's op once its copy completed, before its commit (its sources may be
        # released then), or None: the sources are held until the op is terminal
        self.on_copied = None

    # ---- mode ----------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        """'probing', then 'engine_driven' or 'lmcache_driven (unknown|unsupported: why)' (asking
        sends a probe that is due again, as ``ready`` does)."""
        return self.probe.mode()

    @property
    def ready(self) -> bool:
        """Saves may be reserved now (else they are the server's stores); a probe that learnt
        nothing (the server was down, or slow) is sent again when its backoff allows."""
        return self.probe.ready()

    @property
    def supported(self) -> bool:
        """The server serves the methods, as last found (reads only: sends no probe)."""
        return self.probe.state == SUPPORTED

    @property
    def unsupported(self) -> str:
        """Why this server cannot take engine-driven saves ("" unless that is definite)."""
        return self.probe.why if self.probe.state == UNSUPPORTED else ""

    def unsupported_by_server(self, why: str) -> None:
        """A definite no from a call: engine-driven saves are off until the server changes."""
        self.probe.refuse(why)

    def server_changed(self, why: str) -> None:
        """The server may be another one (a restart, a re-registration): the verdict is
        forgotten and the probe asks again (any thread)."""
        self.probe.server_changed(why)

    def observe_phases(self, phases: dict) -> None:
        if self.on_phases is not None:
            try:
                self.on_phases(phases)
            except Exception:  # noqa: BLE001 - a metric never fails a save
                log.debug("save phases not recorded", exc_info=True)

    def copied(self, op: TransferOp) -> None:
        if self.on_copied is not None:
            try:
                self.on_copied(op)
            except Exception:  # noqa: BLE001 - the sources are then released at the end
                log.warning("a copied save could not be reported early", exc_info=True)

    def count(self, outcome: str) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1

    # ---- the probe (``ServerProbe``: a thread of its own, its own zmq context) -------------

    def start_probe(self, timeout_s: float) -> None:
        """Ask the server now whether it serves the methods (waiting at least ``timeout_s``,
        and ``PROBE_WAIT_S``, for the answer); returns at once."""
        self.probe.wait_s = max(timeout_s, PROBE_WAIT_S)
        self.probe.start()

    def _ask(self, client, wait) -> dict:
        """The probe's call: an ``atom.reserve`` of nothing, which answers the segment's
        identity (mapped from now on, before the first save needs it)."""
        call = SaveCall(self._send(RESERVE_METHOD, self._reserve_request([]), client), 0.0)
        if not wait(call.fut):
            raise Unanswered()
        call.read()
        answer = call.answer
        if answer is None:
            if UNKNOWN_METHOD in call.error:
                raise Unsupported(f"the server has no {RESERVE_METHOD} ({MODULE_HINT})")
            raise RuntimeError(call.error)
        if answer.get("v") != SAVES_VERSION or answer.get("error"):
            raise Unsupported(answer.get("error") or f"saves version {answer.get('v')}")
        try:
            self.mappings.for_answer(SegmentId.of_answer(answer))
        except SegmentError as exc:
            raise Unsupported(str(exc)) from None
        return answer

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
        call = self.send_reserve(ops)
        return [EngineSave(self, op, call, i) for i, op in enumerate(ops)]

    def send_reserve(self, items: list) -> SaveCall:
        """One reserve call for ``items`` (save ops, or ``SaveAhead``s: the request, tokens,
        start and end of each); raises if it cannot be sent."""
        try:
            fut = self._send(RESERVE_METHOD, self._reserve_request(items))
        except Exception:
            self._reset_client()
            raise
        self.calls["reserve"] += 1
        return SaveCall(fut, time.monotonic())

    def claim(self, op: TransferOp, call: SaveCall, index: int) -> EngineSave:
        """``op``'s future, on item ``index`` of a reserve sent ahead for it."""
        self.ahead["claimed"] += 1
        if call.read():  # its round-trip was over before the save existed: none on its path
            self.ahead["answered_before"] += 1
        return EngineSave(self, op, call, index)

    def write_by_s(self, answer: dict) -> float:
        """Seconds after the reserve was sent by which a copy must be issued: half the lease
        granted (the server counts it from later, when it handled the call)."""
        return float(answer.get("ttl_s") or 0.0) / 2

    @property
    def pending(self) -> bool:
        """Work a round still owes that no op stands for: commits or aborts to send, answers
        to given-up reserves to abort, copies of given-up saves to retire."""
        return bool(self._commits or self._aborts or self._orphan_calls or self._orphan_copies)

    def commit_later(self, save: EngineSave) -> None:
        self._commits.append(save)

    def abort(self, rid: int) -> None:
        self._aborts.append(rid)

    def unanswered(self, call: SaveCall, index: int) -> None:
        """Item ``index`` of a reserve went unanswered past the RPC timeout: what it grants,
        if an answer comes, is aborted; whether the server serves the method is asked again
        (saves are the server's stores meanwhile)."""
        self.orphan_item(call, index)
        self.probe.doubt(f"a reserve went unanswered for {self.rpc_timeout_s:g} s")

    def orphan_item(self, call: SaveCall, index: int) -> None:
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
                call = SaveCall(fut, time.monotonic())
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

    def copy(self, op: TransferOp, plan: list, mapping) -> tuple[Any, str]:
        """Issue ``plan`` (``save_copy.SaveCopy.copy``); a CUDA copy's event is watched, so
        that the transfer thread runs a round as soon as it fires."""
        event, error = self._copier.copy(op, plan, mapping)
        if event is not None and self.waiter is not None:
            self.waiter.watch(event)
        return event, error

    @property
    def bytes(self) -> int:
        """Bytes copied into L1 so far."""
        return self._copier.bytes

    # ---- end ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Shutdown (the transfer thread, after its last round): abort what is reserved,
        wait for copies still writing, unmap."""
        self.probe.close()
        if self.waiter is not None:
            self.waiter.close()
        for event, _, _ in self._orphan_copies:
            event.synchronize()
        aborted = self.flush()
        if aborted is not None:  # closing the client drops what it has not sent yet
            aborted.wait(min(1.0, self.rpc_timeout_s))
        self._reset_client()
        self.mappings.close_all()
