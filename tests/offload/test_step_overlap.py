"""The connector's step-thread work overlaps the forward: what the tier's threads settled is
folded in at the step's ``while_forward`` (the forward is queued on the device then), its
outcomes applied at once. The fold acts on what changed (settled ops, due
deadlines, held answers, finished requests), so an update with nothing to do walks no
request.

The step thread copies no prompt for the tier either: a lookup and a lock free carry the
request's live token list, and the lookup thread takes the tokens they name as it sends. And
after_step asks nothing for a request that cannot store yet (its tier state unknown) and does
not weigh again a confirmation its admission found never due.

A real engine (v41-tiny, CPU) over the fake tier of tests/offload/fakes.py.
"""

from __future__ import annotations

from atom.engine.sequence import SeqStatus
from atom.tier.worker_side.lookup_thread import LookupThread

from .fakes import BLOCK, prompt_of, unstarted_lookup_thread


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


def test_a_lookup_and_a_free_send_the_tokens_they_name_copied_off_the_step_thread(make):
    """The step thread queues a lookup with the request's live list and its length (no copy of
    a prompt of thousands of tokens, tens of microseconds each); the lookup thread sends
    exactly the prompt less its last token. A free queued with a live list sends the first
    ``end`` tokens even when the list grew before the thread got to it."""
    h = make(auto_lookups=False)
    thread = unstarted_lookup_thread(h.connector)
    adapter = thread._adapter
    h.connector.lookups = thread  # the real lookup thread's logic, run here on cue
    try:
        prompt = prompt_of(70, 53)
        s = h.add(prompt, max_tokens=1)
        h.step()
        kind, (lk,) = thread._commands.popleft()
        assert kind == "lookup" and lk.tokens is s.tokens and lk._ids is None
        thread._do_lookup(lk)
        assert adapter.sent == [prompt[:69]]  # a hit never covers the prompt's last token

        live = list(prompt)
        thread.free_locks("r-1", live, BLOCK, 3 * BLOCK)
        live += [5, 6, 7]  # the request grows before the thread sends the free
        thread._run_command(*thread._commands.popleft())
        assert adapter.frees[-1] == ("r-1", BLOCK, 3 * BLOCK)
        assert adapter.sent[-1] == prompt[: 3 * BLOCK]
    finally:
        h.connector.lookups = h.lookups


class _CountedHealth:
    """The connector's health, counting reads of ``healthy`` while ``on``."""

    def __init__(self, inner):
        self._inner, self.on, self.reads = inner, False, 0

    @property
    def healthy(self):
        self.reads += self.on
        return self._inner.healthy

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_after_step_asks_nothing_for_requests_whose_tier_state_is_unknown(make):
    """Requests HBM covered ask the tier what it holds only as they near a boundary they would
    store; until the answer (here: never) their tier state is unknown and they store nothing.
    after_step then asks nothing for them: not the policy, not the server's health (with an
    idle tier that is every running request, every step)."""
    h = make(auto_transfers=("save",))
    prompt = prompt_of(40, 70)
    h.run([h.add(prompt, max_tokens=2)])  # stores the prefix; HBM keeps it
    h.lookups.auto = False  # the confirmations below stay unanswered
    again = [h.add(prompt, max_tokens=12) for _ in range(2)]
    h.step_until(lambda: all(s.status is SeqStatus.RUNNING for s in again))
    conn = h.connector
    states = [conn.request_state(s) for s in again]
    assert all(st.tier_has is None and st.saved_upto == 0 for st in states)
    assert all(s.num_computed >= 32 for s in again)  # past a boundary: a save, were it known
    counted = conn.health = _CountedHealth(conn.health)
    after_step = conn.after_step

    def watched(seqs):
        counted.on = True
        try:
            return after_step(seqs)
        finally:
            counted.on = False

    conn.after_step = watched
    saves = len(h.transfers.saves)
    for _ in range(3):
        h.step()
    assert counted.reads == 0
    assert len(h.transfers.saves) == saves
    conn.after_step, conn.health = after_step, counted._inner
    h.run(again)
    h.shutdown(check=False)


def test_after_step_does_not_weigh_confirming_for_requests_never_due(make, monkeypatch):
    """A request HBM covered whose ``max_tokens`` end it before the first boundary it would
    store never asks (nothing of its own to store): that is decided at admission, and
    after_step does not weigh it again each step (it did, for every such request). One that
    will reach its boundary asks once it nears it, as before."""
    from atom.tier.scheduler_side import planner

    h = make(auto_transfers=("save",))
    prompt = prompt_of(40, 71)
    h.run([h.add(prompt, max_tokens=2)])  # stores the prefix; HBM keeps it
    weighed = []
    inner = planner.confirm_end

    def counted(seq, *a, **k):
        weighed.append(seq.seq_id)
        return inner(seq, *a, **k)

    monkeypatch.setattr(planner, "confirm_end", counted)
    short = h.add(prompt, max_tokens=4)  # 43 tokens at most: never at 48, its first boundary
    long = h.add(prompt, max_tokens=12)  # reaches 48: asks once past 44
    h.run([short, long])
    assert weighed.count(short.seq_id) == 1  # at admission, then never again
    assert weighed.count(long.seq_id) >= 1
    asked = [op for op in h.lookups.ops if op.owner.seq is long]
    assert len(asked) == 1  # (up to 32, the prompt's last boundary: its tokens to 48 not yet made)
    assert not [op for op in h.lookups.ops if op.owner.seq is short]
    h.shutdown()


class _WakeLog:
    """The lookup thread's condition, logging each wake-up beside the connector's hooks."""

    def __init__(self, thread: LookupThread, connector, events: list[str]):
        cond, self.events = thread._cond, events

        class Logged(type(cond)):
            def notify(self, n=1):
                events.append("wake")
                super().notify(n)

        thread._cond = Logged()
        for name in ("lookup", "no_forward", "while_forward", "after_step"):
            setattr(connector, name, self._logged(name, getattr(connector, name)))

    def _logged(self, name, hook):
        def call(*args, **kwargs):
            self.events.append(name)
            return hook(*args, **kwargs)

        return call


def test_a_lookup_wakes_the_lookup_thread_while_the_forward_runs_not_while_planning(make):
    """A lookup asked while the step is planned is queued; the thread is woken at the step's
    while_forward (the forward queued on the device), so building the lookup's keys takes the
    interpreter lock while the step thread would wait for the device, not during planning."""
    h = make()
    long = h.add(prompt_of(40, 54), max_tokens=8)
    h.step_until(lambda: long.status is SeqStatus.RUNNING)
    thread, events = unstarted_lookup_thread(h.connector), []
    h.connector.lookups = thread
    try:
        _WakeLog(thread, h.connector, events)
        s = h.add(prompt_of(70, 55), max_tokens=1)
        h.step()
        assert s.status is SeqStatus.WAITING_FOR_TIER
        assert [k for k, _ in thread._commands] == ["lookup"]
        # (not started here, the thread leaves its commands queued: after_step wakes it again)
        assert events[:3] == ["lookup", "while_forward", "wake"]
    finally:
        h.connector.lookups = h.lookups


def test_a_step_without_a_forward_sends_its_lookups_at_once(make):
    """A step whose only request waits on its lookup runs no forward: the engine tells the
    tier so, and the lookup thread is woken in that step (were it left to the next step's
    update, the driver would first block for its wait, a second, for nothing)."""
    h = make(auto_lookups=False)
    thread, events = unstarted_lookup_thread(h.connector), []
    h.connector.lookups = thread
    try:
        _WakeLog(thread, h.connector, events)
        s = h.add(prompt_of(70, 56), max_tokens=1)
        result = h.engine.step()
        assert not result.ran and result.must_wait
        assert s.status is SeqStatus.WAITING_FOR_TIER
        assert events == ["lookup", "no_forward", "wake"]
    finally:
        h.connector.lookups = h.lookups
