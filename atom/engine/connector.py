"""What the scheduler asks of an external KV tier (implemented in atom.kv_transfer).

Every method runs on the step thread and returns at once; a connector does its waiting on its
own threads. It answers with values (``TierAnswer``, and the outcomes ``update`` returns) and
never changes a ``Sequence``: the engine scheduler alone decides a request's status, blocks,
resume point and counters. The engine knows nothing else of the tier.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from atom.engine.checkpoints import Checkpoint
from atom.engine.sequence import Sequence


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
    """A load landed: the pages of [local_tokens, tokens) are published in the pool and
    ``image`` (READY, at ``tokens``) is pinned once for the request's restore."""

    seq: Sequence
    tokens: int
    image: Checkpoint
    local_tokens: int


@dataclass(frozen=True)
class LoadFailed:
    """A load failed or is late: the request recomputes; the blocks it holds for the load are
    its own to release (the tier keeps its own leases on them while the transfer may still
    write)."""

    seq: Sequence
    start: int


Outcome = Answered | Loaded | LoadFailed


class Connector(ABC):
    chunk_size: int

    @abstractmethod
    def update(self) -> list[Outcome]:
        """Fold finished lookups and transfers into the tier's own state (start of a step, and
        whenever a driver is woken while idle); returns what the engine must act on. Outcomes
        are only ever about requests that have not finished."""

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
    ) -> None:
        """Load [start, end) into ``blocks`` and the image at ``end`` into ``image``'s units
        (its creation pin passes to the load). The sequence holds the blocks; the connector
        leases them too, until the load is terminal. A ``Loaded`` or ``LoadFailed`` follows."""

    @abstractmethod
    def settle_lookup(self, seq: Sequence) -> None:
        """The sequence will not load from its lookup: release whatever the lookup holds."""

    @abstractmethod
    def after_step(self, seqs: list[Sequence]) -> None:
        """These sequences committed forwards: store what became storable."""

    @abstractmethod
    def request_finished(self, seq: Sequence) -> None:
        """No forward of ``seq`` will follow (its pending stores may still complete)."""

    @abstractmethod
    def leases(self) -> dict[int, int]:
        """Block -> references held by transfers (for the integrity check)."""

    @abstractmethod
    def busy(self) -> bool:
        """True while a lookup or transfer is outstanding."""

    @abstractmethod
    def health(self) -> dict: ...

    @abstractmethod
    def shutdown(self, timeout_s: float) -> None:
        """Let pending stores finish (bounded), release everything, detach from the tier."""
