"""Confirmation lookups: asked late, and shared by the requests of one prefix.

A request whose whole loadable prompt is already in HBM does not wait for a lookup (it is
admitted at once, CONFIRMING); the answer only tells its saves what the tier still holds, so
that a prefix the tier lost is stored again from HBM and one it holds is not. Every such
request used to send its lookup at admission: three server calls (the lookup, the free of the
read locks it took, the session's end), all the tier did on a workload that fits in HBM (an
idle tier), and in the very step that prefilled the request's tail. Now a request asks only
once it nears the first boundary it would store (``CONFIRM_LEAD`` of a chunk before it): one
whose ``max_tokens`` end it first has nothing to save and asks nothing. A prefix the connector
does not know stored (after a restart) is still confirmed at admission (planner.py decides
when; this module only shares).

The requests of one prefix also share one confirmation. The prefix is named by the engine's
block hash at the lookup's end, a chunk boundary (a chained hash: equal hashes, equal tokens
up to the boundary). The first request sends the lookup (the leader); the requests admitted
while it is in flight follow it and settle with its answer; for ``ttl_s`` after it an answer
is reused at once. An answer older than that is not trusted (the server may have evicted the
prefix since): the next request asks again. A failed or late confirmation settles the
followers as unknown (they neither load nor store, as their leader). ``clear`` forgets every
answer (the tier may have lost what it held).

One object per connector, used on the step thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

CONFIRM_TTL_S = 1.0  # an answer reused for this long by the other requests of its prefix
CONFIRM_LEAD = 0.25  # asked this fraction of a chunk before the first boundary it would store


@dataclass
class _Confirmation:
    leader: object  # the TierRequest whose lookup asks
    followers: list = field(default_factory=list)


class Confirmations:
    def __init__(self, ttl_s: float = CONFIRM_TTL_S):
        self.ttl_s = ttl_s
        self._asking: dict[int, _Confirmation] = {}  # prefix key -> the lookup in flight
        # prefix key -> (tokens held, when), oldest first (expired from the front)
        self._known: OrderedDict[int, tuple[int, float]] = OrderedDict()
        self.shared = 0  # requests settled by another request's confirmation

    def known(self, key: int, now: float) -> int | None:
        """Tokens the tier held of this prefix, if a confirmation answered within ``ttl_s``."""
        got = self._known.get(key)
        if got is None:
            return None
        if now - got[1] > self.ttl_s:
            del self._known[key]
            return None
        self.shared += 1
        return got[0]

    def follow(self, key: int, st) -> bool:
        """Join the confirmation of ``key`` in flight, if there is one."""
        asking = self._asking.get(key)
        if asking is None:
            return False
        asking.followers.append(st)
        return True

    def lead(self, key: int, st) -> None:
        """``st``'s lookup confirms ``key``: the requests admitted meanwhile follow it."""
        self._asking[key] = _Confirmation(st)

    def answered(self, key: int, leader, hit: int | None, now: float) -> list:
        """The leader's confirmation settled (``hit`` None: failed or late, unknown); returns
        its followers, to settle the same way. A leader that no longer leads (its key was
        cleared or led again since) returns none."""
        asking = self._asking.get(key)
        if asking is None or asking.leader is not leader:
            return []
        del self._asking[key]
        if hit is not None:
            self._known.pop(key, None)
            self._known[key] = (hit, now)
            self._expire(now)
        self.shared += len(asking.followers)
        return asking.followers

    def clear(self) -> None:
        """Forget every answer (the tier may have lost what it held); lookups in flight still
        settle their followers."""
        self._known.clear()

    def _expire(self, now: float) -> None:
        """Drop answers past ``ttl_s`` (memory bounded by the prefixes of the last ttl)."""
        while self._known:
            key, (_, at) = next(iter(self._known.items()))
            if now - at <= self.ttl_s:
                break
            del self._known[key]
