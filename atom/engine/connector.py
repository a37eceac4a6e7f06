"""What the scheduler asks of an external KV tier (implemented in atom.tier).

Every method runs on the step thread and returns at once; a connector does its waiting on its
own threads. It answers with values and never writes engine state: not a ``Sequence``, not the
block pool, not the image store. Whatever the engine must change because of the tier comes
back as an outcome (``Answered``, ``Loaded``, ``LoadFailed``, ``Lease``, ``Unlease``), returned by
the call that produced it, and the engine scheduler applies each one, in order, before it does
anything else (``Scheduler.apply``): it alone decides a request's status, blocks, resume point
and counters, publishes what a load brought in, and holds the transfers' leases. The engine
knows nothing else of the tier.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from atom.engine.checkpoints import Checkpoint
from atom.engine.sequence import ScheduledSpan, Sequence


@dataclass(frozen=True)
class TierAnswer:
    """The tier's hit for a request: on the chunk grid, ending at a stored image, leaving at
    least one token to compute (0: nothing to load, or no answer)."""

    tokens: int


@dataclass(frozen=True)
class Answered:
    """A lookup the request waited on has an answer (or was given up): admit it again."""

    seq: Sequence


@dataclass(frozen=True)
class Loaded:
    """A load landed: ``blocks`` hold the pages of [local_tokens, tokens) (their hashes are the
    sequence's, in order) and ``image``'s units the state at ``tokens``. The engine publishes
    them (registers the blocks, marks the image READY) whether or not the request still runs;
    for a running request it pins the image once for its restore and records the prepared
    prefix. An image that cannot become READY (its prefix left the pool) makes the request
    recompute, as ``LoadFailed`` does."""

    seq: Sequence
    tokens: int
    image: Checkpoint
    local_tokens: int
    blocks: tuple[int, ...] = ()


@dataclass(frozen=True)
class LoadFailed:
    """A load failed or is late: ``image`` (its PENDING destination) is dropped and the request
    recomputes; the blocks it holds for the load are its own to release (the transfer's
    ``Lease`` keeps them while the transfer may still write)."""

    seq: Sequence
    start: int
    image: Checkpoint | None = None


@dataclass(frozen=True)
class Lease:
    """Transfer ``op_id`` reads or writes ``blocks`` and ``image`` from now on: the engine takes a
    reference on each block and a pin on the image, held (even past their request's end) until
    the ``Unlease`` of the same ``op_id``."""

    op_id: int
    blocks: tuple[int, ...]
    image: Checkpoint


@dataclass(frozen=True)
class Unlease:
    """Transfer ``op_id`` is terminal, or known gone with its server: give its ``Lease`` back."""

    op_id: int


Outcome = Answered | Loaded | LoadFailed | Lease | Unlease


class Connector(ABC):
    chunk_size: int

    @abstractmethod
    def update(self) -> list[Outcome]:
        """Fold finished lookups and transfers into the tier's own state (start of a step, and
        whenever a driver is woken while idle); returns what the engine must act on, in order.
        ``Answered`` and ``LoadFailed`` are only about requests that have not finished;
        ``Loaded``, ``Lease`` and ``Unlease`` may concern a finished one (its blocks and image
        are still published and held)."""

    @abstractmethod
    def lookup(self, seq: Sequence, local_hit: int) -> TierAnswer | None:
        """The tier's answer for ``seq``, or None while it is pending (the sequence waits; an
        ``Answered`` outcome follows)."""

    @abstractmethod
    def holds(self, seq: Sequence) -> bool:
        """True while the tier holds something for a waiting ``seq``: a lookup outstanding, or
        answered with a hit and not yet settled (the server keeps its chunks locked, for a
        limited time). The scheduler counts such a sequence against max_num_seqs."""

    @abstractmethod
    def start_load(
        self, seq: Sequence, start: int, end: int, blocks: list[int], image: Checkpoint
    ) -> list[Outcome]:
        """Load [start, end) into ``blocks`` and the image at ``end`` into ``image``'s units.
        Returns the load's ``Lease`` (the sequence holds the blocks; the transfer holds them
        too, until it is terminal), then whatever the load already produced (an engine-driven
        copy lands here: ``Loaded``); after applying them the caller drops its creation pin of
        ``image``. A ``Loaded`` or ``LoadFailed`` follows if it did not come back here."""

    @abstractmethod
    def settle_lookup(self, seq: Sequence) -> None:
        """The sequence will not load from its lookup: release whatever the lookup holds."""

    def before_forward(self, spans: list[ScheduledSpan]) -> None:
        """The step's spans, before its forward runs: a tier may prepare the stores their
        commits will make (what ``after_step`` may store), so that work overlaps the forward.
        Changes no engine state; by default nothing."""
        return None

    def no_forward(self) -> None:
        """The step runs no forward (nothing was scheduled, e.g. every request waits on the
        tier): send now what the step's hooks queued for the tier's threads, which
        ``while_forward`` sends in a step with one. By default nothing."""
        return None

    def while_forward(self) -> list[Outcome]:
        """The step's forward is queued on the device and the step thread would wait for it:
        the same as ``update``, at a time when its work overlaps the forward. Its outcomes
        concern no span of the step (requests waiting or loading, transfers' leases), so the
        engine applies them at once. By default nothing."""
        return []

    @abstractmethod
    def after_step(self, seqs: list[Sequence]) -> list[Outcome]:
        """These sequences committed forwards: store what became storable. Returns a ``Lease``
        per store made (to apply at once)."""

    @abstractmethod
    def request_finished(self, seq: Sequence) -> None:
        """No forward of ``seq`` will follow (its pending stores may still complete)."""

    @abstractmethod
    def leases(self) -> dict[int, int]:
        """Block -> references its live transfers need (the integrity check compares it with
        the leases the engine holds)."""

    @abstractmethod
    def busy(self) -> bool:
        """True while a lookup or transfer is outstanding."""

    @abstractmethod
    def health(self) -> dict: ...

    @abstractmethod
    def shutdown(self, timeout_s: float) -> list[Outcome]:
        """Let pending stores finish (bounded), give up the rest, detach from the tier; returns
        the outcomes that release everything (an ``Unlease`` per transfer still leased)."""
