"""CUDA timing events and stream waits for the tier's copies, called straight into the runtime
with the interpreter lock held.

torch's ``Event.record`` and ``Stream.wait_event`` (``Event.wait``) let go of the interpreter
lock around their runtime call (torch/csrc/cuda/Event.cpp). A call that lets go of the lock
waits to get it back for as long as another thread that took it in between keeps it: beside a
thread running Python in 1 ms bursts, a foreign call of 80 us took 1060 us at the median
letting go and 89 us keeping the lock (benchmarks/gil_handoff.py, on a 2-core host;
``cuda_copy.locked_runtime``). The wait shows once a call lasts long enough for the waiting
thread to wake and take the lock: on an H100 torch's ``Event.record`` (about 2 us) showed
none. An engine-driven load's issue makes six event and stream-wait calls beside its copy call
on the step thread, while the tier's lookup thread and LMCache's client loop run Python; with
all of them keeping the lock, a serving load's issue fell from 0.40-0.44 ms to 0.08-0.15 ms at
the median on an H100 (docs/TIER.md). None of them waits for the device (``synchronize``, the
one that does, lets go).

``StreamEvents.of_device(device)`` gives the runtime's calls where the CUDA runtime torch
loaded is reachable, torch's events otherwise (``raw`` says which); both take and return the
same things: an event is an opaque handle to pass back.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from atom.tier.worker_side.cuda_copy import locked_runtime, runtime

_NOT_READY = 600  # cudaErrorNotReady: the event has not fired yet (not an error)


class _RawCalls:
    """The runtime's event calls with their argument types set."""

    def __init__(self, lib):
        vp, c_int = ctypes.c_void_p, ctypes.c_int
        self.create = lib.cudaEventCreate
        self.create.argtypes, self.create.restype = [ctypes.POINTER(vp)], c_int
        self.record = lib.cudaEventRecord
        self.record.argtypes, self.record.restype = [vp, vp], c_int
        self.wait = lib.cudaStreamWaitEvent
        self.wait.argtypes, self.wait.restype = [vp, vp, ctypes.c_uint], c_int
        self.query = lib.cudaEventQuery
        self.query.argtypes, self.query.restype = [vp], c_int
        self.elapsed = lib.cudaEventElapsedTime
        self.elapsed.argtypes = [ctypes.POINTER(ctypes.c_float), vp, vp]
        self.elapsed.restype = c_int
        self.destroy = lib.cudaEventDestroy
        self.destroy.argtypes, self.destroy.restype = [vp], c_int
        self.last_error = lib.cudaGetLastError
        self.last_error.restype = c_int


class EventError(RuntimeError):
    pass


class StreamEvents:
    """Timing events of one device. ``raw`` True: runtime calls that keep the interpreter lock
    (``calls`` from ``locked_runtime``); False: torch's events."""

    def __init__(self, device: torch.device, calls: _RawCalls | None):
        self.device = torch.device(device)
        self._rt = calls
        self.raw = calls is not None

    @classmethod
    def of_device(cls, device) -> StreamEvents:
        lib = locked_runtime()
        return cls(device, _RawCalls(lib) if lib is not None else None)

    def new(self):
        """A new timing event (on this device)."""
        if self._rt is None:
            return torch.cuda.Event(enable_timing=True)
        handle = ctypes.c_void_p(0)
        with torch.cuda.device(self.device):
            self._check(self._rt.create(ctypes.byref(handle)), "cudaEventCreate")
        return handle.value

    def record(self, event, stream: torch.cuda.Stream) -> None:
        """Record ``event`` on ``stream`` (it fires once the stream's earlier work is done)."""
        if self._rt is None:
            event.record(stream)
            return
        self._check(self._rt.record(event, stream.cuda_stream), "cudaEventRecord")

    def wait(self, stream: torch.cuda.Stream, event) -> None:
        """Make ``stream``'s later work wait for ``event`` (no host wait)."""
        if self._rt is None:
            stream.wait_event(event)
            return
        self._check(self._rt.wait(stream.cuda_stream, event, 0), "cudaStreamWaitEvent")

    def query(self, event) -> bool:
        """Whether ``event`` has fired (never waits)."""
        if self._rt is None:
            return event.query()
        rc = self._rt.query(event)
        if rc == _NOT_READY:
            self._rt.last_error()  # torch's next launch check must not see it
            return False
        self._check(rc, "cudaEventQuery")
        return True

    def elapsed_ms(self, start, end) -> float:
        """Milliseconds from ``start`` to ``end`` (both fired)."""
        if self._rt is None:
            return start.elapsed_time(end)
        out = ctypes.c_float(0.0)
        self._check(self._rt.elapsed(ctypes.byref(out), start, end), "cudaEventElapsedTime")
        return out.value

    def synchronize(self, event) -> None:
        """Wait on the host until ``event`` fired (this call lets go of the interpreter lock:
        it waits for the device)."""
        if self._rt is None:
            event.synchronize()
            return
        self._check(_unlocked_sync()(event), "cudaEventSynchronize")

    def destroy(self, event) -> None:
        if self._rt is not None and event:
            self._rt.destroy(event)

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            self._rt.last_error()
            raise EventError(f"{what} failed (CUDA error {rc})")


@functools.cache
def _unlocked_sync():
    """cudaEventSynchronize of the runtime opened so that the call lets go of the lock (there
    when ``locked_runtime`` is: the same library)."""
    fn = runtime().cudaEventSynchronize
    fn.argtypes, fn.restype = [ctypes.c_void_p], ctypes.c_int
    return fn
