"""Test doubles for the tier: a byte-exact fake server, fake transfer and lookup threads, and a
real engine (v41-tiny, block 16, fp32, CPU) whose tier is an ``OffloadConnector`` wired to them.

The fakes have the interfaces ``OffloadConnector`` uses of ``TransferThread`` and ``LookupThread``
and move nothing on their own (unless ``auto`` is set): a test decides when and how each lookup
and transfer ends, so failure paths happen on cue. Outcomes reach the connector the way the
real threads deliver them: ``connector.post(op)``, folded in at the next ``update``. Deadlines
run on a ``FakeClock`` passed to the connector.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from atom.builder import build_engine
from atom.config import EngineConfig
from atom.engine.checkpoints import Checkpoint
from atom.engine.engine import LLMEngine, StepResult
from atom.engine.sequence import Sequence
from atom.model_api import pool_bytes
from atom.sampling_params import SamplingParams
from atom.tier.config import OffloadConfig
from atom.tier.operations import LookupOp, OpState, TransferOp
from atom.tier.scheduler_side.planner import OffloadConnector
from atom.tier.worker_side.events import EventPool
from atom.tier.worker_side.layout import SpecShape
from atom.tier.worker_side.transfer_thread import TransferThread

from .conftest import BLOCK
from .conftest import ENGINE_KW as CONFTEST_ENGINE_KW

ENGINE_KW = {**CONFTEST_ENGINE_KW, "num_blocks": 64}


class FakeClock:
    """Monotonic seconds that move only when a test says so."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class FakeServer:
    """What an LMCache server would hold, byte-exact: the PAGE bytes of every stored block
    (keyed by the tokens up to the block's end) and the image bytes at each store's end (keyed
    by the tokens up to it). Lookups answer the longest chunk-grid prefix whose pages are all
    stored and whose last chunk holds an image, as the real server does."""

    def __init__(self, block_size: int = BLOCK, chunk_size: int = BLOCK):
        self.bs, self.chunk = block_size, chunk_size
        self.pages: dict[tuple[int, ...], torch.Tensor] = {}
        self.images: dict[tuple[int, ...], torch.Tensor] = {}
        self.stores: list[TransferOp] = []  # saves that reached the server, in order
        self.read: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # op_id -> (pages, units)

    def store(self, op: TransferOp, pool: torch.Tensor) -> None:
        raw = pool_bytes(pool)
        self.read[op.op_id] = (raw[op.page_blocks].clone(), raw[op.units].clone())
        for i, b in enumerate(op.page_blocks):
            self.pages[tuple(op.token_ids[: op.start + (i + 1) * self.bs])] = raw[b].clone()
        self.images[tuple(op.token_ids[: op.end])] = raw[op.units].clone()
        self.stores.append(op)

    def retrieve(self, op: TransferOp, pool: torch.Tensor) -> bool:
        """Write the span's pages and the image at its end; False (nothing written) when the
        server lacks any of them."""
        keys = [
            tuple(op.token_ids[: op.start + (i + 1) * self.bs]) for i in range(len(op.page_blocks))
        ]
        image = self.images.get(tuple(op.token_ids[: op.end]))
        if image is None or any(k not in self.pages for k in keys):
            return False
        raw = pool_bytes(pool)
        for b, k in zip(op.page_blocks, keys):
            raw[b] = self.pages[k]
        raw[op.units] = image
        return True

    def hit(self, tokens: list[int]) -> int:
        best = 0
        for end in range(self.bs, len(tokens) + 1, self.bs):
            if tuple(tokens[:end]) not in self.pages:
                break
            if end % self.chunk == 0 and tuple(tokens[:end]) in self.images:
                best = end
        return best

    def forget(self) -> None:
        """The server lost everything (a restart)."""
        self.pages.clear()
        self.images.clear()


class FakeLookups:
    """The LookupThread interface. ``lookup`` records the op; a test answers it with
    ``answer(op, hit)`` (a hit, ``None`` asks the server), ``fail(op)`` (an RPC error: no
    answer), or never. With ``auto`` every lookup is answered from the server at once.

    A lock ledger follows the server's read locks per LMCache request id: a lookup answered
    with a hit takes one lock per chunk of [0, hit); frees, successful loads (which consume
    what they read) and the thread's own frees of late answers release them."""

    def __init__(self, server: FakeServer | None, chunk: int, auto: bool = False):
        self.server, self.chunk, self.auto = server, chunk, auto
        self.post = None  # connector.post, wired by FakeTier
        self.ops: list[LookupOp] = []
        self.free_calls: list[tuple[str, int, int]] = []  # as the connector called free_locks
        self.ended: list[str] = []
        self.stopped = False
        self.taken: dict[str, Counter] = {}
        self.released: dict[str, Counter] = {}

    # ---- the LookupThread interface ------------------------------------------------------

    def lookup(self, op: LookupOp) -> None:
        self.ops.append(op)
        if self.auto:
            self.answer(op)

    def free_locks(self, lmc_id: str, token_ids: list[int], start: int, end: int) -> None:
        self.free_calls.append((lmc_id, start, end))
        self._release(lmc_id, start, end)

    def end_session(self, lmc_id: str) -> None:
        self.ended.append(lmc_id)

    def flush(self) -> None:
        """The real thread's wake-up for queued frees (the ledger applies them at once)."""

    def stop(self, timeout_s: float) -> None:
        """As the real thread: lookups still pending end with no answer."""
        self.stopped = True
        for op in self.ops:
            if op.resolve(None, "engine shutting down"):
                self.post(op)

    # ---- the test's side -----------------------------------------------------------------

    def answer(self, op: LookupOp, hit: int | None = None) -> None:
        if hit is None:
            hit = self.server.hit(op.token_ids) if self.server is not None else 0
        late = op.state is OpState.LATE
        if not op.resolve(hit):
            return
        self._take(op.lmc_id, 0, hit)
        if late:  # the real thread frees what a late answer locked
            self._release(op.lmc_id, 0, hit)
        self.post(op)

    def fail(self, op: LookupOp, error: str = "lookup RPC failed") -> None:
        if op.resolve(None, error):
            self.post(op)

    def consume(self, lmc_id: str, start: int, end: int) -> None:
        """A load read [start, end): the server released those locks."""
        self._release(lmc_id, start, end)

    def frees_of(self, lmc_id: str) -> list[tuple[int, int]]:
        """Non-empty free_locks calls for one request (the real thread drops empty ones)."""
        return [(s, e) for i, s, e in self.free_calls if i == lmc_id and e > s]

    def lock_balance(self, lmc_id: str) -> dict[int, tuple[int, int]]:
        """chunk index -> (locks taken, locks released), for every chunk touched."""
        taken = self.taken.get(lmc_id, Counter())
        released = self.released.get(lmc_id, Counter())
        return {c: (taken[c], released[c]) for c in sorted(set(taken) | set(released))}

    def _chunks(self, start: int, end: int) -> range:
        return range(start // self.chunk, end // self.chunk)

    def _take(self, lmc_id: str, start: int, end: int) -> None:
        self.taken.setdefault(lmc_id, Counter()).update(self._chunks(start, end))

    def _release(self, lmc_id: str, start: int, end: int) -> None:
        self.released.setdefault(lmc_id, Counter()).update(self._chunks(start, end))


class FakeTransfers:
    """The TransferThread interface. ``submit`` records the op (it stays QUEUED: decided, not
    yet sent); a test ends it with ``complete(op, ok)`` (the server's answer; with a server
    attached, a save copies its bytes there and a load copies them back, failing if the server
    lacks them) or ``late(op)`` (the thread's deadline passed: LATE, fate unknown). Kinds in
    ``auto`` complete successfully as soon as they are submitted."""

    def __init__(self, server: FakeServer | None, auto: tuple[str, ...] = ()):
        self.server, self.auto = server, set(auto)
        self.healthy_flag = True
        self.epoch = 0  # TransferThread.epoch: bump to simulate a server that lost its data
        self.post = None  # connector.post, wired by FakeTier
        self.pool: torch.Tensor | None = None
        self.lookups: FakeLookups | None = None
        self.submitted: list[TransferOp] = []
        self.events: list[object] = []
        self.stop_calls: list[float] = []
        self.snapshots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # at submit
        self.on_submit = None  # optional hook(op), called before auto completion

    # ---- the TransferThread interface ------------------------------------------------------

    @property
    def health(self) -> FakeTransfers:
        """The record the connector reads (``healthy``, ``epoch``): this fake itself."""
        return self

    @property
    def healthy(self) -> bool:
        return self.healthy_flag

    def submit(self, op: TransferOp) -> None:
        assert op.event is not None, "the adapter refuses a None event"
        op.reached_server = True  # as the real thread, once the adapter took it (``refuse``)
        self.submitted.append(op)
        self.events.append(op.event)
        if op.kind == "save" and self.pool is not None:
            raw = pool_bytes(self.pool)
            self.snapshots[op.op_id] = (raw[op.page_blocks].clone(), raw[op.units].clone())
        if self.on_submit is not None:
            self.on_submit(op)
        if op.kind in self.auto:
            self.complete(op, True)

    def stop(self, drain_s: float) -> None:
        """As the real thread's close: what is left is given up on and reported failed."""
        self.stop_calls.append(drain_s)
        for op in self.pending:
            if op.resolve(False, "abandoned at shutdown"):
                self.post(op)

    # ---- the test's side -----------------------------------------------------------------

    @property
    def pending(self) -> list[TransferOp]:
        return [op for op in self.submitted if not op.terminal]

    @property
    def loads(self) -> list[TransferOp]:
        return [op for op in self.submitted if op.kind == "load"]

    @property
    def saves(self) -> list[TransferOp]:
        return [op for op in self.submitted if op.kind == "save"]

    def complete(self, op: TransferOp, ok: bool = True, error: str = "") -> None:
        if ok and self.server is not None:
            if op.kind == "save":
                self.server.store(op, self.pool)
            else:
                ok = self.server.retrieve(op, self.pool)
                error = error or ("" if ok else "keys not found")
        if op.kind == "load" and self.lookups is not None and not op.terminal:
            # lmcache 0.5.6: a retrieve releases the read locks it holds, failed or not
            self.lookups.consume(op.lmc_id, op.start, op.end)
        if op.resolve(ok, error or ("" if ok else "server returned False")):
            self.post(op)

    def refuse(self, op: TransferOp, error: str = "tier unavailable") -> None:
        """The thread could not hand it to the server (no adapter, submit refused)."""
        op.reached_server = False
        if op.resolve(False, error):
            self.post(op)

    def complete_all(self, ok: bool = True, kind: str | None = None) -> None:
        for op in self.pending:
            if kind is None or op.kind == kind:
                self.complete(op, ok)

    def late(self, op: TransferOp) -> None:
        if op.mark_late():
            self.post(op)


class FakeTier:
    """What ``attach_tier`` returns: the connector over the fakes, plus health and shutdown."""

    def __init__(
        self,
        engine: LLMEngine,
        config: OffloadConfig,
        server: FakeServer,
        clock: FakeClock,
        auto_lookups: bool,
        auto_transfers: tuple[str, ...],
    ):
        chunk = config.resolved_chunk(engine.config.block_size)
        self.config, self.server, self.clock = config, server, clock
        self.lookups = FakeLookups(server, chunk, auto=auto_lookups)
        self.transfers = FakeTransfers(server, auto=auto_transfers)
        self.events = EventPool(torch.device(engine.config.device))
        self.connector = OffloadConnector(
            config=config,
            spec=engine.spec,
            chunk_size=chunk,
            images=engine.store,
            pool_tensor=engine.runner.pool,
            events=self.events,
            transfers=self.transfers,
            lookups=self.lookups,
            metrics=engine.metrics,
            notify_progress=engine.notify_progress,
            clock=clock,
        )
        self.lookups.post = self.connector.post
        self.transfers.post = self.connector.post
        self.transfers.pool = engine.runner.pool
        self.transfers.lookups = self.lookups
        self.shutdowns = 0

    def health(self) -> dict:
        return {"attached": True, "healthy": self.transfers.healthy}

    def shutdown(self, timeout_s: float) -> list:
        self.shutdowns += 1
        return self.connector.shutdown(timeout_s)


@dataclass
class Harness:
    """A real engine with a fake tier, and the steps tests take with it."""

    engine: LLMEngine
    tier: FakeTier
    clock: FakeClock
    server: FakeServer
    finished: list[Sequence] = field(default_factory=list)
    closed: bool = False
    last: StepResult | None = None
    seen: dict = field(default_factory=dict)  # seq_id -> its TierRequest, kept after it ends

    @property
    def connector(self) -> OffloadConnector:
        return self.tier.connector

    @property
    def transfers(self) -> FakeTransfers:
        return self.tier.transfers

    @property
    def lookups(self) -> FakeLookups:
        return self.tier.lookups

    @property
    def pool(self):
        return self.engine.pool

    def add(self, prompt: list[int], max_tokens: int = 1) -> Sequence:
        return self.engine.add_request(
            list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        )

    def step(self) -> list[Sequence]:
        """One engine step, then the integrity check (leases included); ``last`` keeps the
        step's result."""
        self.last = self.engine.step()
        self.engine.check_integrity()
        self.seen.update(self.connector._requests)
        self.finished.extend(self.last.finished)
        return self.last.finished

    def run(self, seqs: list[Sequence], max_steps: int = 400, idle_limit: int = 3) -> None:
        """Step until every seq finished; fails if the engine idles ``idle_limit`` steps in a
        row (it waits on a lookup or transfer that the test has not ended)."""
        idle = 0
        for _ in range(max_steps):
            if all(s.is_finished for s in seqs):
                return
            self.step()
            idle = 0 if self.last.ran else idle + 1
            if idle >= idle_limit:
                raise AssertionError(f"engine idle, waiting on the tier: {seqs}")
        raise AssertionError(f"not finished after {max_steps} steps: {seqs}")

    def step_until(self, pred, max_steps: int = 400) -> None:
        for _ in range(max_steps):
            if pred():
                return
            self.step()
        raise AssertionError("condition not reached")

    def tier_state(self, seq: Sequence):
        """The request's TierRequest (also after the connector dropped it), or None."""
        st = self.connector.request_state(seq)
        if st is not None:
            self.seen[seq.seq_id] = st
        return self.seen.get(seq.seq_id)

    def free_blocks(self) -> set[int]:
        return {b for b in range(self.pool.num_blocks) if self.pool.is_free(b)}

    def reusable_blocks(self) -> set[int]:
        """Blocks an allocation may hand out: free or cached."""
        return {
            b for b in range(self.pool.num_blocks) if self.pool.is_free(b) or self.pool.is_cached(b)
        }

    def shutdown(self, check: bool = True) -> None:
        """Shut the engine (and its tier) down; by default assert nothing is left behind."""
        self.closed = True
        self.engine.shutdown(timeout_s=0.0)
        if check:
            assert_clean(self)


def assert_clean(h: Harness) -> None:
    """After shutdown: no leases, no open tier requests, no pinned images, integrity holds."""
    eng, conn = h.engine, h.connector
    eng.check_integrity()
    assert conn.leases() == {}, "transfer leases left behind"
    assert not conn._requests, "tier requests (sessions) left open"
    assert not conn.quarantined
    assert eng.store.counts()["pinned"] == 0 and not eng.store.limbo
    owned = sum(1 for b in range(eng.pool.num_blocks) if eng.pool.ref[b])
    assert owned == eng.store.counts()["units"], "blocks owned by something other than images"


def make_harness(
    *,
    server: FakeServer | None = None,
    clock: FakeClock | None = None,
    offload: dict | None = None,
    auto_lookups: bool = True,
    auto_transfers: tuple[str, ...] = (),
    **engine_kw,
) -> Harness:
    """A real LLMEngine on v41-tiny whose tier is a FakeTier (``engine.tier``).

    ``offload``: OffloadConfig fields; ``engine_kw``: EngineConfig fields over ``ENGINE_KW``.
    Engines given the same ``server`` share what it holds, like instances of one deployment.
    """
    cfg = EngineConfig.build(model="v41-tiny", **{**ENGINE_KW, **engine_kw}).resolved()
    offload_cfg = OffloadConfig(**(offload or {}))
    clock = clock or FakeClock()
    server = server or FakeServer(cfg.block_size, offload_cfg.resolved_chunk(cfg.block_size))

    def attach(engine: LLMEngine) -> FakeTier:
        return FakeTier(engine, offload_cfg, server, clock, auto_lookups, auto_transfers)

    engine = build_engine(cfg, attach_tier=attach)
    return Harness(engine, engine.tier, clock, server)


def prompt_of(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def cursor_of_image(engine: LLMEngine, units: list[int]) -> list[int]:
    """The cursor field ([position, last 3 token ids]) stored in an image's bytes."""
    geom = engine.runtime.geometry
    f = geom.field("cursor")
    flat = pool_bytes(engine.runner.pool)[units].reshape(-1)[: engine.spec.state_bytes]
    return flat[f.offset : f.offset + f.nbytes].clone().view(torch.int64).tolist()


def image_bytes(engine: LLMEngine, units: list[int]) -> torch.Tensor:
    return pool_bytes(engine.runner.pool)[units].reshape(-1)[: engine.spec.state_bytes].clone()


# ---- doubles for the threads' own tests (the LMCache adapters they own) ------------------------


class FakeFuture:
    """A store/retrieve future: ``query()`` never blocks; records which threads queried it."""

    def __init__(self, done: bool = False, ok: bool = True, raises: Exception | None = None):
        self.done, self.ok, self.raises = done, ok, raises
        self.query_threads: list[threading.Thread] = []
        self.queried = threading.Event()

    def query(self) -> bool:
        self.query_threads.append(threading.current_thread())
        self.queried.set()
        if self.raises is not None:
            raise self.raises
        return self.done

    def result(self) -> bool:
        return self.ok


class FakeWorkerAdapter:
    """AtomMPWorkerAdapter as the transfer thread uses it."""

    def __init__(self, healthy: bool = True):
        self.is_healthy = healthy
        self.futures: list[FakeFuture] = []
        self.submitted = threading.Event()
        self.shutdowns = 0

    def _submit(self, lmc_id, spec, event) -> FakeFuture:
        fut = FakeFuture()
        self.futures.append(fut)
        self.submitted.set()
        return fut

    submit_store_request = _submit
    submit_retrieve_request = _submit

    def shutdown(self) -> None:
        self.shutdowns += 1


class FakeSchedulerAdapter:
    """AtomMPSchedulerAdapter as the lookup thread uses it: every lookup hits ``hit`` tokens."""

    def __init__(self, hit: int):
        self.hit = hit
        self.submitted: list[str] = []
        self.frees: list[tuple[str, int, int]] = []
        self.ended: list[str] = []
        self.sent: list[list[int]] = []  # the tokens of each lookup and free, as sent

    def maybe_submit_lookup_request(self, lmc_id, token_ids) -> None:
        self.submitted.append(lmc_id)
        self.sent.append(list(token_ids))

    def check_lookup_result(self, lmc_id) -> int | None:
        return self.hit if lmc_id in self.submitted else None

    def cleanup_lookup_result(self, lmc_id) -> None:
        pass

    def free_lookup_locks(self, token_ids, start, end, lmc_id) -> None:
        self.frees.append((lmc_id, start, end))
        self.sent.append(list(token_ids))

    def end_session(self, lmc_id) -> None:
        self.ended.append(lmc_id)

    def shutdown(self) -> None:
        pass


class RecordingCondition(threading.Condition):
    """A Condition that records every wait's timeout and flags an untimed (blocking) wait."""

    def __init__(self):
        super().__init__()
        self.waits: list[float | None] = []
        self.blocked = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        if timeout is None:
            self.blocked.set()
        return super().wait(timeout)


class StuckThread:
    """Stands in for a transfer thread that does not stop when asked."""

    def __init__(self):
        self.joins: list[float | None] = []

    def join(self, timeout: float | None = None) -> None:
        self.joins.append(timeout)

    def is_alive(self) -> bool:
        return True


def make_transfer_thread(on_outcome, **kw) -> TransferThread:
    """A TransferThread that is not started and owns no adapter yet (set ``_adapter``)."""
    pool = torch.zeros(8, BLOCK, 4, dtype=torch.int32)
    return TransferThread(
        url="tcp://127.0.0.1:1",
        namespace="atom-test#0",
        world_size=1,
        pool=pool,
        shape=SpecShape(BLOCK, BLOCK, 2),
        config=OffloadConfig(),
        zmq_context=None,
        on_outcome=on_outcome,
        **kw,
    )


def unstarted_lookup_thread(connector, hit: int = 0, config=None):
    """The real LookupThread (not started: its logic is run by the test on cue) over a
    ``FakeSchedulerAdapter`` answering ``hit``, reporting to ``connector``."""
    from atom.tier.worker_side.lookup_thread import LookupThread

    config = config or OffloadConfig()
    thread = LookupThread(
        url="tcp://127.0.0.1:1",
        namespace="atom-test#0",
        world_size=1,
        block_size=BLOCK,
        config=config,
        zmq_context=None,
        on_outcome=connector.post,
    )
    thread._adapter = FakeSchedulerAdapter(hit=hit)
    return thread


@dataclass
class WiredTransferThread:
    """A TransferThread (not started) whose adapter is ``adapter``, whose condition records
    its waits, and whose outcomes land in ``outcomes`` as (op, state), ``got`` set on each."""

    tt: TransferThread
    adapter: FakeWorkerAdapter
    cond: RecordingCondition
    outcomes: list = field(default_factory=list)
    got: threading.Event = field(default_factory=threading.Event)

    def submit_queried(self, wait_s: float):
        """Submit a one-chunk op (its source written: a set event) and wait until the thread
        submitted it and queried its future once; (op, future)."""
        from atom.tier.worker_side.events import CpuEvent

        op = transfer_op()
        op.event = CpuEvent()
        self.tt.submit(op)
        assert self.adapter.submitted.wait(wait_s)
        fut = self.adapter.futures[0]
        assert fut.queried.wait(wait_s)
        return op, fut


def wired_transfer_thread(monkeypatch, **kw) -> WiredTransferThread:
    """``make_transfer_thread`` with a ``FakeWorkerAdapter`` to connect to and the spec builder
    faked (``kw`` as there)."""
    from atom.tier.worker_side import transfer_thread

    monkeypatch.setattr(transfer_thread, "build_spec", lambda op, shape: ("spec", op.op_id))
    outcomes, got = [], threading.Event()

    def on_outcome(op):
        outcomes.append((op, op.state))
        got.set()

    adapter = FakeWorkerAdapter()
    tt = make_transfer_thread(on_outcome, **kw)
    tt._cond = cond = RecordingCondition()
    tt.link.connect = lambda: adapter
    return WiredTransferThread(tt, adapter, cond, outcomes, got)


def transfer_op(kind: str = "save", deadline: float | None = None) -> TransferOp:
    """A one-chunk op on blocks [0] with an image in units [1, 2]; deadline in monotonic s."""
    image = Checkpoint(key=1, position=BLOCK, units=[1, 2], prefix=(1,))
    if deadline is None:
        deadline = time.monotonic() + 60
    return TransferOp(kind, "req-t", list(range(BLOCK)), 0, BLOCK, [0], image, deadline)
