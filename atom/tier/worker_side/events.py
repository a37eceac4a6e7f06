"""Events that order the server's reads and writes after the engine's own work.

On CUDA an interprocess event is recorded on the step thread after the producing forward (a
save) or after the last compute that used the destination (a load); the server waits on it
before touching the blocks. Creating one costs about a millisecond and destroying an imported
one can synchronize the device, so events are pooled and only created, recorded and recycled
on the step thread. A recycled event is recorded by the runtime call that keeps the interpreter
lock (cuda_events.py; torch's ``record`` lets go of it, and getting it back from the tier's
other threads can cost far more than the call); a new one by torch, which creates it there. On
CPU, ordering is "the bytes are written before submit" and the event is a stand-in with the
same interface.
"""

from __future__ import annotations

import torch

from atom.tier.worker_side.cuda_events import StreamEvents


class CpuEvent:
    def ipc_handle(self) -> bytes:
        return b"atom-cpu-event"

    def wait(self, stream=None) -> None:
        return None

    def record(self) -> None:
        return None


class EventPool:
    """Step-thread only: ``acquire`` a recorded event, ``recycle`` it once its op is terminal."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self._free: list = []
        self.created = 0
        self._ev = StreamEvents.of_device(device) if self.cuda else None

    def acquire(self):
        if not self.cuda:
            return CpuEvent()
        ev = self._free.pop() if self._free else None
        if ev is None:
            ev = torch.cuda.Event(interprocess=True)
            self.created += 1
        # created (recorded before): its handle is there for the runtime call
        handle = ev.cuda_event if self._ev is not None and self._ev.raw else 0
        if handle:
            self._ev.record(handle, torch.cuda.current_stream())
        else:
            ev.record()
        return ev

    def recycle(self, ev) -> None:
        if self.cuda and ev is not None:
            self._free.append(ev)
