"""One request's life in the tier, as an explicit phase with checked transitions.

  NEW --lookup sent, request waits------------> LOOKING_UP --hit--> ANSWERED --load--> LOADING
   |  \\--lookup sent, HBM covers all (admit)--> CONFIRMING    \\                \\       |
   \\--no lookup (save-only / tier down)--> RUNNING <--miss, failed, late--/  \\--settled  |
                                              ^------------------------------ landed/failed
  any phase --request finished--> DONE (its stores drain, then the session ends)

Phase facts (``locked`` = tokens whose read locks the request holds on the server):
  LOOKING_UP  lookup in flight, or its answer ``held`` while concurrent lookups of the same
              prefix show whether it is short (lookup_outcomes.py; then it is asked again);
              the request waits (counts against max_num_seqs); a held answer's chunks are locked
  CONFIRMING  lookup in flight; the request runs from HBM; the answer only informs saves
  ANSWERED    answer > 0 known; [0, locked) locked; the engine decides: load or settle
  LOADING     ``load`` in flight; it consumed the locks of its span, the rest were freed
  RUNNING     nothing locked; saves follow the computed prefix when ``tier_has`` is known
  DONE        no forward follows; ``ops`` drain, then the session is ended and it is dropped
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from atom.engine.sequence import Sequence
from atom.tier.operations import LookupOp, TransferOp


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
