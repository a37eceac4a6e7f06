"""The engine on its own thread; the asyncio front end submits requests and reads streams.

The engine thread never waits on a client: each step's new tokens are handed to the event
loop with ``call_soon_threadsafe``. It drives the engine with ``LLMEngine.run_once``; when a
step cannot run, or the engine is idle, it blocks on one condition that new requests, aborts,
stop and the tier's progress all signal. A tier outcome that arrives while the engine is idle
(a tail save finishing, a quarantined load resolving) wakes it, so it is settled at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

from atom.engine.engine import LLMEngine, RequestError
from atom.engine.sequence import Sequence
from atom.sampling_params import SamplingParams

log = logging.getLogger("atom.serve")
T = TypeVar("T")


@dataclass
class Delta:
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    seq: Sequence | None = None
    error: str | None = None


@dataclass(eq=False)
class RequestStream:
    request_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    seq: Sequence | None = None
    sent: int = 0


class EngineLoop:
    def __init__(self, engine: LLMEngine, log_interval_s: float = 10.0):
        self.engine = engine
        self.log_interval_s = log_interval_s
        self._cond = threading.Condition()
        self._submits: list[tuple[RequestStream, list[int], SamplingParams, int | None]] = []
        self._aborts: list[tuple[str, str]] = []
        self._calls: list[tuple[Callable, Future]] = []
        self._streams: dict[str, RequestStream] = {}
        self._stop = False
        self._woken = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._last_log = time.monotonic()
        self._logged = {"gen": 0.0, "hbm": 0.0, "tier": 0.0, "computed": 0.0}

    # ---- asyncio side ---------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.engine.on_progress = self._wake
        self.thread = threading.Thread(target=self._run, name="atom-engine", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive() and self.error is None

    @property
    def in_flight(self) -> int:
        with self._cond:
            return len(self._streams) + len(self._submits)

    def submit(
        self, request_id: str, prompt: list[int], params: SamplingParams, eos: int | None
    ) -> RequestStream:
        stream = RequestStream(request_id)
        with self._cond:
            self._submits.append((stream, prompt, params, eos))
            self._cond.notify()
        return stream

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """End a request (``reason`` is its finish reason: "abort", or "stop" when the front
        end matched a stop string)."""
        with self._cond:
            self._aborts.append((request_id, reason))
            self._cond.notify()

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the engine thread between steps (only that thread touches the
        engine); its result or exception lands on the returned future."""
        fut: Future[T] = Future()
        with self._cond:
            self._calls.append((fn, fut))
            self._cond.notify()
        return fut

    def stop(self, timeout_s: float | None = None) -> bool:
        """Abort what is open and stop the engine thread; False if it did not stop within
        ``timeout_s`` (it is a daemon thread: the process can still exit)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self.thread is not None:
            self.thread.join(timeout_s)
            return not self.thread.is_alive()
        return True

    # ---- engine thread --------------------------------------------------------------------

    def _wake(self) -> None:
        with self._cond:
            self._woken = True
            self._cond.notify()

    def _take_woken(self) -> bool:
        with self._cond:
            woken, self._woken = self._woken, False
            return woken

    def _wait(self, timeout: float) -> None:
        """The engine could not run a step: block until something changes or ``timeout``."""
        with self._cond:
            if not (self._woken or self._submits or self._aborts or self._calls or self._stop):
                self._cond.wait(timeout)
            self._woken = False

    def _emit(self, stream: RequestStream, delta: Delta) -> None:
        self.loop.call_soon_threadsafe(stream.queue.put_nowait, delta)

    def _run(self) -> None:
        eng = self.engine
        try:
            while True:
                with self._cond:
                    while not (
                        self._submits
                        or self._aborts
                        or self._calls
                        or self._stop
                        or self._woken
                        or eng.has_unfinished()
                    ):
                        # idle: block until signalled, or until a tier deadline may need a sweep
                        if not self._cond.wait(eng.WAIT_S if eng.tier_busy() else None):
                            self._woken = True
                    submits, self._submits = self._submits, []
                    aborts, self._aborts = self._aborts, []
                    calls, self._calls = self._calls, []
                    stopping = self._stop
                for stream, prompt, params, eos in submits:
                    try:
                        stream.seq = eng.add_request(prompt, params, stream.request_id, eos)
                        self._streams[stream.request_id] = stream
                    except RequestError as exc:
                        self._emit(stream, Delta([], True, "error", error=str(exc)))
                for rid, reason in aborts:
                    stream = self._streams.pop(rid, None)
                    if stream is not None:
                        eng.abort(rid, reason)
                        self._emit(stream, Delta([], True, reason, seq=stream.seq))
                for fn, fut in calls:
                    if fut.set_running_or_notify_cancel():
                        try:
                            fut.set_result(fn())
                        except Exception as exc:
                            fut.set_exception(exc)
                if stopping:
                    for rid, stream in list(self._streams.items()):
                        eng.abort(rid)
                        self._emit(stream, Delta([], True, "abort", seq=stream.seq))
                    self._streams.clear()
                    return
                if eng.has_unfinished() or self._take_woken():
                    eng.run_once(self._wait)
                    self._deliver()
                self._maybe_log()
        except BaseException as exc:  # the engine is broken: fail every open request loudly
            self.error = exc
            log.exception("engine loop stopped")
            for stream in self._streams.values():
                self._emit(stream, Delta([], True, "error", error=f"engine failure: {exc}"))

    def _deliver(self) -> None:
        for rid, stream in list(self._streams.items()):
            seq = stream.seq
            out = seq.output
            if len(out) > stream.sent or seq.is_finished:
                new = out[stream.sent :]
                stream.sent = len(out)
                self._emit(stream, Delta(new, seq.is_finished, seq.finish_reason, seq=seq))
                if seq.is_finished:
                    del self._streams[rid]

    def _maybe_log(self) -> None:
        now = time.monotonic()
        dt = now - self._last_log
        if dt < self.log_interval_s:
            return
        counts = self.engine.engine_metrics
        cur = {
            "gen": counts.gen.total(),
            "hbm": counts.prompt.get(source="hbm"),
            "tier": counts.prompt.get(source="tier"),
            "computed": counts.prompt.get(source="computed"),
        }
        d = {k: cur[k] - self._logged[k] for k in cur}
        prompt = d["hbm"] + d["tier"] + d["computed"]
        if d["gen"] or prompt:
            s = self.engine.stats()
            log.info(
                "throughput: %.1f gen tok/s | prompt tokens %d: hbm %.0f%% tier %.0f%% "
                "computed %.0f%% | running %d waiting %d | images ready %d",
                d["gen"] / dt,
                prompt,
                100 * d["hbm"] / max(prompt, 1),
                100 * d["tier"] / max(prompt, 1),
                100 * d["computed"] / max(prompt, 1),
                s["running"],
                s["waiting"],
                s["images"]["ready"],
            )
        self._logged, self._last_log = cur, now
