"""The verdict on one of the engine's direct paths (``ServerProbe``), on cue: a probe whose
answer is held back is "unknown", asked again as its doubling backoff allows (a fake clock says
when) and "supported" once the server answers; a definite no stands until the server changes;
a server change clears any verdict, and a probe of the old server cannot decide the new one's.

The server module is a fake (``Module``): what it answers, and when, is the test's. The probe
still runs on its thread, with its own zmq context and its real wait, against the session's
LMCache server (which answers a noop, as a server just restarted did in CI)."""

from __future__ import annotations

import threading

import pytest

from atom.tier.worker_side.server_probe import (
    PROBING,
    RETRY_FIRST_S,
    RETRY_MAX_S,
    SUPPORTED,
    UNKNOWN,
    UNSUPPORTED,
    ServerProbe,
    Unanswered,
    Unsupported,
)

from .fakes import FakeClock


class Held:
    """A reply that does not come (a future whose ``wait`` is never satisfied)."""

    def wait(self, timeout: float) -> bool:
        return False


class Module:
    """The server module as a probe's ``ask`` sees it: ``answers`` says what each call gets
    ("held": no reply in time; "no": a definite no; a dict: that answer; ``("gated", what)``:
    ``what`` once the test sets ``gate``); the last entry repeats."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.asked = 0
        self.gate = threading.Event()
        self.gated = threading.Event()  # a call waits at the gate

    def ask(self, client, wait) -> dict:
        what = self.answers[min(self.asked, len(self.answers) - 1)]
        self.asked += 1
        if isinstance(what, tuple):
            self.gated.set()
            assert self.gate.wait(30.0), "the test never let the answer through"
            what = what[1]
        if what == "held":
            assert not wait(Held())  # the probe's own wait runs out (wait_s 0)
            raise Unanswered()
        if what == "no":
            raise Unsupported("the server has no atom.test")
        return what


@pytest.fixture()
def make_probe(lmcache_server):
    made, modules = [], []

    def make(module: Module, clock=None) -> ServerProbe:
        modules.append(module)
        p = ServerProbe(
            url=lmcache_server.url,
            method="atom.test",
            path="saves go",
            ask=module.ask,
            wait_s=0.0,
            clock=clock or FakeClock(),
        )
        made.append(p)
        return p

    yield make
    for p in made:
        for m in modules:
            m.gate.set()
        p.close()


def test_an_unanswered_probe_is_unknown_then_asked_again_and_supported(make_probe):
    clock, module = FakeClock(), Module("held", {"v": 1})
    probe = make_probe(module, clock)
    assert probe.mode().startswith("probing (") and not probe.ready()
    probe.start()
    assert probe.wait(30.0, definite=False) and probe.state == UNKNOWN
    mode = probe.mode()
    assert mode.startswith("lmcache_driven (unknown: the server answers a noop but not atom.test")
    assert "--server-module" in mode and "asking again in 1 s" in mode
    # not before the backoff is over: nothing is sent, the path stays the server's
    clock.advance(RETRY_FIRST_S - 0.01)
    assert not probe.ready() and probe.probes == 1
    clock.advance(0.02)
    assert not probe.ready() and probe.probes == 2  # sent; its verdict is not in yet
    assert probe.wait(30.0) and probe.state == SUPPORTED
    assert probe.ready() and probe.mode() == "engine_driven" and probe.answer == {"v": 1}
    assert module.asked == 2


def test_unanswered_probes_back_off_doubling_to_a_bound(make_probe):
    clock, module = FakeClock(), Module("held")
    probe = make_probe(module, clock)
    probe.start()
    waits = []
    for _ in range(9):
        assert probe.wait(30.0, definite=False) and probe.state == UNKNOWN
        sent, waited = probe.probes, 0.0
        while probe.probes == sent:  # step the fake clock until the retry goes out
            clock.advance(0.5)
            waited += 0.5
            probe.ready()
        waits.append(waited)
        probe.join(30.0)  # that retry's verdict is in: unknown again
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, RETRY_MAX_S, RETRY_MAX_S, RETRY_MAX_S]


def test_a_definite_no_stands_until_the_server_changes(make_probe):
    clock, module = FakeClock(), Module("no", ("gated", {"v": 1}))
    probe = make_probe(module, clock)
    probe.start()
    assert probe.wait(30.0) and probe.state == UNSUPPORTED
    assert probe.mode() == "lmcache_driven (unsupported: the server has no atom.test)"
    clock.advance(10 * RETRY_MAX_S)
    assert not probe.ready() and probe.probes == 1  # never asked again by itself
    probe.server_changed("the server was restarted")
    assert probe.state == PROBING and not probe.ready()
    assert probe.mode() == (
        "probing (saves go through the server until the server answers; the server was "
        "restarted)"
    )
    module.gate.set()
    assert probe.wait(30.0) and probe.state == SUPPORTED and probe.probes == 2


def test_a_probe_of_the_old_server_does_not_decide_for_the_new_one(make_probe):
    module = Module(("gated", "no"), {"v": 2})
    probe = make_probe(module)
    probe.start()
    assert module.gated.wait(30.0)  # out, waiting for the old server's answer
    probe.server_changed("registered with the server again")
    assert probe.wait(30.0) and probe.state == SUPPORTED  # the new server's answer
    module.gate.set()  # the old server's "no" comes in last
    probe.join(30.0)
    assert module.asked == 2 and probe.state == SUPPORTED and probe.answer == {"v": 2}


def test_a_call_unanswered_while_supported_makes_it_unknown_and_asks_again(make_probe):
    module = Module({"v": 1}, "held", {"v": 1})
    probe = make_probe(module)
    probe.start()
    assert probe.wait(30.0) and probe.state == SUPPORTED
    probe.doubt("a reserve went unanswered")
    assert probe.state == UNKNOWN and not probe.ready() and probe.probes == 2  # asked now
    assert probe.wait(30.0, definite=False) and module.asked == 2
    probe.refuse("reserved objects are not this layout's")  # a definite no from a call
    assert probe.state == UNSUPPORTED and "not this layout's" in probe.mode()
