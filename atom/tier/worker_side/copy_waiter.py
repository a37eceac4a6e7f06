"""Wakes the transfer thread as soon as an engine-driven save's copy completes.

The transfer thread polls its saves in rounds, one every ``poll_interval_s`` (0.5 ms) while
any is in flight, so it saw a copy complete up to a round after the fact: on an H100 a
one-chunk save (2.26 MiB, a 0.05 ms copy) held its blocks 0.5 ms, 0.42 ms of it from the copy's
issue to its completion being seen (benchmarks/results/transfer_saves_h100_ade40a7_r1.md).

A ``CopyWaiter`` is one thread that waits on each copy's CUDA event in turn (``synchronize``
lets go of the interpreter lock while it waits for the device) and then calls ``on_done``
(the transfer thread's ``copy_done``: run a round now). The saves' copies share one copy
stream, which completes them in the order they were issued, so waiting in queue order never
waits behind a later copy. The thread starts with the first event (none on CPU, where a save's
copy is complete when issued). What it does is only a wake-up: the round still finds each
completion by querying the save's event, so a late or lost wake-up costs a round's delay,
never a save.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("atom.offload")

_STOP = object()


class CopyWaiter:
    def __init__(self, on_done: Callable[[], None]):
        self.on_done = on_done
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.waited = 0  # events waited on
        self.errors = 0  # events whose wait raised (the round's query reports the save)

    def watch(self, event) -> None:
        """Wake the transfer thread once ``event`` (a copy's CUDA event) has fired."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="atom-lmcache-copy-waiter", daemon=True
                )
                self._thread.start()
        self._events.put(event)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop after the events queued so far (bounded by ``timeout_s``)."""
        with self._lock:
            thread = self._thread
        if thread is None:
            return
        self._events.put(_STOP)
        thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            event = self._events.get()
            if event is _STOP:
                return
            try:
                event.synchronize()
            except Exception:  # the round's query of the event says what failed
                self.errors += 1
                if self.errors == 1:
                    log.warning("waiting on a save's copy event failed", exc_info=True)
            self.waited += 1
            try:
                self.on_done()
            except Exception:
                log.exception("waking the transfer thread after a save's copy failed")
