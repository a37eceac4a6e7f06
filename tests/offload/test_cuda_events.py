"""How StreamEvents (cuda_events.py) drives the runtime's event calls: the handles and streams
each call gets, a not-yet-fired query (not an error, and cleared so torch's next launch check
does not see it), and a refused call (an error naming the call and the code). The runtime is a
recording fake here (its refusals cannot be produced on cue); tests/gpu/test_cuda_events_cuda.py
runs the real one."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest

from atom.tier.worker_side.cuda_events import EventError, StreamEvents


class Calls:
    """Records what reached the runtime; ``codes`` maps a call to the code it answers."""

    def __init__(self, **codes):
        self.codes = codes
        self.seen: list[tuple] = []
        self.cleared = 0
        self._next = 0x1000

        def call(name, fn=None):
            def run(*args):
                self.seen.append((name, *[_value(a) for a in args]))
                if fn is not None:
                    fn(*args)
                return self.codes.get(name, 0)

            return run

        self.create = call("create", self._create)
        self.record = call("record")
        self.wait = call("wait")
        self.query = call("query")
        self.elapsed = call("elapsed", self._elapsed)
        self.destroy = call("destroy")

    def _create(self, out):
        self._next += 0x10
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = self._next

    @staticmethod
    def _elapsed(out, start, end):
        ctypes.cast(out, ctypes.POINTER(ctypes.c_float))[0] = 2.5

    def last_error(self):
        self.cleared += 1
        return 0


def _value(arg):
    return None if type(arg).__name__ == "CArgObject" else arg


def _events(calls) -> StreamEvents:
    return StreamEvents("cpu", calls)


STREAM = SimpleNamespace(cuda_stream=77)
OTHER = SimpleNamespace(cuda_stream=88)


def test_events_are_created_then_recorded_and_waited_on_by_handle(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device", lambda d: _Null())
    calls = Calls()
    ev = _events(calls)
    a, b = ev.new(), ev.new()
    assert a != b and ev.raw
    ev.record(a, STREAM)
    ev.wait(OTHER, a)
    assert calls.seen[2:] == [("record", a, 77), ("wait", 88, a, 0)]


def test_a_query_not_yet_fired_is_false_and_its_code_is_cleared():
    calls = Calls(query=600)
    ev = _events(calls)
    assert ev.query(0x10) is False and calls.cleared == 1
    calls.codes["query"] = 0
    assert ev.query(0x10) is True and calls.cleared == 1


def test_elapsed_time_is_the_runtimes_milliseconds():
    assert _events(Calls()).elapsed_ms(1, 2) == 2.5


@pytest.mark.parametrize(
    "call, do",
    [
        ("record", lambda ev: ev.record(5, STREAM)),
        ("wait", lambda ev: ev.wait(STREAM, 5)),
        ("query", lambda ev: ev.query(5)),
        ("elapsed", lambda ev: ev.elapsed_ms(5, 6)),
    ],
)
def test_a_refused_call_raises_naming_the_call_and_code(call, do):
    calls = Calls(**{call: 700})
    with pytest.raises(EventError, match=r"cudaEvent|cudaStream") as err:
        do(_events(calls))
    assert "CUDA error 700" in str(err.value) and calls.cleared == 1


def test_without_a_runtime_torch_events_are_used():
    ev = StreamEvents("cpu", None)
    assert not ev.raw
    recorded = []
    fake = SimpleNamespace(record=recorded.append, query=lambda: True)
    ev.record(fake, STREAM)
    assert recorded == [STREAM] and ev.query(fake) is True


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
