"""Checkpoint images: state-slot copies at block boundaries, kept in whole PAGE blocks ("units").

Lifecycle of one Checkpoint:
  create()      PENDING: units allocated, the copy (or a tier load) has not run yet
  mark_ready()  READY: the bytes are in the units; hit-able and, when unpinned, evictable (LRU)
  pin()/unpin() held while restored into a slot or read by a tier store; never evicted pinned
  drop()        units return to the pool

Invariant (state within KV): a READY image lives only while every block hash of its prefix is
registered in the pool. When the pool evicts or forgets a hash, every READY image whose prefix
holds it is dropped (a pinned one as soon as it is unpinned, and it stops being hit-able at
once). A PENDING image is checked when its writer marks it READY, after the writer registered
its own prefix blocks (a tier load lands blocks whose hashes a cached copy may have held).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass

from atom.engine.block_pool import BlockPool


class CkptState(enum.Enum):
    PENDING = "pending"
    READY = "ready"


@dataclass(eq=False)
class Checkpoint:
    key: int  # chained hash of the boundary block (the last block of the prefix)
    position: int  # tokens before the boundary
    units: list[int]
    prefix: tuple[int, ...]  # chained hashes of every block of the prefix, key last
    state: CkptState = CkptState.PENDING
    pins: int = 0
    doomed: bool = False  # its prefix left the pool while pinned: drop on the last unpin

    @property
    def ready(self) -> bool:
        return self.state is CkptState.READY and not self.doomed


class CheckpointStore:
    def __init__(self, pool: BlockPool, units_per_image: int):
        self.pool, self.units = pool, units_per_image
        self.images: dict[int, Checkpoint] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # READY and unpinned, LRU first
        self._dependents: dict[int, set[int]] = {}  # prefix hash -> image keys
        self.limbo: set[Checkpoint] = set()  # doomed while pinned: units still held
        pool.on_evict = self._on_hash_evicted
        self.created = self.evicted = self.dropped_with_prefix = 0

    # ---- queries ------------------------------------------------------------------------

    def get_ready(self, key: int) -> Checkpoint | None:
        ckpt = self.images.get(key)
        if ckpt is None or not ckpt.ready:
            return None
        if key in self._lru:
            self._lru.move_to_end(key)
        return ckpt

    def ready_image(self, key: int) -> Checkpoint | None:
        """The READY image at ``key``, or None; a pure read (no recency change): what the tier
        asks when it plans its stores."""
        ckpt = self.images.get(key)
        return ckpt if ckpt is not None and ckpt.ready else None

    def counts(self) -> dict[str, int]:
        ready = sum(1 for c in self.images.values() if c.state is CkptState.READY)
        return {
            "ready": ready,
            "pending": len(self.images) - ready,
            "pinned": sum(1 for c in self.images.values() if c.pins),
            "units": sum(len(c.units) for c in self.owners()),
        }

    def owners(self) -> list[Checkpoint]:
        """Every checkpoint that holds units (live images and pinned doomed ones)."""
        return [*self.images.values(), *self.limbo]

    # ---- predicate / action pairs ----------------------------------------------------------

    def create(self, key: int, position: int, prefix: tuple[int, ...]) -> Checkpoint | None:
        """A PENDING image for the boundary ``key`` (None if one exists or there is no room),
        pinned once for its writer: the writer calls ``mark_ready`` (or ``drop``) and then
        ``unpin`` once the bytes are in (or once nothing can write the units any more)."""
        if key in self.images or not self.make_room(self.units):
            return None
        ckpt = Checkpoint(key, position, self.pool.allocate(self.units), prefix, pins=1)
        self.images[key] = ckpt
        for h in prefix:
            self._dependents.setdefault(h, set()).add(key)
        self.created += 1
        return ckpt

    def mark_ready(self, ckpt: Checkpoint) -> bool:
        """The bytes are in. Returns False (and dooms it) if its prefix is not resident."""
        ckpt.state = CkptState.READY
        if not ckpt.doomed and any(self.pool.lookup(h) is None for h in ckpt.prefix):
            self._doom(ckpt)
        return not ckpt.doomed

    def pin(self, ckpt: Checkpoint) -> None:
        ckpt.pins += 1
        self._lru.pop(ckpt.key, None)

    def unpin(self, ckpt: Checkpoint) -> None:
        if ckpt.pins <= 0:
            raise RuntimeError(f"checkpoint at {ckpt.position} unpinned more than pinned")
        ckpt.pins -= 1
        if ckpt.pins == 0:
            if ckpt.doomed:
                self._maybe_release(ckpt)
            elif ckpt.state is CkptState.READY:
                self._lru[ckpt.key] = None

    def drop(self, ckpt: Checkpoint) -> None:
        """Forget an image (a failed copy or load); units return to the pool once unpinned."""
        self._doom(ckpt)

    def evict_fewest_dependents(self) -> bool:
        """Evict the unpinned image that the fewest images extend, least recently used first:
        a leaf (extended by none) when there is one, else the one closest to the leaves. The
        images of shared prefixes outlive the tails below them, also while the newest tails
        are pinned by stores in flight and no unpinned leaf is left."""
        if not self._lru:
            return False
        key, fewest = None, None
        for k in self._lru:
            n = len(self._dependents.get(k, ()))  # itself included
            if n <= 1:
                key = k
                break
            if fewest is None or n < fewest:
                key, fewest = k, n
        del self._lru[key]
        self.evicted += 1
        self._doom(self.images[key])
        return True

    def make_room(self, n: int) -> bool:
        """Evict unpinned images (LRU) until ``n`` blocks are allocatable."""
        while not self.pool.can_allocate(n):
            if not self.evict_fewest_dependents():
                return False
        return True

    # ---- internals ------------------------------------------------------------------------

    def _on_hash_evicted(self, h: int) -> None:
        """Drop the READY images whose prefix holds ``h``. A PENDING one stays: its writer (a
        tier load, or the span whose forward ends at it) registers its own prefix blocks
        before ``mark_ready``, which checks the prefix then; until then it is no hit."""
        pending = set()
        for key in self._dependents.pop(h, ()):
            ckpt = self.images.get(key)
            if ckpt is None:
                continue
            if ckpt.state is CkptState.PENDING:
                pending.add(key)
                continue
            self.dropped_with_prefix += 1
            self._doom(ckpt)
        if pending:
            self._dependents[h] = pending

    def _doom(self, ckpt: Checkpoint) -> None:
        if self.images.get(ckpt.key) is ckpt:
            del self.images[ckpt.key]
            for h in ckpt.prefix:
                deps = self._dependents.get(h)
                if deps is not None:
                    deps.discard(ckpt.key)
                    if not deps:
                        del self._dependents[h]
        self._lru.pop(ckpt.key, None)
        ckpt.doomed = True
        self._maybe_release(ckpt)

    def _maybe_release(self, ckpt: Checkpoint) -> None:
        if ckpt.pins:
            self.limbo.add(ckpt)
        elif ckpt.units:
            self.limbo.discard(ckpt)
            units, ckpt.units = ckpt.units, []
            self.pool.release(units)
