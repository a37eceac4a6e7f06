"""When the tier's threads may try to connect to the LMCache server again."""

from __future__ import annotations

import time


class ConnectBackoff:
    """After a failed connect, the next attempt waits ``interval_s`` (at least 1 s); both the
    lookup thread and the transfer thread space their attempts with one of these."""

    def __init__(self, interval_s: float, clock=time.monotonic):
        self.interval_s, self.clock = max(1.0, interval_s), clock
        self._next = 0.0

    def ready(self) -> bool:
        return self.clock() >= self._next

    def failed(self) -> None:
        self._next = self.clock() + self.interval_s

    def reset(self) -> None:
        self._next = 0.0

    def wait_s(self) -> float:
        """Seconds until the next attempt (at least 50 ms, so a waiter does not spin)."""
        return max(0.05, self._next - self.clock())
