"""An engine-driven save's copy, once complete, wakes the transfer thread at once
(``copy_waiter.CopyWaiter``) instead of waiting for its next poll: on a GPU the round saw a
one-chunk save's copy complete about 0.4 ms after its issue for a 0.05 ms copy. Here fake
events stand in for CUDA's (the CUDA path runs in tests/gpu's tier two-pass)."""

from __future__ import annotations

import threading

from atom.tier.operations import OpState
from atom.tier.worker_side.copy_waiter import CopyWaiter

from .fakes import make_transfer_thread, wired_transfer_thread

WAIT_S = 10.0  # upper bound for a thread to reach a barrier (never slept)


class _GateEvent:
    """A copy event whose ``synchronize`` blocks until the test fires it."""

    def __init__(self, fail: bool = False):
        self.fired, self.fail = threading.Event(), fail

    def synchronize(self) -> None:
        assert self.fired.wait(WAIT_S)
        if self.fail:
            raise RuntimeError("cudaEventSynchronize failed")


def test_each_fired_copy_wakes_the_transfer_thread_once_in_issue_order():
    woken, cond = [], threading.Condition()

    def on_done():
        with cond:
            woken.append(len(woken))
            cond.notify_all()

    waiter = CopyWaiter(on_done)
    first, second, broken = _GateEvent(), _GateEvent(), _GateEvent(fail=True)
    for e in (first, second, broken):
        waiter.watch(e)
    second.fired.set()  # a copy stream completes in issue order: nothing before the first
    first.fired.set()
    with cond:
        assert cond.wait_for(lambda: len(woken) == 2, WAIT_S)
    broken.fired.set()  # a wait that raises still wakes the round (its query reports it)
    with cond:
        assert cond.wait_for(lambda: len(woken) == 3, WAIT_S)
    waiter.close(WAIT_S)
    assert waiter.waited == 3 and waiter.errors == 1
    assert not waiter._thread.is_alive()


def test_a_waiter_that_saw_no_copy_starts_no_thread():
    waiter = CopyWaiter(lambda: None)
    waiter.close()
    assert waiter._thread is None


def test_copy_done_runs_the_transfer_round_before_its_poll_timer(monkeypatch):
    """With a poll every 60 s, an op whose completion the copy waiter reports is settled
    within the test's bound: copy_done wakes the round."""
    w = wired_transfer_thread(monkeypatch, poll_interval_s=60.0)
    tt, cond, outcomes, got = w.tt, w.cond, w.outcomes, w.got
    try:
        assert tt.start(wait_registered_s=WAIT_S)
        assert cond.blocked.wait(WAIT_S)
        op, fut = w.submit_queried(WAIT_S)
        fut.done = True
        tt.copy_done()
        assert got.wait(WAIT_S)
        assert outcomes == [(op, OpState.DONE)]
    finally:
        tt.stop(1.0)
    assert not tt.thread.is_alive()


def test_a_copy_done_during_a_round_is_not_lost(monkeypatch):
    """copy_done called while the round that queried the op still runs (held here until it
    is called): the thread skips its next 60 s wait and settles the op."""
    w = wired_transfer_thread(monkeypatch, poll_interval_s=60.0)
    tt, cond = w.tt, w.cond
    in_round, gate = threading.Event(), threading.Event()
    poll_round = tt._poll_round

    def held_round():
        poll_round()
        if tt._inflight and not gate.is_set():  # the round that queried the op: hold it
            in_round.set()
            assert gate.wait(WAIT_S)

    tt._poll_round = held_round
    try:
        assert tt.start(wait_registered_s=WAIT_S)
        assert cond.blocked.wait(WAIT_S)
        op, fut = w.submit_queried(WAIT_S)
        assert in_round.wait(WAIT_S)
        fut.done = True
        tt.copy_done()  # the thread is inside its round, not waiting
        gate.set()
        assert w.got.wait(WAIT_S)
        assert w.outcomes == [(op, OpState.DONE)]
    finally:
        gate.set()
        tt.stop(1.0)


def test_the_transfer_thread_gives_its_engine_saves_a_waiter():
    class Saves:
        fallback = waiter = None
        server_changed = None

    saves = Saves()
    tt = make_transfer_thread(lambda op: None, saves=saves)
    assert isinstance(saves.waiter, CopyWaiter) and saves.waiter.on_done == tt.copy_done
