"""Rank 0's lookup across ranks without rank collapse: where EVERY rank's objects of a hit sit.

Without rank collapse rank r keys its own objects (worker r of a world of N). LMCache's
lookup (worker None) already fans out over every worker of the world: the hit counts only
chunks every rank holds, and every rank's objects are read-locked (one reader each) until the
connector's one free after the load. What the engine-driven load needs besides is each rank's
byte spans, which ``RankLocator`` asks for in the same call that locates rank 0's
(``atom.locate`` / ``atom.lookup_locate`` with ``workers`` = N: one round-trip per hit, as at
one rank). Rank 0 copies its own part (``Located``), and every other rank r is sent
``Located.ranks[r - 1]`` (``RankedTransfers.submit_copies``, ``RankTier._copy``).
"""

from __future__ import annotations

import dataclasses
import logging

from atom.tier.worker_side.locator import Located, Locator, Where

log = logging.getLogger("atom.offload")


class RankLocator(Locator):
    """Rank 0's ``Locator`` across ranks without rank collapse, where rank r keys its own
    objects (worker r of a world of N): each locate, ``atom.locate`` and the one call of
    ``atom.lookup_locate`` alike, asks for the objects of every worker id (``workers``: still
    one round-trip per hit; the lookup, worker None, locked every rank's objects and counted
    only chunks every rank holds), and a ``Located`` carries each other rank's ``Where``
    (``ranks``). A hit whose objects some rank lacks has no ``Located`` (it loads through the
    server); a server whose module locates one worker only turns engine-driven loads off."""

    def _request(self, *args) -> dict:
        return {**super()._request(*args), "workers": self.world_size}

    def lookup_request(self, *args) -> dict:
        return {**super().lookup_request(*args), "workers": self.world_size}

    def located_of(self, answer: dict, hit: int) -> Located | None:
        located = super().located_of(answer, hit)
        if located is None:
            return None
        if "ranks" not in answer:
            self.probe.refuse(
                "the server's atom module locates one rank's objects only (an older atom): "
                "start it with this atom's --server-module, or use load_mode lmcache_driven"
            )
            return None
        try:
            ranks = tuple(self._where(located, objects) for objects in answer["ranks"])
        except (ValueError, TypeError, IndexError) as exc:
            log.debug("locate [0, %d) of every rank: %s", hit, exc)
            return None
        if len(ranks) != self.world_size - 1:
            return None
        return dataclasses.replace(located, ranks=ranks)

    @staticmethod
    def _where(located: Located, objects) -> Where:
        pages, images = objects
        if len(pages) != len(located.pages) or len(images) != 1:
            raise ValueError(f"{len(pages)} page objects, {len(images)} images")
        spans = tuple((int(o), int(n)) for o, n in pages)
        image = (int(images[0][0]), int(images[0][1]))
        return Where(located.mapping.ident, spans, image, located.end)
