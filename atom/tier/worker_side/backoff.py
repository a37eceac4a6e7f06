"""When the tier's threads may try the LMCache server again."""

from __future__ import annotations

import time


class ConnectBackoff:
    """After a failed attempt, the next waits ``interval_s`` (at least 1 s). With
    ``max_interval_s`` above that, each further failure in a row doubles the wait, up to
    ``max_interval_s``; ``reset`` (a success) starts again from ``interval_s``. The lookup and
    transfer threads space their connects with one of these (a fixed wait); the probes of the
    server's module (``server_probe.py``) space their retries (a doubling one)."""

    def __init__(
        self, interval_s: float, clock=time.monotonic, max_interval_s: float | None = None
    ):
        self.interval_s, self.clock = max(1.0, interval_s), clock
        self.max_interval_s = max(self.interval_s, max_interval_s or 0.0)
        self._wait = self.interval_s  # the wait after the next failure
        self._next = 0.0

    def ready(self) -> bool:
        return self.clock() >= self._next

    def failed(self) -> None:
        self._next = self.clock() + self._wait
        self._wait = min(2 * self._wait, self.max_interval_s)

    def reset(self) -> None:
        self._next = 0.0
        self._wait = self.interval_s

    def wait_s(self) -> float:
        """Seconds until the next attempt (at least 50 ms, so a waiter does not spin)."""
        return max(0.05, self._next - self.clock())
