"""What the scheduler asks of an external KV tier (implemented in atom.kv_transfer).

Every method runs on the step thread and returns at once; a connector does its waiting on its
own threads and reports back through ``update``. The engine knows nothing else of the tier.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from atom.engine.checkpoints import Checkpoint
from atom.engine.sequence import Sequence


@dataclass(eq=False)
class Resume:
    """A prefix made ready outside a forward: the sequence already holds the blocks of
    [0, tokens) in its block table and a pinned READY image at ``tokens``."""

    tokens: int
    image: Checkpoint
    local_tokens: int  # [0, local_tokens) came from the local pool, the rest from the tier


class Connector(ABC):
    chunk_size: int

    @abstractmethod
    def update(self) -> None:
        """Fold finished lookups and transfers into the engine state (start of a step)."""

    @abstractmethod
    def lookup(self, seq: Sequence, local_hit: int) -> int | None:
        """The tier's hit for ``seq`` in tokens (on the chunk grid, ending at a stored image,
        leaving at least one token to compute; 0 for none or no answer), or None while the
        answer is pending (the sequence waits; nothing sleeps)."""

    @abstractmethod
    def holds(self, seq: Sequence) -> bool:
        """True while the tier holds something for a waiting ``seq``: a lookup outstanding, or
        answered with a hit and not yet settled (the server keeps its chunks locked, for a
        limited time). The scheduler counts such a sequence against max_num_seqs."""

    @abstractmethod
    def start_load(
        self, seq: Sequence, start: int, end: int, blocks: list[int], image: Checkpoint
    ) -> None:
        """Load [start, end) into ``blocks`` and the image at ``end`` into ``image``'s units.
        The sequence already holds the blocks; the connector leases them too, until the load
        is terminal. On success the sequence gets a ``Resume``; on failure it recomputes."""

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
