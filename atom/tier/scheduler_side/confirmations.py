"""Confirmation lookups: asked late, and shared by the requests of one prefix.

A request whose whole loadable prompt is already in HBM does not wait for a lookup (it is
admitted at once, CONFIRMING); the answer only tells its saves what the tier still holds, so
that a prefix the tier lost is stored again from HBM and one it holds is not. Every such
request used to send its lookup at admission: three server calls (the lookup, the free of the
read locks it took, the session's end), all the tier did on a workload that fits in HBM (an
idle tier), and in the very step that prefilled the request's tail. Now a request asks only
once it nears the first boundary it would store (``CONFIRM_LEAD`` of a chunk before it): one
whose ``max_tokens`` end it first has nothing to save and asks nothing. A prefix the connector
does not know stored (after a restart) is still confirmed at admission (planner.py knows
that; ``confirm_end`` decides the rest: whether a request is due, and up to where it asks).

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

import sys
from collections import OrderedDict
from dataclasses import dataclass, field

CONFIRM_TTL_S = 1.0  # an answer reused for this long by the other requests of its prefix
CONFIRM_LEAD = 0.25  # asked this fraction of a chunk before the first boundary it would store
NEVER = sys.maxsize  # a computed length no request reaches


def due_from(seq, confirm_at: int, chunk: int) -> int:
    """The computed length from which a CONFIRMING request is due to ask (unless asked
    ``now``): ``CONFIRM_LEAD`` of a chunk before ``confirm_at``; ``NEVER`` for one whose
    ``max_tokens`` end it before ``confirm_at`` (nothing of its own to store). Fixed at
    admission (``max_tokens`` is resolved by then), so the step thread compares one integer
    per request and step."""
    if seq.max_tokens and seq.num_prompt + seq.max_tokens - 1 < confirm_at:
        return NEVER
    return confirm_at - int(CONFIRM_LEAD * chunk)


def confirm_end(seq, confirm_at: int, chunk: int, block_size: int, now: bool) -> int | None:
    """Where a CONFIRMING request's lookup ends, once it is due (``now``, or within
    ``CONFIRM_LEAD`` of a chunk of ``confirm_at``, the first boundary it would store); None
    while it is not, and always for a request whose ``max_tokens`` end it before
    ``confirm_at`` (nothing of its own to store).

    The end is ``confirm_at`` where the request's tokens up to it (and their block hash)
    exist already, so that a chunk the tier holds is not stored again; else the prompt's last
    boundary, what HBM covered (the local hit hashed it)."""
    if not now and seq.num_computed < due_from(seq, confirm_at, chunk):
        return None
    if seq.num_tokens < confirm_at or len(seq.block_hashes) < confirm_at // block_size:
        return confirm_at - chunk
    return confirm_at


def prefix_key(seq, end: int, block_size: int) -> int | None:
    """The key that names the prefix [0, end) (the block hash at its end; None: not hashed)."""
    n = end // block_size
    return seq.block_hashes[n - 1] if n and len(seq.block_hashes) >= n else None


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

    def join(self, key: int, st, now: float) -> tuple[str, int | None]:
        """``st`` confirms the prefix ``key``: ("known", tokens held) where an answer of the
        last ``ttl_s`` says; ("following", None) where a lookup is in flight (``answered``
        returns ``st`` with its followers); else ("leading", None): ``st`` sends the lookup."""
        held = self.known(key, now)
        if held is not None:
            return "known", held
        if self.follow(key, st):
            return "following", None
        self.lead(key, st)
        return "leading", None

    def known(self, key: int, now: float) -> int | None:
        """Tokens the tier held of this prefix, if a confirmation answered within ``ttl_s``."""
        got = self._known.get(key)
        if got is None:
            return None
        if now - got[1] > self.ttl_s:
            del self._known[key]
            return None
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
