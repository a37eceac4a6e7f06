"""PAGE blocks: reference counts, chained prefix hashes, and an LRU of free-but-cached blocks.

A block is in exactly one of three pool states:
  free     ref 0, no hash                 allocatable at once
  cached   ref 0, hash registered          allocatable after eviction (LRU order)
  owned    ref > 0                         by sequences, checkpoint images or transfer leases

Evicting a cached block unregisters its hash and reports it through ``on_evict`` (the
checkpoint store drops every READY image whose prefix contained that hash: state within KV).
An optional ``listener`` (``PoolListener``; KV events) hears every hash that becomes resident
(``stored``) and every one that stops being resident (``removed``); a hash handed from one block
to another is neither. Without one each operation pays one ``if``.

Recency: cached blocks are evicted in the order their users released them. A user is a
sequence or a prefix hit; a transfer lease (a tier store still reading the block) is not: a
block whose last reference was a lease keeps the recency its sequence gave it. Otherwise a
request's tail, whose stores finish after the request does, would look newer than its prefix
and outlive it (found in the tier arm's cold pass: shared-prefix blocks evicted first, their
checkpoint images dropped with them, no HBM hits).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import xxhash

ROOT_HASH = 0


def chain_hash(parent: int, token_ids: Sequence[int]) -> int:
    """Hash of a full block: xxhash64 of the parent's hash and the block's token ids."""
    h = xxhash.xxh64(parent.to_bytes(8, "little"))
    h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in token_ids))
    return h.intdigest()


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Chained hashes of every full block of ``token_ids``."""
    out = []
    for i in range(len(token_ids) // block_size):
        parent = chain_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


class PoolExhausted(RuntimeError):
    pass


class PoolListener(Protocol):
    """Told, on the thread that changes the pool, when a hash becomes or stops being resident."""

    def stored(self, block: int, block_hash: int) -> None: ...

    def removed(self, block_hash: int) -> None: ...


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.by_hash: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        # cached blocks; the heap of (stamp, block) orders them (stale entries are skipped)
        self._cached: set[int] = set()
        self._lru: list[tuple[int, int]] = []
        self._clock = itertools.count()
        self._stamp = [0] * num_blocks  # when a user last released the block
        self.on_evict: Callable[[int], None] = lambda h: None
        self.listener: PoolListener | None = None
        self.evictions = 0
        # twins: live blocks whose computed content duplicates a registered hash (a request
        # that recomputed a prefix another block holds), block -> hash; one takes the hash
        # over when the registered holder is evicted, so images depending on it stay valid
        self._twin_of: dict[int, int] = {}

    # ---- queries ------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_allocatable(self) -> int:
        return len(self._free) + len(self._cached)

    def lookup(self, h: int) -> int | None:
        return self.by_hash.get(h)

    def is_free(self, block: int) -> bool:
        return block in self._free

    def is_cached(self, block: int) -> bool:
        return block in self._cached

    # ---- predicate / action pairs ----------------------------------------------------------

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_allocatable

    def allocate(self, n: int) -> list[int]:
        """n blocks with ref 1: free ones first, then evicting the least recently used cached."""
        if not self.can_allocate(n):
            raise PoolExhausted(f"need {n} blocks, {self.num_allocatable} allocatable")
        out = []
        for _ in range(n):
            if self._free:
                b, _ = self._free.popitem(last=False)
            else:
                b = self._pop_lru()
                self._uncache(b)
                self.evictions += 1
            self.ref[b] = 1
            out.append(b)
        return out

    def acquire(self, blocks: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix hit or a lease)."""
        for b in blocks:
            if self.ref[b] == 0:
                if b in self._cached:
                    self._cached.remove(b)
                else:
                    raise RuntimeError(f"block {b} is free and holds nothing to share")
            self.ref[b] += 1

    def release(self, blocks: Iterable[int], lease: bool = False) -> None:
        """Drop one reference on each block, in the given order; a block reaching 0 becomes
        cached (if hashed), else free. A user's release (``lease`` False) makes the block the
        most recent; pass a sequence's blocks tail first so prefixes outlive their tails. A
        lease's release leaves the recency as the block's last user set it."""
        for b in blocks:
            if self.ref[b] <= 0:
                raise RuntimeError(f"block {b} released more often than acquired")
            self.ref[b] -= 1
            if not lease:
                self._stamp[b] = next(self._clock)
            if self.ref[b] == 0:
                self._twin_of.pop(b, None)  # an unhashed twin just becomes free
                if self.hash_of[b] is not None:
                    self._cache(b)
                else:
                    self._free[b] = None

    def register(self, block: int, h: int) -> bool:
        """Publish a full, computed block under its chained hash. When another block holds
        the hash: a cached holder hands it over (it becomes free; the hash stays resident,
        nothing is evicted); a live holder keeps it and ``block`` becomes its twin (unhashed,
        returns False), taking the hash over if the holder is evicted first."""
        if self.hash_of[block] is not None:
            return self.hash_of[block] == h
        holder = self.by_hash.get(h)
        if holder is not None and self.ref[holder] > 0:
            self._twin_of[block] = h
            return False
        if holder is not None:
            self._cached.remove(holder)
            self._free[holder] = None
            self.hash_of[holder] = None
        self.hash_of[block] = h
        self.by_hash[h] = block
        if holder is None and self.listener is not None:
            self.listener.stored(block, h)
        return True

    def twins(self) -> dict[int, int]:
        """block -> hash of every live twin (integrity checks)."""
        return dict(self._twin_of)

    def forget(self, block: int) -> None:
        """Unregister a block's hash (its bytes can no longer be trusted); an unowned block
        becomes free."""
        if self.hash_of[block] is None:
            return
        if block in self._cached:
            self._cached.remove(block)
            self._free[block] = None
        self._uncache(block)

    def _cache(self, b: int) -> None:
        self._cached.add(b)
        heapq.heappush(self._lru, (self._stamp[b], b))
        if len(self._lru) > 2 * len(self._cached) + 64:  # drop stale entries now and then
            self._lru = [(self._stamp[c], c) for c in self._cached]
            heapq.heapify(self._lru)

    def _pop_lru(self) -> int:
        """The least recent cached block, taken out of the cache (the heap's stale entries,
        left by acquires and hand-overs, are dropped on the way)."""
        while True:
            stamp, b = heapq.heappop(self._lru)
            if b in self._cached and self._stamp[b] == stamp:  # a cached block keeps its stamp
                self._cached.remove(b)
                return b

    def _uncache(self, block: int) -> None:
        h = self.hash_of[block]
        if h is not None:
            self.hash_of[block] = None
            del self.by_hash[h]
            # a live copy takes the hash over: still resident, nothing evicted (twins are few:
            # only blocks recomputed while their holder was live)
            twin = next((b for b, th in self._twin_of.items() if th == h), None)
            if twin is not None:
                del self._twin_of[twin]
                self.hash_of[twin], self.by_hash[h] = h, twin
                return
            if self.listener is not None:
                self.listener.removed(h)
            self.on_evict(h)
