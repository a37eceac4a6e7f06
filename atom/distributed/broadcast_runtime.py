"""Rank 0's model runtime in a tensor-parallel engine: every call is sent to the other ranks,
which make it on their own runtime, then made here.

The engine (scheduler, runner, sampler, tier) runs on rank 0 only and never knows there are
other ranks: it holds a ``BroadcastRuntime`` where it would hold a ``ModelRuntime``. Each rank
holds its own pool and state slots, with the same shapes; every rank makes the same calls in
the same order (the forward's all-reduces need it), so their pools and slots hold the same
bytes and the logits are the same on every rank. Rank 0's are the ones the engine samples.

An op is a tuple ``(name, *args)`` of host values (token ids and block tables on the host,
image units as lists), sent with one object broadcast on the control group. Ops:
``("bind", pool_shape, pool_dtype, slot_shape)``, ``("forward", ids, spans, all_logits)``,
``("store_image", slot, units)``, ``("restore_image", units, slot)``, ``("stop",)``, the
drafters' (below), ``("digest",)`` (``rank_digests``: every rank's pool and slot digest, for
checks), and the
tier's ``tier_attach`` / ``tier_op`` / ``tier_stop`` (a ``RankOps``, made on each rank by
``atom.tier.worker_side.rank_tier.RankTierOps``), which ride the same
broadcast so each rank sees them in order with the forwards.

Drafts: with ``speculative_tokens`` every rank's runtime is built with the same draft state
(its slots' geometry includes it, and checkpoint images carry it), and the draft layers (or
DSpark stages) are whole on every rank: they split nothing and reduce nothing. Rank 0 sends
``("draft_forward", ids, spans, layer, all_logits, residual shape, dtype, logit rows)`` and
``("fill_draft_windows", spans, residual shape, dtype)`` followed by the residual rows
themselves, broadcast on the forward's group (on the device), and ``("draft_blocks", tokens,
positions, slots)``; every rank makes the call on its own runtime, so the draft state too holds
the same bytes on every rank. A verify forward is ``forward_with_residual`` on every rank (it
updates the state as ``forward`` does, and runs the same graphs on every rank; only rank 0
reads its rows).

Graphs: ``enable_decode_graphs`` sends ``("enable_graphs", max_batch, max_len, eager)`` before
``bind``, and every rank replays graphs of its own, captured at the same forward on every rank,
with the forward's collectives inside (``eager``: the tests' ``EagerBackend`` on every rank).

Idle engines: a rank waits for the next op inside a collective of the control group, which
fails after that group's timeout. So while no op has been sent for ``keepalive_s`` (a quarter
of the timeout), a thread of rank 0 sends ``("ping",)``: an engine may sit idle for hours, and
a rank still notices within the timeout when rank 0 stops sending (it hangs) or dies (its
watchdog). Sends are serialized by one lock, so a ping never interleaves with an op.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Protocol

import torch

from atom.distributed.parallel_state import RankChannels, RankFailure
from atom.model_api import (
    RuntimeCapabilities,
    Span,
    block_draft_size,
    draft_layers,
    shifted_spans,
)

__all__ = ["BroadcastRuntime", "RankFailure", "RankOps", "run_forward", "serve_ops"]

log = logging.getLogger("atom.distributed")


class RankOps(Protocol):
    """Ops a rank other than 0 makes besides the model's (the tier's: ``atom.tier``).

    ``names``: the op names it takes; ``handle(name, args, runtime, device)`` makes one (it
    must not raise for a failure of its own: the rank lives on); ``pool``: the pool tensor it
    made before ``bind`` (None: the rank makes its own); ``close()``: idempotent, at exit.
    """

    names: frozenset[str]
    pool: torch.Tensor | None

    def handle(self, name: str, args: tuple, runtime, device) -> None: ...

    def close(self) -> None: ...


class BroadcastRuntime:
    """A ``ModelRuntime`` that broadcasts each call to the ranks of ``state`` first."""

    host_block_tables = True

    def __init__(
        self,
        runtime,
        state,
        processes=(),
        on_close=None,
        tier_conns=(),
        rank_replicated=False,
        keepalive_s: float | None = None,
    ):
        self.inner, self.state = runtime, state
        self.spec, self.vocab_size, self.device = runtime.spec, runtime.vocab_size, runtime.device
        caps = RuntimeCapabilities.of(runtime)
        self.reserved_blocks, self.reserved_slots = caps.reserved_blocks, caps.reserved_slots
        self.rewinds_on_rejection = caps.rewinds_on_rejection
        self.graph_stats = caps.graph_stats  # rank 0's graphs (every rank captures the same)
        # the drafters the rank runtimes have (0: none; the DraftRuntime methods then refuse)
        self.num_draft_layers = draft_layers(runtime)
        self.draft_block_size = block_draft_size(runtime)
        self._on_close = on_close
        self.closed = False
        self.processes = list(processes)  # the other ranks' processes
        self.tier_conns = list(tier_conns)  # read ends of the ranks' tier outcome pipes
        self.rank_replicated = rank_replicated  # tier bytes identical on every rank
        self._send_lock = threading.Lock()
        self._last_send = time.monotonic()
        self._stopping = threading.Event()
        self.pings = 0  # keepalive ops sent
        self._keepalive = None
        if keepalive_s is not None and state.world_size > 1:
            self._keepalive = threading.Thread(
                target=self._keep_alive, args=(keepalive_s,), daemon=True, name="tp-keepalive"
            )
            self._keepalive.start()

    def rank_channels(self) -> RankChannels:
        """How a tier attached to this engine reaches every rank (``ModelRuntime``'s optional
        ``rank_channels``)."""
        return RankChannels(
            world_size=self.state.world_size,
            rank_replicated=self.rank_replicated,
            send=self._send,
            conns=self.tier_conns,
        )

    @property
    def model(self):
        return self.inner.model

    def _send(self, *op) -> bool:
        with self._send_lock:
            if op == ("ping",) and self._stopping.is_set():
                return False  # closing: the last op the ranks see is "stop"
            if self.closed:
                raise RankFailure("the tensor-parallel ranks were stopped")
            with self._ranks():
                self.state.broadcast_object(op)
            self._last_send = time.monotonic()
            return True

    def _keep_alive(self, every_s: float) -> None:
        """Send a ping whenever no op went out for ``every_s`` (until close or a failure: the
        engine's next op then raises the RankFailure itself)."""
        while not self._stopping.wait(max(0.01, self._last_send + every_s - time.monotonic())):
            if time.monotonic() - self._last_send < every_s:
                continue  # an op went out meanwhile
            try:
                if not self._send("ping"):
                    return
            except RankFailure as exc:
                log.error("tensor parallelism: keepalive to the ranks failed: %s", exc)
                return
            self.pings += 1

    @contextmanager
    def _ranks(self):
        """Turn a failed collective into a RankFailure naming the rank that died, if one did."""
        try:
            yield
        except RankFailure:
            raise
        except Exception as exc:
            for p in self.processes:
                p.join(1.0)  # a peer that died has usually exited by now: reap it (bounded)
            dead = [
                f"rank {i + 1} (pid {p.pid}) exited with code {p.exitcode}"
                for i, p in enumerate(self.processes)
                if p.exitcode is not None
            ]
            why = "; ".join(dead) or f"a collective failed: {exc}"
            raise RankFailure(f"tensor parallelism: {why}; the engine cannot continue") from exc

    def enable_decode_graphs(
        self, max_batch: int, max_len: int | None = None, backend=None
    ) -> bool:
        """Every rank replays graphs for its decode (and, with drafts, verify and draft)
        forwards: each captures its own, with the forward's collectives inside, at the same op
        (each rank sees the same forwards, so each captures the same buckets in the same order
        and their collectives pair up). ``backend``: None (CUDA graphs) or ``EagerBackend``
        (tests: the same on every rank). Before ``bind``, as on one rank."""
        from atom.models.common.graphs import EagerBackend

        enable = RuntimeCapabilities.of(self.inner).enable_decode_graphs
        if enable is None:
            return False
        if backend is not None and not isinstance(backend, EagerBackend):
            raise ValueError(f"across ranks graphs use CUDA graphs or EagerBackend, not {backend}")
        self._send("enable_graphs", max_batch, max_len, backend is not None)
        on = enable(max_batch, max_len, backend=backend)
        caps = RuntimeCapabilities.of(self.inner)
        self.reserved_blocks, self.reserved_slots = caps.reserved_blocks, caps.reserved_slots
        return on

    def bind(self, pool: torch.Tensor, slot_bytes: torch.Tensor) -> None:
        self._send("bind", tuple(pool.shape), str(pool.dtype), tuple(slot_bytes.shape))
        self.inner.bind(pool, slot_bytes)

    def forward(
        self, token_ids: torch.Tensor, spans: list[Span], all_logits: bool = False
    ) -> torch.Tensor:
        ids = token_ids.cpu()
        spans = host_spans(spans)
        self._send("forward", ids, spans, all_logits)
        with self._ranks():
            return run_forward(self.inner, ids, spans, all_logits)

    # ---- drafts (module doc) ----------------------------------------------------------------

    def forward_with_residual(
        self, token_ids: torch.Tensor, spans: list[Span], all_logits: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ids = token_ids.cpu()
        spans = host_spans(spans)
        self._send("forward_with_residual", ids, spans, all_logits)
        with self._ranks():
            return self.inner.forward_with_residual(ids, spans, all_logits)

    def draft_forward(
        self,
        token_ids: torch.Tensor,
        residual: torch.Tensor,
        spans: list[Span],
        *,
        layer: int = 0,
        all_logits: bool = False,
        logit_rows: torch.Tensor | None = None,
        shift: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's draft layer (module doc). Ops travel as host values, so ``shift`` is
        read here and every rank runs the moved spans (its mirror exact: nothing to settle);
        ``logit_rows`` travels as a list."""
        ids, residual = token_ids.cpu(), residual.contiguous()
        spans = host_spans(shifted_spans(spans, shift))
        rows = None if logit_rows is None else logit_rows.tolist()
        shape, dtype = tuple(residual.shape), str(residual.dtype)
        self._send("draft_forward", ids, spans, layer, all_logits, shape, dtype, rows)
        with self._ranks():
            self.state.broadcast(residual)
            return self.inner.draft_forward(
                ids, residual, spans, layer=layer, all_logits=all_logits, logit_rows=logit_rows
            )

    def settle_draft_cursors(self, cursors: list[tuple[int, int, int]]) -> None:
        """Nothing to settle on any rank: ``draft_forward`` ran the moved spans (rank 0's
        mirror is updated all the same, as the contract says)."""
        self.inner.settle_draft_cursors(cursors)

    def fill_draft_windows(self, residual: torch.Tensor, spans: list[Span]) -> None:
        residual = residual.contiguous()
        spans = host_spans(spans)
        self._send("fill_draft_windows", spans, tuple(residual.shape), str(residual.dtype))
        with self._ranks():
            self.state.broadcast(residual)
            self.inner.fill_draft_windows(residual, spans)

    def draft_blocks(
        self, tokens: list[int], positions: list[int], slots: list[int]
    ) -> list[list[int]]:
        self._send("draft_blocks", list(tokens), list(positions), list(slots))
        with self._ranks():
            return self.inner.draft_blocks(tokens, positions, slots)

    def rank_digests(self) -> list[str]:
        """Every rank's digest of its pool and state slots, in rank order: equal when the
        ranks hold the same bytes (module doc), as they must. A check for tests and debugging:
        it copies both to the host."""
        self._send("digest")
        with self._ranks():
            return self.state.all_gather_object(state_digest(self.inner))

    def store_image(self, slot: int, units: torch.Tensor) -> None:
        self._send("store_image", slot, units.tolist())
        self.inner.store_image(slot, units)

    def restore_image(self, units: torch.Tensor, slot: int) -> int:
        self._send("restore_image", units.tolist(), slot)
        return self.inner.restore_image(units, slot)

    def close(self) -> None:
        """Stop the other ranks (they leave their loop and exit) and leave the group."""
        if self.closed:
            return
        self._stopping.set()
        try:
            self._send("stop")
        except RankFailure as exc:
            log.warning("stopping the tensor-parallel ranks: %s", exc)
        finally:
            self.closed = True
            if self._keepalive is not None:
                self._keepalive.join(5.0)
            if self._on_close is not None:
                self._on_close()


def host_spans(spans: list[Span]) -> list[Span]:
    """The spans with their block tables on the host (what an op sends to the ranks)."""
    return [replace(s, block_table=s.block_table.cpu()) for s in spans]


def run_forward(runtime, ids: torch.Tensor, spans: list[Span], all_logits: bool):
    """The runtime's forward, every token's logits with ``all_logits``."""
    if not all_logits:
        return runtime.forward(ids, spans)
    return runtime.model.forward_paged(ids, spans, runtime.kv, runtime.slots, all_logits=True)


def serve_ops(runtime, state, rank_ops: RankOps | None = None) -> None:
    """A rank other than 0: make every op rank 0 sends on ``runtime`` until ``stop``;
    ``rank_ops`` makes the ops that are not the model's (an unknown op raises)."""
    device = runtime.device
    extra = rank_ops.names if rank_ops is not None else frozenset()
    try:
        while True:
            op = state.broadcast_object()
            name, args = op[0], op[1:]
            if name == "stop":
                return
            if name == "ping":  # rank 0 is idle (module doc)
                continue
            if name == "bind":
                shape, dtype, slot_shape = args
                pool = rank_ops.pool if rank_ops is not None else None
                if pool is not None:  # made, shared and registered before bind
                    assert tuple(pool.shape) == tuple(shape), (pool.shape, shape)
                else:
                    dt = getattr(torch, dtype.split(".")[-1])
                    pool = torch.zeros(shape, dtype=dt, device=device)
                slots = torch.zeros(slot_shape, dtype=torch.uint8, device=device)
                runtime.bind(pool, slots)
            elif name == "forward":
                run_forward(runtime, *args)
            elif name == "forward_with_residual":  # the same graphs as rank 0's (verify)
                runtime.forward_with_residual(*args)
            elif name == "enable_graphs":
                from atom.models.common.graphs import EagerBackend

                max_batch, max_len, eager = args
                backend = EagerBackend() if eager else None
                runtime.enable_decode_graphs(max_batch, max_len, backend=backend)
            elif name == "draft_forward":
                ids, spans, layer, all_logits, shape, dtype, rows = args
                residual = _received(state, shape, dtype, device)
                if rows is not None:
                    rows = torch.tensor(rows, dtype=torch.int64, device=device)
                runtime.draft_forward(
                    ids, residual, spans, layer=layer, all_logits=all_logits, logit_rows=rows
                )
            elif name == "fill_draft_windows":
                spans, shape, dtype = args
                runtime.fill_draft_windows(_received(state, shape, dtype, device), spans)
            elif name == "draft_blocks":
                runtime.draft_blocks(*args)
            elif name == "digest":
                state.all_gather_object(state_digest(runtime))
            elif name == "store_image":
                slot, units = args
                runtime.store_image(slot, torch.tensor(units, dtype=torch.int64, device=device))
            elif name == "restore_image":
                units, slot = args
                runtime.restore_image(torch.tensor(units, dtype=torch.int64, device=device), slot)
            elif name in extra:
                rank_ops.handle(name, args, runtime, device)
            else:
                raise RuntimeError(f"unknown tensor-parallel op {name!r}")
    finally:
        if rank_ops is not None:
            rank_ops.close()


def state_digest(runtime) -> str:
    """A digest of a bound runtime's pool and state-slot bytes."""
    h = hashlib.blake2b(digest_size=16)
    for t in (runtime.pool, runtime.slot_bytes):
        h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def _received(state, shape: tuple, dtype: str, device) -> torch.Tensor:
    """The rows rank 0 broadcasts after an op that names their shape and dtype."""
    x = torch.empty(shape, dtype=getattr(torch, dtype.split(".")[-1]), device=device)
    return state.broadcast(x)
