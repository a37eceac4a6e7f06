"""One engine-driven save, as the transfer thread polls it: its reservation, its copy, its
commit or abort (``EngineSave``, the op's future), and the batched server-module calls it
rides on (``SaveCall``).

One object per save's lifetime, stepped by ``query`` on the transfer thread:

  reserving -> copying -> committing -> done        (the engine copied and committed it)
  reserving -> done                                 (resident already, or late: aborted)
  reserving -> server                               (the server's store instead: ``fallback``)

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

The reserve and the commit are calls shared by a round's saves (``SaveCall``: one future, one
answer, an item per save). Everything that is the transfer thread's, not the save's (the
client, the mapping, the copy stream, the round's batched commits and aborts, the counters,
whether the server serves the methods), is the manager's (``local_save.EngineSaves``), which
the save reaches through ``saves``. ``fail_future`` resolves any op's future the server will
never answer (an ``EngineSave`` gives up).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from atom.tier.operations import OpState, TransferOp
from atom.tier.worker_side.local_load import runs
from atom.tier.worker_side.locator import UNKNOWN_METHOD, SegmentError, SegmentId
from atom.tier.worker_side.server_probe import MODULE_HINT

log = logging.getLogger("atom.offload")

RESERVE_METHOD, COMMIT_METHOD, ABORT_METHOD = "atom.reserve", "atom.commit", "atom.abort"
SAVES_VERSION = 1  # the atom.reserve/commit/abort version this engine speaks


@dataclass(eq=False)
class SaveCall:
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

    saves: Any  # local_save.EngineSaves: the transfer thread's manager
    op: TransferOp
    reserve: SaveCall
    index: int  # this save's item in the reserve call
    state: str = "reserving"  # reserving -> copying -> committing -> done | server
    ok: bool = False
    error: str = ""
    rid: int = 0
    via_server: bool = False
    server: Any = None  # the server's store future, once it took the save over
    commit: SaveCall | None = None
    commit_index: int = 0
    event: Any = None  # CUDA: the copy's completion event
    mapping: Any = None
    plan: list = field(default_factory=list)
    # monotonic times of this save's steps, as the transfer thread saw them (``phases``)
    reserved_at: float | None = None
    copy_issued_at: float | None = None
    copied_at: float | None = None

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
            self._copied()
        if self.state == "committing" and self.commit is not None and self.commit.read():
            self._committed()

    def _reserved(self) -> None:
        call, saves = self.reserve, self.saves
        if not call.read():
            if time.monotonic() > call.sent_at + saves.rpc_timeout_s:
                saves.unanswered(call, self.index)
                self._to_server("reserve not answered in time")
            return
        self.reserved_at = time.monotonic()
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
            plan = self._plan(item["objects"], mapping)
        except ValueError as exc:
            saves.unsupported_by_server(f"reserved objects are not this layout's: {exc}")
            self._release()
            self._to_server(str(exc))
            return
        self.mapping, self.plan = mapping, plan
        self.copy_issued_at = time.monotonic()
        self.event, error = saves.copy(self.op, plan, mapping)
        if error:
            self._release()  # once a CUDA copy that may have started is over
            self._done(False, error, "failed")
            return
        self.state = "copying"
        if self.event is None:  # CPU: the copy is complete
            self._copied()

    def _copied(self) -> None:
        """The bytes are in the reservation: the sources are released now (``saves.copied``
        tells the step thread), the commit goes out with the round's others."""
        self.copied_at = self.op.copied_at = time.monotonic()
        self.saves.copied(self.op)
        self.saves.commit_later(self)
        self.state = "committing"

    def _plan(self, objects: list, mapping) -> list[tuple[int, int, int]]:
        """The copies of this save into the reserved spans ``objects`` (per group, nil for a
        resident object): runs of (destination offset, source block, blocks). Raises
        ValueError when a span is not what this layout writes there."""
        op, saves = self.op, self.saves
        pages, images = objects
        n = (op.end - op.start) // saves.chunk
        if len(pages) != n or len(images) != 1:
            raise ValueError(f"{len(pages)} page spans for {n} chunks, {len(images)} images")
        bb, bpc, size = saves.bb, saves.bpc, mapping.ident.size
        blocks = list(op.page_blocks) + list(op.units)
        if any(not 0 <= b < saves.blocks.shape[0] for b in blocks):
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
            if length != saves.units * bb or off < 0 or off + length > size:
                raise ValueError(f"image span ({off}, {length}), expected {saves.units * bb} B")
            pieces += [(off + j * bb, int(u), 1) for j, u in enumerate(op.units)]
        return runs(pieces, bb)

    def _committed(self) -> None:
        call = self.commit
        results = (call.answer or {}).get("results") or []
        if call.error or self.commit_index >= len(results):
            self._done(False, f"commit failed: {call.error or 'no result'}", "failed")
            return
        _, ok, error = results[self.commit_index]
        if ok:
            self._done(True, "", "copied")
            self.saves.observe_phases(self.phases(time.monotonic()))
        else:
            self._done(False, f"commit refused: {error}", "failed")

    def phases(self, committed_at: float) -> dict:
        """A copied and committed save's latency by phase, in seconds, as the transfer thread
        saw each step (its rounds' spacing included): queued (the op's submission to the
        reserve's send), reserve (sent to answered; for a reserve sent ahead of the forward,
        the submission to answered: 0 when the answer was in), copy (issued to completed),
        to_commit (completed to the round's commit call), commit (sent to answered)."""
        submitted = self.op.submitted_at or self.reserve.sent_at
        return {
            "queued": max(0.0, self.reserve.sent_at - submitted),
            # a reserve sent ahead (before the forward) counts from the save's submission
            "reserve": max(0.0, self.reserved_at - max(self.reserve.sent_at, submitted)),
            "copy": self.copied_at - self.copy_issued_at,
            "to_commit": self.commit.sent_at - self.copied_at,
            "commit": committed_at - self.commit.sent_at,
        }

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
