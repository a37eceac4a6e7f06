"""The lookup thread: owns lmcache's AtomMPSchedulerAdapter (which has no lock and whose calls
block on the server) so the step thread never waits on a lookup.

A hit is located before it is answered when a ``Locator`` is given (engine-driven loads): the
answer then carries where its objects sit in the server's L1, so the load is a local copy.
The locator's capability probe runs on a thread of its own: the first lookup is sent at once.

A lookup costs one round-trip when the probe found ``atom.lookup_locate`` on the server
(``locator.py``: LMCache's lookup and the locate in one call, sent without waiting for the
answer); otherwise LMCache's own calls (its lookup, acknowledged, then a status query per
poll) and, for a hit, one ``atom.locate`` call. ``calls`` counts the lookup path's round-trips
by kind ("lookup", "query", "locate"; "lookup_locate", "lookup_poll"). A combined call the
server declines is sent again as LMCache's lookup, and the combined call is not used again; one
unanswered within ``rpc_timeout_s`` is a miss, its locks freed by id (and if the server answers
otherwise, the combined call is not used again either).

Commands run in the order given: lookups, frees of lookup read locks, session ends (the last
two are fire-and-forget on the server's normal pool, which is FIFO with one worker, so a free
sent before an end_session is applied before it). Pending lookups are polled on a timer only
while some are pending. A lookup answered after the step thread gave up on it (LATE) has its
read locks freed here at once, so nothing stays pinned on the server.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

from atom.tier.config import OffloadConfig
from atom.tier.operations import LookupOp, OpState
from atom.tier.worker_side.backoff import ConnectBackoff
from atom.tier.worker_side.locator import Call

log = logging.getLogger("atom.offload")


def scheduler_adapter_class(readers: int):
    """lmcache's scheduler adapter, whose keys declare ``readers`` readers per object, with
    ``module_call``: a server-module call on the adapter's own connection.

    The stock adapter declares one (each rank reads its own object). When every rank loads
    the one copy rank 0 stored (rank collapse), each rank's retrieve releases one read lock,
    so the lookup must take one per rank: fewer would unpin an object while a rank still
    copies it. A module call shares the connection of the adapter's frees and session ends,
    so the server applies them in the order they were sent.
    """
    from lmcache.integration.atom import AtomMPSchedulerAdapter

    class SchedulerAdapter(AtomMPSchedulerAdapter):
        def _create_key(self, *args, **kwargs):
            key = super()._create_key(*args, **kwargs)
            return key if readers == 1 else dataclasses.replace(key, num_kv_readers=readers)

        def module_call(self, method: str, payload: bytes):
            """Send one server-module call; its future (a ``ServerModuleCallResponse``)."""
            from lmcache.v1.multiprocess.protocols.server_module import (
                ServerModuleCallRequest,
            )

            return self._client.server_module_call(ServerModuleCallRequest(method, payload))

    return SchedulerAdapter


class LookupThread:
    def __init__(
        self,
        *,
        url: str,
        namespace: str,
        world_size: int,
        block_size: int,
        config: OffloadConfig,
        zmq_context,
        on_outcome: Callable[[LookupOp], None],
        poll_interval_s: float = 0.0005,
        locator=None,
        readers: int = 1,
    ):
        self.url, self.namespace, self.world_size = url, namespace, world_size
        self.readers = readers  # read locks a lookup takes per object: one per loading rank
        self.block_size, self.cfg, self.ctx = block_size, config, zmq_context
        self.on_outcome, self.poll_interval_s = on_outcome, poll_interval_s
        self.locator = locator  # locator.Locator, or None (lmcache_driven loads)
        self._cond = threading.Condition()
        self._commands: deque[tuple[str, tuple]] = deque()
        self._pending: list[LookupOp] = []
        self._adapter = None
        self._backoff = ConnectBackoff(config.heartbeat_s)
        self._stop = False
        self._ends_after_answer: set[str] = set()  # session ends waiting for a lookup
        self._calls: dict[int, Call] = {}  # id(op) -> its combined call in flight
        self._queried: set[int] = set()  # id(op) of LMCache lookups that poll the server
        self.calls: Counter = Counter()  # the lookup path's round-trips, by kind
        self.sessions_ended = 0
        self.locks_freed = 0
        self.thread = threading.Thread(target=self._run, name="atom-lmcache-lookup", daemon=True)

    # ---- step thread ------------------------------------------------------------------------

    def start(self) -> None:
        if self.locator is not None:  # beside the lookups, never before them
            self.locator.start_probe(self.cfg.rpc_timeout_s)
        self.thread.start()

    def lookup(self, op: LookupOp) -> None:
        """Queue a lookup without waking the thread, as a free: a thread woken while the step
        thread plans the step can take the interpreter lock from it to build the lookup's
        keys. The connector flushes while the step's forward runs, or at once in a step
        without one: the lookup is sent within the step that asked it."""
        self._put("lookup", (op,), wake=False)

    def free_locks(self, lmc_id: str, token_ids: list[int], start: int, end: int) -> None:
        """Queue a free without waking the thread (waking it hands the GIL over mid-step):
        ``flush`` or the next command sends it, in order. ``token_ids`` may be a request's
        live list, longer than ``end``: its first ``end`` never change, and this thread reads
        only those (the copy is made here, off the step thread)."""
        if end > start:
            self._put("free", (lmc_id, token_ids, start, end), wake=False)

    def flush(self) -> None:
        """Wake the thread if commands wait (the connector calls it once per step)."""
        with self._cond:
            if self._commands:
                self._cond.notify()

    def end_session(self, lmc_id: str) -> None:
        self._put("end", (lmc_id,))

    @property
    def server_calls(self) -> int:
        """Round-trips to the server on the lookup path so far (frees and ends excluded)."""
        return sum(self.calls.values())

    def stop(self, timeout_s: float) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self.thread.join(timeout_s + self.cfg.rpc_timeout_s * 2 + 5)

    def _put(self, kind: str, args: tuple, wake: bool = True) -> None:
        with self._cond:
            self._commands.append((kind, args))
            if wake:
                self._cond.notify()

    # ---- lookup thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._commands and not self._pending and not self._stop:
                        self._cond.wait()
                    if self._pending and not self._commands and not self._stop:
                        self._cond.wait(self.poll_interval_s)
                    commands, self._commands = list(self._commands), deque()
                    stop = self._stop
                for kind, args in commands:
                    try:
                        self._run_command(kind, args)
                    except Exception:
                        log.exception("lookup-thread command %s failed", kind)
                self._poll()
                if stop:
                    break
        finally:
            for op in self._pending:
                if op.resolve(None, "engine shutting down"):
                    self.on_outcome(op)
            if self._adapter is not None:
                try:
                    self._adapter.shutdown()
                except Exception:
                    log.warning("LMCache scheduler adapter shutdown failed", exc_info=True)
            if self.locator is not None:
                self.locator.close()

    def _run_command(self, kind: str, args: tuple) -> None:
        if kind == "lookup":
            self._do_lookup(*args)
        elif kind == "free":
            self._do_free(*args)
        elif kind == "end":
            self._do_end(*args)
        else:
            raise ValueError(f"unknown lookup-thread command {kind!r}")

    def _get_adapter(self):
        if self._adapter is not None:
            return self._adapter
        if not self._backoff.ready():
            return None
        from lmcache.integration.atom import AtomMPParallelConfig

        try:
            self._adapter = scheduler_adapter_class(self.readers)(
                self.url,
                self.ctx,
                self.namespace,
                self.block_size,
                AtomMPParallelConfig(world_size=self.world_size, worker_id=0, tp_size=1),
                mq_timeout=self.cfg.rpc_timeout_s,
            )
        except Exception as exc:
            self._backoff.failed()
            log.debug("lookup adapter unavailable: %s", exc)
            return None
        return self._adapter

    def _do_lookup(self, op: LookupOp) -> None:
        if op.state is OpState.LATE:  # given up before it was sent: sending it would only lock
            self._finish(op, None, "given up before it was sent")
            return
        adapter = self._get_adapter()
        if adapter is None:
            self._finish(op, None, "tier unavailable")
            return
        if self.locator is not None and self.locator.combined:
            if op.length < adapter.lmcache_tokens_per_chunk:
                self._finish(op, 0)  # nothing to look up: the adapter answers 0 without a call
                return
            sent = self._send_combined(adapter, op, poll=False)
        else:
            sent = self._submit(adapter, op)
        if sent:
            op.mark_in_flight()
            self._pending.append(op)

    def _submit(self, adapter, op: LookupOp) -> bool:
        """LMCache's own lookup (acknowledged before it returns); False when it failed (the
        op is then resolved)."""
        try:
            adapter.maybe_submit_lookup_request(op.lmc_id, op.token_ids)
        except Exception as exc:
            # the server may still run it later and take locks: free them by id, after it
            self._free_by_id(op)
            self._finish(op, None, f"lookup not acknowledged: {exc!r}")
            return False
        if op.length >= getattr(adapter, "lmcache_tokens_per_chunk", 1):
            self.calls["lookup"] += 1  # (a shorter one the adapter answers itself)
            self._queried.add(id(op))
        return True

    def _send_combined(self, adapter, op: LookupOp, poll: bool) -> bool:
        """Send ``op``'s combined lookup (or a poll of it) without waiting; False when it
        could not be sent (the op is then resolved, its locks freed by id)."""
        try:
            self._calls[id(op)] = self.locator.send_lookup(
                adapter, op, poll, self.readers, self.cfg.rpc_timeout_s
            )
        except Exception as exc:
            self._fail_combined(op, f"lookup not sent: {exc!r}")
            return False
        self.calls["lookup_poll" if poll else "lookup_locate"] += 1
        return True

    def _fail_combined(self, op: LookupOp, error: str) -> None:
        """A combined call without an answer: a miss for the engine. The server may have run
        the lookup (or may still): its locks are freed by id, after it on the connection."""
        self._free_by_id(op)
        self._finish(op, None, error)

    def _free_by_id(self, op: LookupOp) -> None:
        """Free whatever ``op``'s lookup locked, sent now: before the op resolves, so before
        any session end (the one its resolution lets the step thread send, or one waiting in
        ``_ends_after_answer``). Ended first, the free would find no lookup to release and
        leave the locks to LMCache's read-lock TTL."""
        try:
            self._do_free(op.lmc_id, op.tokens, 0, op.length)
        except Exception:
            log.warning("freeing the locks of lookup %s failed", op.lmc_id, exc_info=True)

    def _do_free(self, lmc_id: str, token_ids: list[int], start: int, end: int) -> None:
        adapter = self._get_adapter()
        if adapter is not None:
            adapter.free_lookup_locks(token_ids[:end], start, end, lmc_id)
            self.locks_freed += 1

    def _do_end(self, lmc_id: str) -> None:
        if any(op.lmc_id == lmc_id for op in self._pending):
            # its lookup is still answering (a late one): ending the session now would drop
            # the answer and the read locks it takes with it; end it once that answer is in
            self._ends_after_answer.add(lmc_id)
            return
        adapter = self._get_adapter()
        if adapter is not None:
            adapter.cleanup_lookup_result(lmc_id)
            adapter.end_session(lmc_id)
            self.sessions_ended += 1

    def _poll(self) -> None:
        if not self._pending:
            return
        adapter = self._adapter
        still, answered, combined = [], [], []
        for op in self._pending:
            call = self._calls.pop(id(op), None)
            if call is not None:
                got = self._poll_combined(adapter, call)
                if got is None:
                    still.append(op)
                elif got is not False:
                    combined.append((op, got))
                continue
            if id(op) in self._queried:
                self.calls["query"] += 1
            try:
                hit = adapter.check_lookup_result(op.lmc_id)
            except Exception as exc:
                self._queried.discard(id(op))
                self._finish(op, None, f"lookup poll failed: {exc!r}")
                continue
            if hit is None:
                still.append(op)
                continue
            self._queried.discard(id(op))
            adapter.cleanup_lookup_result(op.lmc_id)
            answered.append((op, int(hit)))
        self._pending = still
        if answered:
            self._locate(answered)
        for op, hit in answered + combined:
            before = self._finish(op, hit)
            if before is OpState.LATE and hit:  # nobody will load it: release its locks
                self._do_free(op.lmc_id, op.tokens, 0, hit)
        if not self._ends_after_answer:
            return
        answering = {o.lmc_id for o in still}
        for lmc_id in self._ends_after_answer - answering:
            self._ends_after_answer.discard(lmc_id)
            self._do_end(lmc_id)

    def _poll_combined(self, adapter, call: Call):
        """Read ``call``'s answer: None while the op still waits (unanswered, or a poll sent),
        False when the op was resolved here, else the hit (``op.located`` set)."""
        op = call.op
        reply = self.locator.read_lookup(call)
        if reply is None:
            if time.monotonic() < call.give_up_at:
                self._calls[id(op)] = call
                return None
            self._fail_combined(op, "lookup not answered in time")
            self.locator.lookup_unanswered()
            return False
        if reply.kind == "pending":  # LMCache's prefetch runs (from L2): ask again
            return None if self._send_combined(adapter, op, poll=True) else False
        if reply.kind == "declined" and not call.poll:  # nothing looked up: LMCache's way
            if op.state is OpState.LATE:
                self._finish(op, None, "given up before it was sent")
                return False
            return None if self._submit(adapter, op) else False
        if reply.kind != "hit":
            self._fail_combined(op, reply.error or reply.kind)
            return False
        op.located = reply.located
        return reply.hit

    def _locate(self, answered: list[tuple[LookupOp, int]]) -> None:
        """Attach where each hit sits (one round of locate calls for all of them)."""
        want = [(op, hit) for op, hit in answered if hit and op.state is not OpState.LATE]
        if self.locator is None or not want:
            return
        left = min(op.deadline for op, _ in want) - time.monotonic()
        before = self.locator.locates
        found = self.locator.locate_many(
            [(op.lmc_id, op.token_ids, hit) for op, hit in want],
            min(self.cfg.rpc_timeout_s, max(left, 0.05)),
        )
        self.calls["locate"] += self.locator.locates - before
        for (op, _), located in zip(want, found):
            op.located = located

    def _finish(self, op: LookupOp, hit: int | None, error: str = "") -> OpState | None:
        before = op.resolve(hit, error)
        if before is not None:
            self.on_outcome(op)
        return before
