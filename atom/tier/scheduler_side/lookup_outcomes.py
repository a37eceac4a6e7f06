"""Lookups of the tier's connector: acting on their answers, and asking again an answer that
a concurrent lookup of the same prefix made short (issue 41).

Part of ``OffloadConnector`` (planner.py), which supplies the clock, metrics, the lookup
thread, the request table, ``_free_locks`` and ``_plan_saves``. Everything here runs on the
step thread. An answer for a request that waits on it (LOOKING_UP) is *held* first, judged
against the other requests' lookups, then settled (``Answered``) or asked again; an answer for
a request already running (CONFIRMING) or finished is settled at once.

Why (measured with lmcache 0.5.6, an L1 that lacks a prefix and an L2 that holds it): two
lookups of one prefix sent together each start an L2 prefetch. The first one's load lands in
L1 while the second is between its L1 pass (which read-locked nothing) and its L1 reservation,
which then fails for the now resident objects ("l1_contended"). The second prefetch keeps only
what its L1 pass locked and answers short (0 when the contended chunks come first), within
milliseconds: its request would compute a prefix the first one is loading at that moment.

The judgement, with X the request judged, ``held`` its answer, and Y any other request whose
lookup shares ``shared(X, Y)`` tokens with X's (on the chunk grid):

  wait    Y's lookup is unanswered and ``shared(X, Y) > held``: Y's answer may show X short.
  owed    over the Y answered since X's lookup was sent (only those can have raced it):
          ``min(shared(X, Y), answer(Y))``, the most the tier was just shown to hold of X.
  short   ``owed > held``: X's locks are freed and its lookup is sent again (same deadline).
          The prefix is resident in L1 now (Y's prefetch landed it), so the new lookup finds
          it, and X's own chunks after it from L2.
  settle  otherwise, or once the lookup's deadline has passed (the answer as it is).

A second answer is judged only against lookups answered while it was in flight, so asking
again stops by itself; ``MAX_ASKS`` bounds it regardless.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import NamedTuple

from atom.engine.connector import Answered
from atom.tier.operations import LookupOp, OpState
from atom.tier.scheduler_side.tier_request import Phase, TierRequest

log = logging.getLogger("atom.offload")

MAX_ASKS = 3  # lookups one request may send: the first, and at most two more for short answers


class Verdict(NamedTuple):
    wait: bool  # a concurrent lookup that may show the answer short is unanswered
    owed: int  # tokens of the lookup the concurrent answers show the tier holds


def shared_tokens(a: list[int], b: list[int], chunk: int) -> int:
    """Tokens of the longest common prefix of ``a`` and ``b``, floored to the chunk grid."""
    end = min(len(a), len(b)) // chunk * chunk
    n = 0
    while n < end and a[n : n + chunk] == b[n : n + chunk]:
        n += chunk
    return n


def judge(st: TierRequest, others: Iterable[TierRequest], chunk: int) -> Verdict:
    """``st``'s held answer against the lookups of ``others`` (``st`` among them is skipped).
    Reads only: the caller acts on the verdict."""
    mine = st.lookup.token_ids
    wait, owed = False, 0
    for other in others:
        if other is st or other.lookup is None or other.asked_at is None:
            continue
        theirs = other.reply
        if theirs is None:  # sent and unanswered: it may still land what st missed
            if not wait and shared_tokens(mine, other.lookup.token_ids, chunk) > st.held:
                wait = True
            continue
        if theirs <= st.held or other.replied_at < st.asked_at:
            continue
        owed = max(owed, min(theirs, shared_tokens(mine, other.lookup.token_ids, chunk)))
    return Verdict(wait, owed)


class LookupOutcomes:
    """Lookups for ``OffloadConnector`` (see the module)."""

    def _send_lookup(self, st: TierRequest, tokens: list[int], deadline: float) -> None:
        st.lookup = LookupOp(st.lmc_id, tokens, deadline, st)
        st.asked_at, st.replied_at, st.asks = self.clock(), None, st.asks + 1
        self.lookups.lookup(st.lookup)

    def _on_lookup(self, op: LookupOp) -> None:
        st: TierRequest = op.owner
        if op.finished_at is not None:
            self.tier_metrics.lookup_latency.observe(op.finished_at - op.created_at)
        if st.lookup is not op or st.answer is not None:
            return  # given up (late): the lookup thread frees what it locked
        st.replied_at = self.clock()
        if op.state is not OpState.DONE:
            self.tier_metrics.lookups.inc(outcome="failed")
            log.debug("lookup %s: %s", op.lmc_id, op.error)
            self._settle_answer(st, 0, known=False)
            return
        hit = op.hit // self.chunk_size * self.chunk_size
        st.locked = hit
        if st.phase is Phase.LOOKING_UP:
            st.held = hit  # judged against concurrent lookups first (_judge_answers)
        else:
            self._settle_answer(st, hit)

    def _judge_answers(self) -> None:
        """Act on held answers: wait while a concurrent lookup of the same prefix may show one
        short, ask a short one again (its locks freed first), settle the rest. An answer still
        held at its lookup's deadline is settled as it is."""
        now = self.clock()
        for st in [s for s in self._requests.values() if s.held is not None]:
            verdict = judge(st, self._requests.values(), self.chunk_size)
            in_time = now < st.lookup.deadline
            if verdict.wait and in_time:
                continue
            if verdict.owed > st.held and in_time and st.asks < MAX_ASKS:
                self.tier_metrics.lookups.inc(outcome="short")
                log.debug("lookup %s: %d of %d; asked again", st.lmc_id, st.held, verdict.owed)
                st.held = None
                self._free_locks(st)
                self._send_lookup(st, st.lookup.token_ids, st.lookup.deadline)
            else:
                hit, st.held = st.held, None
                self._settle_answer(st, hit)

    def _drop_held(self, st: TierRequest) -> None:
        """A held answer of a request that will not load it: final as it is (its locks stay
        counted in ``locked``, for the caller to free)."""
        if st.held is not None:
            st.answer, st.held = st.held, None

    def _settle_answer(self, st: TierRequest, hit: int, known: bool = True) -> None:
        """The lookup's final answer: ``hit`` tokens (locked on the server), or no answer
        (``known`` False: neither load nor store)."""
        st.answer = hit
        if known:
            st.tier_has = st.saved_upto = hit
            self.tier_metrics.lookups.inc(outcome="hit" if hit else "miss")
        st.locked = hit
        op = st.lookup
        st.located = op.located if op.located is not None and op.located.end == hit else None
        if st.phase is Phase.LOOKING_UP and hit:
            st.to(Phase.ANSWERED)
            self._emitted.append(Answered(st.seq))
            return
        self._free_locks(st)  # nothing to load: the request runs, or finished, without it
        if st.phase is Phase.LOOKING_UP:
            st.to(Phase.RUNNING)
            self._emitted.append(Answered(st.seq))
        elif st.phase is Phase.CONFIRMING:
            st.to(Phase.RUNNING)
            if st.seq.block_table:
                self._plan_saves(st)
