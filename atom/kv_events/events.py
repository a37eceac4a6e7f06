"""KVEvents: what the engine's pool and its tier report, as records for the publisher.

The pool calls ``stored(block, hash)`` when a block's hash becomes resident (``register``) and
``removed(hash)`` when it stops being resident (eviction, ``forget``); a hash handed from one
block to another (a cached holder replaced, a twin taking over) is neither. So the hashes the
events say are present are exactly ``pool.by_hash``.

The hash a router recomputes from token ids (``atom.engine.block_pool``): with block size B,
``h_0 = chain_hash(0, t[0:B])`` and ``h_i = chain_hash(h_{i-1}, t[i*B:(i+1)*B])``, where
``chain_hash(p, ids) = xxh64(p as 8 little-endian bytes || each id as 4 little-endian signed
bytes)`` (seed 0), as an unsigned 64-bit int. Only full blocks are hashed. An event's
``parent_block_hash`` is ``h_{i-1}`` of its first block, None for the first block of a prompt.
The hash has no namespace: one publisher serves one model, and a router keys its index by the
endpoint (the tier's LMCache keys add the namespace; these do not).

``token_ids`` of a pool store are found in the sequence that holds the block (``locate``); a
store whose sequence is gone (a tier load landing for an aborted request) is published with
empty ``token_ids`` and counted in ``unlocated``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain

from atom.kv_events.config import KVEventsConfig
from atom.kv_events.publisher import Publisher

Locate = Callable[[int, int], "tuple[int | None, list[int]] | None"]

TIER_MEDIUM = "CPU"


class KVEvents:
    """The pool's listener and the tier's entry point; records go to a Publisher."""

    def __init__(self, publisher: Publisher, medium: str, locate: Locate | None = None):
        self.publisher, self.medium = publisher, medium
        self.locate = locate
        self.unlocated = 0
        self._overflowed = False
        self._put(("C",))  # a (re)started engine holds nothing: consumers drop what they had

    # ---- the pool (step thread) -----------------------------------------------------------

    def stored(self, block: int, block_hash: int) -> None:
        found = self.locate(block, block_hash) if self.locate is not None else None
        if found is None:
            self.unlocated += 1
            found = (None, [])
        parent, tokens = found
        self._put(("S", (block_hash,), parent, tokens, self.medium))

    def removed(self, block_hash: int) -> None:
        self._put(("R", (block_hash,), self.medium))

    def cleared(self) -> None:
        """Every block of the pool is gone (reset_prefix_cache left nothing resident)."""
        self._put(("C",))

    # ---- the tier (on the step thread, where the connector applies its outcomes) ---------

    def tier_stored(
        self,
        block_hashes: Sequence[int],
        medium: str = TIER_MEDIUM,
        token_ids: Sequence[int] = (),
        parent_block_hash: int | None = None,
    ) -> None:
        """Blocks (chained, in order) now held by a tier ``medium``: pass their hashes, the
        hash before the first (None at a prompt's start) and their tokens (all of them, or
        none)."""
        if block_hashes:
            self._put(("S", tuple(block_hashes), parent_block_hash, list(token_ids), medium))

    def tier_removed(self, block_hashes: Sequence[int], medium: str = TIER_MEDIUM) -> None:
        if block_hashes:
            self._put(("R", tuple(block_hashes), medium))

    # ---- lifetime -----------------------------------------------------------------------

    def stats(self) -> dict:
        p = self.publisher
        return {"batches": p.batches, "events": p.events, "dropped": p.dropped,
                "unlocated": self.unlocated}  # fmt: skip

    def close(self, timeout_s: float = 5.0) -> None:
        self.publisher.close(timeout_s)

    def _put(self, record: tuple) -> None:
        """Queue a record; after a drop, an AllBlocksCleared first, so that a consumer that
        lost a removal forgets everything instead of routing to a block that is gone."""
        put = self.publisher.put
        if self._overflowed:
            if not put(("C",)):
                self.publisher.dropped += 1  # this record is dropped too
                return
            self._overflowed = False
        if not put(record):
            self._overflowed = True


def sequence_locator(scheduler, block_size: int) -> Locate:
    """``locate(block, hash)`` over the scheduler's sequences: (parent hash, token ids) of the
    block in the sequence whose block table holds it, or None. Blocks of one sequence are
    registered in order, so the next block of the last match is tried first."""
    last: list = [None, -1]

    def locate(block: int, h: int):
        seq, i = last
        if not (
            seq is not None and i + 1 < len(seq.block_table) and seq.block_table[i + 1] == block
        ):
            for seq in chain(scheduler.running, scheduler.waiting):
                if block in seq.block_table:
                    i = seq.block_table.index(block) - 1
                    break
            else:
                return None
        i += 1
        if i >= len(seq.block_hashes) or seq.block_hashes[i] != h:
            return None
        last[0], last[1] = seq, i
        parent = seq.block_hashes[i - 1] if i else None
        return parent, seq.tokens[i * block_size : (i + 1) * block_size]

    return locate


def start_kv_events(cfg: KVEventsConfig, block_size: int, scheduler, metrics=None) -> KVEvents:
    """A publisher for ``cfg`` whose records come from ``scheduler``'s pool; gauges on
    ``metrics`` (an atom Registry) when given."""
    events = KVEvents(
        Publisher(cfg, block_size), cfg.medium, sequence_locator(scheduler, block_size)
    )
    scheduler.pool.listener = events
    if metrics is not None:
        p = events.publisher
        metrics.gauge("kv_events_batches_total", "KV event batches published.",
                      lambda: p.batches, "counter")  # fmt: skip
        metrics.gauge("kv_events_dropped_total", "KV event records dropped: queue full.",
                      lambda: p.dropped, "counter")  # fmt: skip
    return events
