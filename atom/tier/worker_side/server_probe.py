"""Whether the LMCache server serves one of the engine's direct paths: a verdict found out by a
probe that nothing waits for, asked again whenever it may have changed.

Used by ``locator.Locator`` (engine-driven loads: ``atom.locate``) and ``local_save.EngineSaves``
(engine-driven saves: ``atom.reserve``), each of which says how to ask (``ask``). The probe
runs on a thread of its own with its own zmq context and client, so no lookup or save waits
for it and closing the tier never waits on its context: until the verdict is ``supported``
the path is the lmcache-driven one.

The verdict (``state``):

  probing      none yet: the first probe (or the first after a server change) is out
  supported    the server answered the probe with what the path needs
  unknown      the probe learnt nothing definite: its call went unanswered (lmcache 0.5.6
               never answers a method no module serves, but a server just restarted may only
               be slow: in CI one answered a noop but not ``atom.reserve`` within 3 s), the
               server could not be reached, or the call failed. Asked again by the next
               ``ready`` after a backoff that doubles from ``RETRY_FIRST_S`` to
               ``RETRY_MAX_S`` (``clock``: when a retry is due).
  unsupported  a definite no: the server said it has no such method, its L1 is not in shared
               memory, it speaks another version, or its segment or objects are not this
               engine's to use (from the probe's answer, or from a later call: ``refuse``).

``server_changed`` (the server restarted, the tier registered again) drops any verdict, a
definite one too (the new server may be another build), and probes again at once. ``doubt`` (a
call went unanswered while the server answers a noop) turns ``supported`` into ``unknown`` and
probes again. A probe's verdict counts only if no server change came while it ran.

Every method may be called from any thread. ``state`` is a plain attribute: reading it calls
nothing (the lookup path reads it on every lookup).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from atom.tier.worker_side.backoff import ConnectBackoff

log = logging.getLogger("atom.offload")

PROBING, SUPPORTED, UNKNOWN, UNSUPPORTED = "probing", "supported", "unknown", "unsupported"
RETRY_FIRST_S, RETRY_MAX_S = 1.0, 60.0
MODULE_HINT = (
    'start it with --server-module \'{"module_path": "atom.tier.server.l1_module"}\' and '
    "--shm-name"
)


class Unsupported(Exception):
    """Raised by a probe's ``ask``: the server's definite no (the message says why)."""


class Unanswered(Exception):
    """Raised by a probe's ``ask``: its call was not answered in time."""


Wait = Callable[[object], bool]  # wait(future): answered before the probe's deadline


class ServerProbe:
    """The verdict on one path of one server (see the module's docstring).

    ``ask(client, wait)`` sends the probe's call on ``client`` and returns the server's answer
    (kept as ``answer`` while supported); it calls ``wait(future)`` for the reply, which is
    False when the reply did not come within ``wait_s`` (then ``ask`` raises ``Unanswered``),
    and raises ``Unsupported`` for a definite no. ``path`` says what goes through the server
    meanwhile ("hits load", "saves go"), for ``mode``."""

    def __init__(
        self,
        *,
        url: str,
        method: str,
        path: str,
        ask: Callable[[object, Wait], dict],
        wait_s: float,
        clock=time.monotonic,
    ):
        self.url, self.method, self.path = url, method, path
        self.wait_s = wait_s
        self._ask = ask
        self.state = PROBING
        self.why = ""
        self.answer: dict = {}
        self.generation = 0  # server changes seen
        self.probes = 0  # probes sent
        self._backoff = ConnectBackoff(RETRY_FIRST_S, clock, max_interval_s=RETRY_MAX_S)
        self._lock = threading.Lock()
        self._verdict = threading.Condition(self._lock)
        self._started = False  # retries only once ``start`` was called
        self._current: threading.Thread | None = None  # probing the current server
        self._threads: list[threading.Thread] = []
        self._closing = threading.Event()

    # ---- asking --------------------------------------------------------------------------

    def start(self) -> None:
        """Probe now (on a thread of its own); returns at once."""
        with self._lock:
            self._started = True
            self._launch()

    def ready(self) -> bool:
        """True when the path may be used now. Otherwise sends a probe again if the verdict is
        not definite and its retry is due."""
        state = self.state
        if state == SUPPORTED:
            return True
        if state != UNSUPPORTED:
            with self._lock:
                if self.state in (PROBING, UNKNOWN) and self._backoff.ready():
                    self._launch()
        return False

    def _launch(self) -> None:
        """Start a probe of the current server unless one is out (under the lock)."""
        if not self._started or self._closing.is_set():
            return
        if self._current is not None and self._current.is_alive():
            return
        self._threads = [t for t in self._threads if t.is_alive()]
        self.probes += 1
        name = f"atom-probe-{self.method}"
        t = threading.Thread(target=self._run, args=(self.generation,), name=name, daemon=True)
        self._current = t
        self._threads.append(t)
        t.start()

    def _run(self, generation: int) -> None:
        import zmq
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        ctx = zmq.Context()
        ctx.linger = 0
        client = None
        try:
            client = RequestClientFactory.create(self.url, context=ctx)
            answer = self._ask(client, self._waiter(time.monotonic() + self.wait_s))
            verdict = (SUPPORTED, "", answer)
        except Unsupported as exc:
            verdict = (UNSUPPORTED, str(exc), {})
        except Unanswered:
            verdict = (UNKNOWN, self._unanswered(), {})
        except Exception as exc:
            verdict = (UNKNOWN, f"the probe failed: {exc!r}", {})
        finally:
            if client is not None:
                client.close()
            ctx.destroy(linger=0)
        self._settle(generation, *verdict)

    def _waiter(self, deadline: float) -> Wait:
        def wait(fut) -> bool:
            """Wait in slices, so that ``close`` ends a probe's wait at once."""
            while not fut.wait(min(max(deadline - time.monotonic(), 0.001), 0.1)):
                if time.monotonic() >= deadline or self._closing.is_set():
                    return False
            return True

        return wait

    def _unanswered(self) -> str:
        from atom.tier.server.lmcache_server import probe

        if not probe(self.url, 0.5):
            return f"the server did not answer (down or restarting) when asked for {self.method}"
        return (
            f"the server answers a noop but not {self.method} within {self.wait_s:g} s (slow, "
            f"or without atom's module, which lmcache never says: {MODULE_HINT})"
        )

    def _settle(self, generation: int, state: str, why: str, answer: dict) -> None:
        with self._lock:
            if generation != self.generation or self._closing.is_set():
                return  # a server change came meanwhile: its own probe decides
            if self.state == UNSUPPORTED:
                return  # a call's definite no stands until the server changes
            before = self.state
            self.answer, self.why, self.state = answer, why, state  # state last: read unlocked
            if state == UNKNOWN:
                self._backoff.failed()
            else:
                self._backoff.reset()
            self._verdict.notify_all()
        if state == UNSUPPORTED:
            log.warning("engine-driven %s are off for %s: %s", self._noun, self.url, why)
        elif state == UNKNOWN and before != UNKNOWN:
            log.warning(
                "engine-driven %s wait for %s: %s; asking again with backoff",
                self._noun,
                self.url,
                why,
            )
        elif state == UNKNOWN:
            log.debug("probe of %s for %s: %s", self.url, self.method, why)
        elif before != PROBING:
            log.info("engine-driven %s are on again for %s", self._noun, self.url)

    @property
    def _noun(self) -> str:
        return self.path.split()[0]  # "hits load" -> hits, "saves go" -> saves

    # ---- what calls learn ----------------------------------------------------------------

    def refuse(self, why: str) -> None:
        """A definite no, learnt from a call: the path is off until the server changes."""
        with self._lock:
            if self.state == UNSUPPORTED:
                return
            self.why, self.state = why, UNSUPPORTED
            self._verdict.notify_all()
        log.warning("engine-driven %s are off for %s: %s", self._noun, self.url, why)

    def doubt(self, why: str) -> None:
        """A call went unanswered while the server answers: ``supported`` becomes ``unknown``
        and the server is asked again now."""
        with self._lock:
            if self.state != SUPPORTED:
                return
            self.why, self.state = why, UNKNOWN
            self._backoff.reset()
            self._launch()
        log.info("asking %s again whether it serves %s: %s", self.url, self.method, why)

    def server_changed(self, why: str) -> None:
        """The server may be another one now (a restart, a re-registration): forget the
        verdict, definite or not, and ask again now."""
        with self._lock:
            self.generation += 1
            self.state, self.why, self.answer = PROBING, why, {}
            self._backoff.reset()
            self._current = None
            self._launch()
        log.info("asking %s again whether it serves %s: %s", self.url, self.method, why)

    # ---- reading -------------------------------------------------------------------------

    def mode(self) -> str:
        """What /health says: 'engine_driven', 'probing (...)', 'lmcache_driven (unknown:
        why; ...)' or 'lmcache_driven (unsupported: why)'. Sends a probe that is due."""
        self.ready()
        state, why = self.state, self.why
        if state == SUPPORTED:
            return "engine_driven"
        if state == UNSUPPORTED:
            return f"lmcache_driven (unsupported: {why})"
        if state == PROBING:
            since = f"; {why}" if why else ""
            return f"probing ({self.path} through the server until the server answers{since})"
        out = self._current is not None and self._current.is_alive()
        left = self._backoff.wait_s()
        when = "asking now" if out else f"asking again in {left:.0f} s"
        return f"lmcache_driven (unknown: {why}; {when})"

    def wait(self, timeout_s: float, definite: bool = True) -> bool:
        """Wait up to ``timeout_s`` for a verdict (``definite``: supported or unsupported,
        asking again as the backoff allows; else any, unknown included, with no probe out);
        True if there is one. For tools and tests (the engine never waits)."""
        deadline = time.monotonic() + timeout_s
        while not self._settled(definite):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.ready()
            with self._lock:
                if not self._settled(definite):
                    self._verdict.wait(min(left, 0.1))  # slices: a probe ends after its verdict
        return True

    def _settled(self, definite: bool) -> bool:
        if self.state in (SUPPORTED, UNSUPPORTED):
            return True
        if definite or self.state != UNKNOWN:
            return False
        return self._current is None or not self._current.is_alive()

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for every probe out to end (``close``; tests)."""
        with self._lock:
            threads = list(self._threads)
        deadline = time.monotonic() + timeout_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop asking; wait (up to ``timeout_s``) for probes out: their waits are sliced."""
        self._closing.set()
        with self._lock:
            self._verdict.notify_all()
        self.join(timeout_s)
