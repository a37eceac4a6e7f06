"""Keeps an owned LMCache server running: restarts it when it dies.

A thread checks the server's process every ``poll_s`` (a poll round on an Event, so stopping
is immediate). When the process has exited and the tier is not shutting down, it logs why
(the exit code or signal and the log's last lines), waits its backoff (0.2 s after a server
that was up; after each failed start twice as long, from 1 s up to ``max_backoff_s``) and
starts the server again on the same
port, with a fresh L1 segment (``LMCacheServer.start``). The tier's threads reconnect and
re-register on their own, as they do for any server that comes back; the new server is empty,
so what the engine computes is stored again.

If the port is taken when it restarts, another server answers there, one atom did not start:
the supervisor disowns it (``LMCacheServer.disown``: atom will neither stop it nor unlink its
segment), logs that, and stops supervising. A first start that failed is retried the same way.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from atom.tier.server.lmcache_server import LMCacheServer, LMCacheServerError, probe

log = logging.getLogger("atom.offload")


def describe_exit(code: int | None) -> str:
    if code is None:
        return "never started"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class ServerSupervisor:
    FIRST_BACKOFF_S = 0.2

    def __init__(
        self,
        server: LMCacheServer,
        *,
        poll_s: float = 0.5,
        max_backoff_s: float = 30.0,
        start_timeout_s: float = 60.0,
        on_restart=None,
    ):
        self.server, self.poll_s = server, poll_s
        self.max_backoff_s, self.start_timeout_s = max_backoff_s, start_timeout_s
        self.on_restart = on_restart  # called after each successful restart
        self.restarts = 0  # successful restarts
        self.failures = 0  # restarts that failed
        self.last_exit = ""  # why the server last went down
        self._backoff = self.FIRST_BACKOFF_S
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="atom-lmcache-supervisor")
        self._thread.daemon = True

    def start(self) -> ServerSupervisor:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop supervising (before the server is stopped on purpose)."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    @property
    def supervising(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if not self.check():
                return

    def check(self) -> bool:
        """One round: restart the server if it is down. False once there is nothing left to
        supervise (the port belongs to a server atom did not start)."""
        s = self.server
        if not s.owned or s.running:
            return s.owned
        pid = s.pid
        self.last_exit = describe_exit(s.proc.returncode if s.proc is not None else None)
        log.error(
            "owned LMCache server %s at %s %s; restarting it in %.1f s. Its log ended:\n%s",
            f"pid {pid}" if pid else "(not running)",
            s.url,
            self.last_exit,
            self._backoff,
            s.log_tail(10),
        )
        if self._stop.wait(self._backoff):
            return False
        if probe(s.url, 0.5):  # something answers at our URL: a server atom did not start
            return self._disown()
        t0 = time.monotonic()
        try:
            s.start(wait=False)
            error = self._wait_healthy(t0)
        except LMCacheServerError as exc:
            error = str(exc)
        if self._stop.is_set():
            return False  # shutting down: the tier stops the server
        if error is not None:
            s.stop_process()  # a start that never became healthy
            if "already in use" in error:
                return self._disown()
            self.failures += 1
            self._backoff = min(self.max_backoff_s, max(1.0, 2 * self._backoff))
            log.error("restarting the LMCache server failed (%s)", error.splitlines()[0])
            return True
        self.restarts += 1
        self._backoff = self.FIRST_BACKOFF_S
        log.warning(
            "restarted the owned LMCache server at %s: pid %d, healthy after %.1f s (restart %d)",
            s.url,
            s.pid,
            time.monotonic() - t0,
            self.restarts,
        )
        if self.on_restart is not None:
            self.on_restart()
        return True

    def _wait_healthy(self, t0: float) -> str | None:
        """Poll the starting server until it answers (None), exits or runs out of time (the
        reason), or the supervisor is stopped (None: the caller sees the stop)."""
        s = self.server
        while not self._stop.wait(0.1):
            if not s.running:
                code = s.proc.returncode if s.proc is not None else None
                return f"the server {describe_exit(code)}:\n{s.log_tail()}"
            if probe(s.url, 0.5):
                return None
            if time.monotonic() - t0 > self.start_timeout_s:
                return f"not healthy after {self.start_timeout_s:.0f} s:\n{s.log_tail()}"
        return None

    def _disown(self) -> bool:
        self.server.disown()
        log.warning(
            "port %d is taken by an LMCache server atom did not start; atom will not "
            "supervise, stop or clean up after it",
            self.server.port,
        )
        return False
