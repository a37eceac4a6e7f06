"""The tier's records: one request's life in the tier (``TierRequest``) and one object per
transfer or lookup (``TransferOp``, ``LookupOp``), and the queue that brings settled ops back to
the step thread (``SettledOps``), and the health the worker side publishes to it
(``WorkerHealth``).

**A request** (``TierRequest``): an explicit phase with checked transitions.

  NEW --lookup sent, request waits------------> LOOKING_UP --hit--> ANSWERED --load--> LOADING
   |  \\--lookup sent, HBM covers all (admit)--> CONFIRMING    \\                \\       |
   \\--no lookup (save-only / tier down)--> RUNNING <--miss, failed, late--/  \\--settled  |
                                              ^------------------------------ landed/failed
  any phase --request finished--> DONE (its stores drain, then the session ends)

Phase facts (``locked`` = tokens whose read locks the request holds on the server):
  LOOKING_UP  lookup in flight, or its answer ``held`` while concurrent lookups of the same
              prefix show whether it is short (planner.py; then it is asked again);
              the request waits (counts against max_num_seqs); a held answer's chunks are locked
  CONFIRMING  lookup in flight; the request runs from HBM; the answer only informs saves
  ANSWERED    answer > 0 known; [0, locked) locked; the engine decides: load or settle
  LOADING     ``load`` in flight; it consumed the locks of its span, the rest were freed
  RUNNING     nothing locked; saves follow the computed prefix when ``tier_has`` is known
  DONE        no forward follows; ``ops`` drain, then the session is ended and it is dropped

**A transfer** (``TransferOp``): a load or a save owns its id, blocks, image, leases and
deadline. States (the transfer thread moves them; the step thread reads them and owns the leases):

  QUEUED --submit--> IN_FLIGHT --True--> DONE
     |                  |  \\--False/raise--> FAILED
     |                  \\--deadline--> LATE --resolves--> DONE | FAILED
     \\--refused (no adapter / submit None)--> FAILED

A LATE transfer's fate is unknown: the server may still read or write its blocks, so its
leases stay held (the blocks are quarantined) until it resolves or the server that held it is
known to be gone. An engine-driven save gives its leases back when its copy completed
(``copied_at``; the server never reads the engine's blocks, and its commit follows), whatever
its state. Leases are decided on the step thread when the op is decided (``lease``) and
given back exactly once, on the step thread (``release``); the op only names them, as the
``Lease`` / ``Unlease`` values the engine applies to its pool and image store. Settled ops
reach the step thread through ``SettledOps``.
"""

from __future__ import annotations

import enum
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from atom.engine.checkpoints import Checkpoint
from atom.engine.connector import Lease, Unlease
from atom.engine.sequence import Sequence


class OpState(enum.Enum):
    QUEUED = "queued"
    IN_FLIGHT = "in_flight"
    DONE = "done"
    FAILED = "failed"
    LATE = "late"


_op_ids = itertools.count(1)
_TERMINAL = (OpState.DONE, OpState.FAILED)


class _Settles:
    """State transitions shared by transfers and lookups, under the op's own lock: the
    transfer or lookup thread settles an op, the step thread may mark it LATE; whichever
    comes first decides, and each learns atomically what the other did."""

    def _settle(self, state: OpState, error: str, **fields: Any) -> OpState | None:
        with self._lock:
            if self.state in _TERMINAL:
                return None
            before = self.state
            for name, value in fields.items():
                setattr(self, name, value)
            self.state, self.error, self.finished_at = state, error, time.monotonic()
            return before

    def mark_in_flight(self) -> None:
        """Sent (QUEUED -> IN_FLIGHT); a LATE or terminal op keeps its state."""
        with self._lock:
            if self.state is OpState.QUEUED:
                self.state = OpState.IN_FLIGHT

    def mark_late(self) -> bool:
        """Past its deadline with no outcome; returns True on the transition."""
        with self._lock:
            if self.state in (OpState.QUEUED, OpState.IN_FLIGHT):
                self.state = OpState.LATE
                return True
            return False

    @property
    def terminal(self) -> bool:
        return self.state in _TERMINAL


@dataclass(eq=False)
class TransferOp(_Settles):
    kind: str  # "load" | "save"
    lmc_id: str  # the LMCache request id (one per token sequence)
    token_ids: list[int]  # the sequence's tokens; an op reads [0, end) only (append-only list)
    start: int
    end: int
    page_blocks: list[int]  # blocks of [start, end), in order
    image: Checkpoint  # load: destination (PENDING); save: source (READY)
    deadline: float
    owner: Any = None  # the request's tier state
    event: Any = None  # the producer's event (pooled): held from launch until retired
    op_id: int = field(default_factory=lambda: next(_op_ids))
    state: OpState = OpState.QUEUED
    error: str = ""
    created_at: float = field(default_factory=time.monotonic)
    submitted_at: float | None = None
    finished_at: float | None = None
    nbytes: int = 0
    was_late: bool = False  # the request already gave up on it
    local: bool = False  # an engine-driven load: the engine copies it from the server's L1
    # a retrieve of it reached the server (or, an op across ranks, may have): the server then
    # releases the lookup's read locks that retrieve holds itself, whether it succeeds or not
    reached_server: bool = False
    reported: bool = False  # the step thread has acted on its outcome
    # engine-driven: when the copy completed (a load: rank 0's; a save: before its commit, so
    # its sources are released then)
    copied_at: float | None = None
    locks_freed: bool = False  # an engine-driven load: its span's read locks were freed
    future: Any = None  # transfer thread only
    _leased: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # ---- step thread: leases ------------------------------------------------------------

    def lease(self) -> Lease:
        """The hold on the page blocks and the image from now until ``release`` (decided ->
        terminal), for the engine to take."""
        assert not self._leased
        self._leased = True
        return Lease(self.op_id, tuple(self.page_blocks), self.image)

    def release(self) -> Unlease | None:
        """The lease given back (once), for the engine to apply; None if it already was."""
        if not self._leased:
            return None
        self._leased = False
        return Unlease(self.op_id)

    @property
    def leased(self) -> bool:
        return self._leased

    @property
    def units(self) -> list[int]:
        return self.image.units

    # ---- transfer thread: state ------------------------------------------------------------

    def mark_submitted(self, future: Any) -> None:
        self.future = future
        self.submitted_at = time.monotonic()
        self.mark_in_flight()

    def resolve(self, ok: bool, error: str = "") -> bool:
        """Terminal outcome; returns False if it was already terminal."""
        return self._settle(OpState.DONE if ok else OpState.FAILED, error) is not None

    @property
    def latency_s(self) -> float | None:
        if self.finished_at is None or self.submitted_at is None:
            return None
        return self.finished_at - self.submitted_at

    def __repr__(self) -> str:
        return (
            f"{self.kind}#{self.op_id}({self.lmc_id} [{self.start},{self.end}) "
            f"{self.state.value})"
        )


@dataclass(frozen=True)
class SaveAhead:
    """A save the step being run is expected to make, reserved before its forward (engine-
    driven saves): claimed by the save op with the same request, start and end."""

    lmc_id: str
    token_ids: list[int]  # tokens [0, end): the live list, or a copy with a span's drafts
    start: int
    end: int

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.lmc_id, self.start, self.end)


@dataclass(eq=False)
class LookupOp(_Settles):
    """A non-blocking lookup: the hit (tokens, ending at a stored image) or no answer."""

    lmc_id: str
    # the request's live token list: the op asks about its first ``length``
    tokens: list[int] = field(repr=False)
    length: int  # capped: a hit never covers the prompt's last token
    deadline: float
    owner: Any = None
    state: OpState = OpState.QUEUED
    hit: int | None = None
    located: Any = None  # where the hit's objects sit (locator.Located), for engine-driven loads
    error: str = ""
    created_at: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ids: list[int] | None = field(default=None, repr=False)

    @property
    def token_ids(self) -> list[int]:
        """The tokens asked about: ``tokens[:length]``, sliced at first use (by the lookup
        thread as it sends; a prompt of thousands of tokens is tens of microseconds to copy,
        which the step thread does not pay). The live list's first ``length`` never change."""
        ids = self._ids
        if ids is None:
            ids = self._ids = self.tokens[: self.length]
        return ids

    def resolve(self, hit: int | None, error: str = "") -> OpState | None:
        """Record the answer; returns the state it replaced (None if already terminal), so
        the caller knows atomically whether the step thread had given up on it (LATE)."""
        state = OpState.DONE if hit is not None else OpState.FAILED
        return self._settle(state, error, hit=hit)


class SettledOps:
    """Ops on their way back to the step thread: the lookup and transfer threads (and, across
    ranks, the parts' fan-in) ``post`` each op they settle, which wakes the engine
    (``notify``); the connector ``take``s them all at its next ``update``. Made before both
    sides, so each is handed its end (``LMCacheTier``): no relay between them."""

    def __init__(self, notify: Callable[[], None]):
        self._notify = notify
        self._ops: deque = deque()
        self._lock = threading.Lock()

    def post(self, op: TransferOp | LookupOp) -> None:
        """Any thread: one settled op (or one an op's deadline made late)."""
        with self._lock:
            self._ops.append(op)
        self._notify()

    def take(self) -> list[TransferOp | LookupOp]:
        """The step thread: every op posted since the last call, in order."""
        with self._lock:
            ops = list(self._ops)
            self._ops.clear()
        return ops


class Phase(enum.Enum):
    NEW = "new"
    LOOKING_UP = "looking_up"
    CONFIRMING = "confirming"
    ANSWERED = "answered"
    LOADING = "loading"
    RUNNING = "running"
    DONE = "done"


_NEXT: dict[Phase, frozenset[Phase]] = {
    Phase.NEW: frozenset({Phase.LOOKING_UP, Phase.CONFIRMING, Phase.RUNNING, Phase.DONE}),
    Phase.LOOKING_UP: frozenset({Phase.ANSWERED, Phase.RUNNING, Phase.DONE}),
    Phase.CONFIRMING: frozenset({Phase.RUNNING, Phase.DONE}),
    Phase.ANSWERED: frozenset({Phase.LOADING, Phase.RUNNING, Phase.DONE}),
    Phase.LOADING: frozenset({Phase.RUNNING, Phase.DONE}),
    Phase.RUNNING: frozenset({Phase.DONE}),
    Phase.DONE: frozenset(),
}


class PhaseError(RuntimeError):
    pass


@dataclass(eq=False)
class TierRequest:
    seq: Sequence  # read only: tokens, block hashes, blocks (the engine owns it)
    lmc_id: str  # one LMCache request id for its whole life (its tokens only ever grow)
    phase: Phase = Phase.NEW
    lookup: LookupOp | None = None
    answer: int | None = None  # the capped hit once answered or given up (0); None: pending
    held: int | None = None  # an answer received, not yet acted on (judged first; LOOKING_UP)
    asked_at: float | None = None  # when the current lookup was sent (the connector's clock)
    replied_at: float | None = None  # when its answer (held or final) arrived
    asks: int = 0  # lookups sent (a short answer is asked again)
    locked: int = 0  # [0, locked) read-locked on the server for this request
    tier_has: int | None = None  # what the tier holds of this prefix; None: unknown, no saves
    saved_upto: int = 0  # the tier holds (or is being sent) [0, saved_upto), an image there
    load: TransferOp | None = None
    located: Any = None  # where the answer's objects sit in the server's L1 (engine-driven)
    ops: set[TransferOp] = field(default_factory=set)  # live transfers (leased or unreported)
    session_open: bool = False
    confirm_at: int = 0  # CONFIRMING: the boundary its confirmation is for (asked near it)
    confirm_due: int = 0  # CONFIRMING: the computed length from which it asks (due_from)
    confirm_key: int | None = None  # the prefix whose shared confirmation it leads or follows

    def to(self, phase: Phase) -> None:
        if phase is self.phase:
            return
        if phase not in _NEXT[self.phase]:
            raise PhaseError(f"{self.lmc_id}: {self.phase.value} -> {phase.value} not allowed")
        self.phase = phase

    @property
    def alive(self) -> bool:
        return self.phase is not Phase.DONE

    @property
    def lookup_pending(self) -> bool:
        """A lookup is unanswered, or its answer is held: not acted on yet."""
        return self.lookup is not None and self.answer is None

    @property
    def reply(self) -> int | None:
        """The latest answer received (held or final); None while the lookup is unanswered."""
        return self.held if self.held is not None else self.answer

    @property
    def holds(self) -> bool:
        """Counted against max_num_seqs while waiting: a lookup it waits on, or locked chunks."""
        return self.phase in (Phase.LOOKING_UP, Phase.ANSWERED)


class WorkerHealth:
    """The worker side's health as the scheduler side reads it, on every update: whether the
    tier serves now, and an ``epoch`` that changes whenever it may have lost what it held (a
    re-registration, a recovery after an outage). The transfer thread that owns the adapter
    writes it (``adapter``; ``registered``, ``recovered``); the step thread only reads it,
    never the thread object. ``healthy`` asks the adapter live (lmcache's heartbeat sets it).

    Whenever the server may be another one (healthy again after an outage, registered afresh,
    or registered at last after failed attempts) the ``on_server_change`` hooks are called with
    the reason, on the transfer thread: the probes of the server's module forget their
    verdicts (``worker_side/server_probe.py``)."""

    def __init__(self):
        self.adapter = None  # the registered LMCache adapter; None while there is none
        self.registrations = 0
        self.recoveries = 0  # healthy again after an outage (the server may have lost data)
        self.on_server_change: list = []  # callables taking the reason (a str)

    @property
    def healthy(self) -> bool:
        adapter = self.adapter
        return adapter is not None and bool(adapter.is_healthy)

    @property
    def epoch(self) -> int:
        return self.registrations + self.recoveries

    def registered(self, after_failures: bool = False) -> None:
        """A registration succeeded (``after_failures``: attempts before it failed)."""
        self.registrations += 1
        if self.registrations > 1 or after_failures:
            self._changed("registered with the server again")

    def recovered(self, after_outage: bool = True) -> None:
        """Healthy again (``after_outage``: the transfer thread saw it healthy, then not; else
        this is its first sight of the tier healthy since it registered)."""
        self.recoveries += 1
        if after_outage:
            self._changed("the server is back after an outage")

    def _changed(self, why: str) -> None:
        for hook in self.on_server_change:
            hook(why)
