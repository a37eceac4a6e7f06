"""The connector's step-thread work overlaps the forward: what the tier's threads settled is
folded in at the step's ``while_forward`` (the forward is queued on the device then), its
outcomes applied at once. The fold acts on what changed (settled ops, due
deadlines, held answers, finished requests), so an update with nothing to do walks no
request.

A real engine (v41-tiny, CPU) over the fake tier of tests/offload/fakes.py.
"""

from __future__ import annotations

from atom.engine.sequence import SeqStatus

from .fakes import prompt_of


def test_what_settled_is_folded_while_the_forward_runs(make):
    """A save that completed during a step is folded in that step's while_forward (after its
    forward was queued, before sampling waits on it); its outcome (the sources released) is
    applied then, and the next update finds nothing left to fold."""
    h = make()
    long = h.add(prompt_of(40, 51), max_tokens=60)  # keeps every step running a forward
    s = h.add(prompt_of(87, 52), max_tokens=30)
    h.step_until(lambda: h.transfers.saves)
    save = h.transfers.saves[0]
    conn, seen = h.connector, []
    while_forward = conn.while_forward

    def window():
        before = len(conn.settled._ops)
        out = while_forward()
        seen.append((before, len(conn.settled._ops), save.leased, len(out)))
        return out

    def planned(spans):  # the save completes on its thread after the step's update ran
        before_forward(spans)
        h.transfers.complete(save)

    before_forward = conn.before_forward
    conn.while_forward, conn.before_forward = window, planned
    h.step()  # the integrity check after it: the engine applied the release
    conn.before_forward = before_forward
    assert seen == [(1, 0, False, 1)]  # one outcome: the save's sources released
    assert conn.update() == []  # nothing left for the next step's update
    h.transfers.auto = {"save"}
    h.transfers.complete_all()
    h.run([long, s])
    h.shutdown()


def test_an_update_with_nothing_to_do_walks_no_request(make):
    """With requests running and nothing settled, due, held or finished, the fold reads no
    request's state: the sweeps act on what changed only."""
    h = make(auto_transfers=("save",))
    seqs = [h.add(prompt_of(40, 40 + i), max_tokens=40) for i in range(4)]
    h.step_until(lambda: all(s.status is SeqStatus.RUNNING for s in seqs))
    h.step()
    conn = h.connector
    reads = []

    class Watched(dict):
        def values(self):
            reads.append("values")
            return super().values()

        def __iter__(self):
            reads.append("iter")
            return super().__iter__()

    h.engine.scheduler.apply(conn.update())  # fold what the step's saves settled
    conn._requests = Watched(conn._requests)
    assert conn.update() == []
    assert reads == []
    h.run(seqs)
    h.shutdown()
