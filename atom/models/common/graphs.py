"""What every family's CUDA graphs share: batch and width buckets, the packed static inputs,
the capture backends, and ``GraphSet`` (the captured graphs of one bound runtime).

The contracts of the graphs themselves are the families' (``deepseek_v41.decode_graphs``,
``deepseek_v41.span_graphs``, ``deepseek_v4.decode_graphs``); what they share is:

* Buckets. Batch buckets 1, 2, 4, ... up to ``max_rows``, plus ``max_rows`` and every size
  after which the MoE path changes (so padding never changes a real row's path). Width
  buckets (blocks per table) 1, 2, 3, 4, 6, 8, 12, ... (2^k and 3 * 2^k).
* Static inputs (``pack_inputs``): ids, positions, slots, ends, then the padded tables, one
  int64 tensor uploaded in one copy. Padding rows: token 0 at position 0 in ``spare_slot``
  with every table entry ``spare_block``, which the engine never schedules.
* Capture on a key's first use: two warm-up runs, then the capture on one side stream, in one
  memory pool shared by every graph; a capture that fails is recorded in ``failed`` and that
  key runs eagerly from then on. ``EagerBackend`` "replays" by re-running the function, so
  tests exercise buckets, padding and buffers on CPU.
"""

from __future__ import annotations

import logging
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from atom.model_api import Span
from atom.models.common import glue_compile

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int, path: Callable[[int], str] | None = None) -> list[int]:
    """1, 2, 4, ... < max_batch, max_batch, and every n < max_batch where ``path(n)`` differs
    from ``path(n + 1)`` (a batch and the bucket it pads to then take the same path)."""
    out = {max_batch}
    b = 1
    while b < max_batch:
        out.add(b)
        b *= 2
    if path is not None:
        paths = [path(n) for n in range(1, max_batch + 1)]
        out.update(n for n in range(1, max_batch) if paths[n - 1] != paths[n])
    return sorted(out)


def pick_bucket(buckets: list[int], n: int) -> int | None:
    """The smallest bucket holding n rows (None: more than the largest)."""
    return next((b for b in buckets if b >= n), None)


def width_bucket(blocks: int, max_blocks: int | None = None) -> int | None:
    """Table width for a batch needing ``blocks`` blocks: the smallest 2^k or 3 * 2^k at
    least that, capped at ``max_blocks`` (None: more than ``max_blocks``)."""
    if max_blocks is not None and blocks > max_blocks:
        return None
    w = 1
    while w < blocks:  # 1, 2, 3, 4, 6, 8, 12, 16, 24, ...
        w = w + w // 2 if w >= 2 and w & (w - 1) == 0 else (w // 3 * 4 if w % 3 == 0 else 2 * w)
    return w if max_blocks is None else min(w, max_blocks)


def pack_inputs(
    token_ids: torch.Tensor | None,
    spans: list[Span],
    bucket: int,
    width: int,
    spare_slot: int,
    spare_block: int,
) -> torch.Tensor:
    """Host int64 [bucket * (4 + width)]: ids, positions, slots, ends (each [bucket]), then the
    tables [bucket, width]; rows past the spans are padding rows. Token ids on the device
    (``token_ids`` None here) and device tables are left 0 / spare for the caller to copy."""
    n = len(spans)
    meta = torch.zeros(4, bucket, dtype=torch.int64)
    meta[2].fill_(spare_slot)
    meta[3].fill_(1)
    if token_ids is not None:
        meta[0, :n] = token_ids.reshape(-1)
    meta[1, :n] = torch.tensor([sp.start for sp in spans], dtype=torch.int64)
    meta[2, :n] = torch.tensor([sp.slot for sp in spans], dtype=torch.int64)
    meta[3, :n] = meta[1, :n] + 1
    tables = torch.full((bucket, width), spare_block, dtype=torch.int64)
    for r, sp in enumerate(spans):
        t = sp.block_table
        if t.device.type == "cpu":
            m = min(width, t.numel())
            tables[r, :m] = t.reshape(-1)[:m]
    return torch.cat([meta.reshape(-1), tables.reshape(-1)])


class EagerBackend:
    """Runs instead of capturing: ``replay`` re-runs the function into the static output. It
    keeps only a weak reference to the function, as a CUDA graph keeps only addresses: a
    replay after the function (and the tensors it holds) was freed raises."""

    def capture(self, fn: Callable[[], torch.Tensor]):
        """``fn`` returns a tensor or a tuple of tensors (the static outputs)."""
        with glue_compile.capturing():
            fn()  # the warm-up, as on CUDA
            out, ref = fn(), weakref.ref(fn)

        def replay():
            fn = ref()
            if fn is None:
                raise RuntimeError("replay of a freed function: a graph would read freed memory")
            with glue_compile.capturing():  # what a graph would replay: the compiled glue
                new = fn()
            for static, value in zip(*((out, new) if isinstance(out, tuple) else ([out], [new]))):
                static.copy_(value)

        return replay, out


class CudaGraphBackend:
    """CUDA graphs on one side stream, all in one memory pool."""

    def __init__(self, device: torch.device):
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def after_failure(self) -> None:
        """A capture that failed midway leaves its memory pool unusable for the next capture
        (the allocator asserts): later graphs get a new pool."""
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]):
        s, current = self.stream, torch.cuda.current_stream()
        s.wait_stream(current)
        with glue_compile.capturing():  # compiled glue (if on) compiles in the warm-ups
            with torch.cuda.stream(s):
                for _ in range(2):
                    fn()
            current.wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            # thread_local: other threads' CUDA calls (the tier's copies) stay legal meanwhile
            with torch.cuda.graph(
                graph, pool=self.pool, stream=s, capture_error_mode="thread_local"
            ):
                out = fn()
        return graph.replay, out


class GraphSet:
    """What decode graphs and span graphs share: the model's views, the spare slot and block,
    row buckets where padding never changes the MoE path (``moe``: a layer's
    ``atom.models.common.moe.MoE``; by default V4.1's first layer's), the backend, the
    captured graphs by key and the keys whose capture failed (they run eagerly from then
    on)."""

    def __init__(
        self,
        model,
        kv,
        slots,
        *,
        block_size: int,
        spare_slot: int,
        spare_block: int,
        max_rows: int,
        max_blocks: int | None = None,
        backend=None,
        moe=None,
    ):
        self.model, self.kv, self.slots = model, kv, slots
        self.block_size, self.max_blocks = block_size, max_blocks
        self.spare_slot, self.spare_block = spare_slot, spare_block
        self.device = model.device
        self._probe = torch.empty(0, dtype=model.dtype, device=self.device)
        self._moe = moe if moe is not None else model.model.layers[0].mlp
        self.buckets = batch_buckets(max_rows, self._path)
        self.backend = backend or CudaGraphBackend(self.device)
        self.graphs: dict[tuple, object] = {}
        self.failed: dict[tuple, str] = {}
        slots.reset(spare_slot)

    def _path(self, n: int) -> str:
        with torch.no_grad():
            return self._moe.path(n, self._probe)

    def bucket(self, n: int) -> int | None:
        """The bucket ``n`` rows replay in: None past the largest, or where the MoE takes its
        syncing loop or another path for the bucket than for the rows."""
        bucket = pick_bucket(self.buckets, n)
        if bucket is None:
            return None
        path = self._path(n)
        return None if path == "loop" or path != self._path(bucket) else bucket

    def upload(self, inp: torch.Tensor, key, token_ids: torch.Tensor, spans: list[Span]) -> None:
        """A forward's ids, positions, slots, ends and tables (``pack_inputs`` for
        ``key = (bucket, width, ...)``) into the graph's static input ``inp``: one pinned copy,
        then device token ids and device tables copied in on the device."""
        bucket, width = key[0], key[1]
        n, on_host = len(spans), token_ids.device.type == "cpu"
        host = pack_inputs(
            token_ids if on_host else None, spans, bucket, width, self.spare_slot, self.spare_block
        )
        if self.device.type == "cuda":
            inp.copy_(host.pin_memory(), non_blocking=True)
        else:
            inp.copy_(host)
        if not on_host:
            inp[:n].copy_(token_ids.reshape(-1))
        tables = inp[4 * bucket :].view(bucket, width)
        for r, sp in enumerate(spans):
            t = sp.block_table
            if t.device.type != "cpu":
                m = min(width, t.numel())
                tables[r, :m].copy_(t.reshape(-1)[:m])

    def _try_capture(self, key, forward: Callable):
        """(replay, static outputs) of ``forward``, or None after recording why in ``failed``
        (a capture that failed midway also gets later captures a fresh memory pool). A capture
        that failed because a compiled-glue region did (it runs eagerly from then on) is tried
        once more: the warm-up forwards write only the spare slot and block."""
        for attempt in (0, 1):
            disabled = len(glue_compile.STATS.disabled)
            try:
                return self.backend.capture(forward)
            except Exception as e:  # noqa: BLE001 - any failure: this key runs eagerly
                getattr(self.backend, "after_failure", lambda: None)()
                if attempt == 0 and len(glue_compile.STATS.disabled) > disabled:
                    log.warning(
                        "%s %s: captured again without the failed glue region",
                        type(self).__name__,
                        key,
                    )
                    continue
                self.failed[key] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
                log.warning("%s %s not captured: %s", type(self).__name__, key, e)
                return None


@dataclass
class DecodeGraph:
    inp: torch.Tensor  # the static inputs (``pack_inputs``' layout) on the device
    out: torch.Tensor  # [bucket, V] static logits
    replay: Callable[[], object]
    # the captured function: it holds the other static tensors the graph reads by address
    # (the family's batch indices), alive as long as the graph
    forward: Callable[[], torch.Tensor]


class DecodeGraphSet(GraphSet):
    """Decode graphs of either family: forwards whose spans are all one token at a position
    > 0 at their slot's cursor (``at_cursor``), keyed by (batch bucket, width bucket), replayed
    by ``run``. A family gives ``capture_forward(bucket, width, inp)``: the function a graph
    captures, reading its inputs from ``inp`` and returning [bucket, V] float32 logits."""

    def __init__(self, model, kv, slots, *, max_batch: int, **kw):
        super().__init__(model, kv, slots, max_rows=max_batch, **kw)
        self.replays = 0
        if glue_compile.enabled():
            self.warm_up()

    def warm_up(self) -> None:
        """Capture the smallest and the largest batch bucket a graph replays now, at width 1:
        with compiled glue (``glue_compile``) the first capture compiles it, and the engine's
        start pays that rather than its first decode step. A bucket whose MoE path is the
        syncing loop is never replayed (``bucket``) and cannot be captured on CUDA (its host
        sync), so it is not warmed up. Logs what it took."""
        t0, before = time.perf_counter(), glue_compile.STATS.compiles
        replayed = [b for b in self.buckets if self.bucket(b) == b]
        if not replayed:
            return
        log.info("%s: compiling the decode glue in a first capture ...", type(self).__name__)
        for bucket in sorted({replayed[0], replayed[-1]}):
            if (bucket, 1) not in self.graphs:
                self._capture(bucket, 1)
        log.info(
            "%s: warm-up captured %d graphs in %.1f s (%d glue graphs compiled; failed: %s)",
            type(self).__name__,
            len(self.graphs),
            time.perf_counter() - t0,
            glue_compile.STATS.compiles - before,
            sorted(self.failed) or "none",
        )

    def at_cursor(self, sp: Span) -> bool:
        """The slot is in range and its mirror's cursor is the span's start (else eager, which
        refuses it or runs what the graph cannot)."""
        s = self.slots
        return 0 <= sp.slot < s.num_slots and s.host_position[sp.slot] == sp.start

    def key(self, spans: list[Span]) -> tuple[int, int] | None:
        """(batch bucket, width bucket) of a forward a graph can run, else None."""
        if not spans or any(sp.end - sp.start != 1 or sp.start == 0 or sp.prefill for sp in spans):
            return None
        if any(not self.at_cursor(sp) for sp in spans):
            return None
        bucket = self.bucket(len(spans))
        if bucket is None:
            return None
        need = max(-(-sp.end // self.block_size) for sp in spans)
        width = width_bucket(need, self.max_blocks)
        if width is None or (bucket, width) in self.failed:
            return None
        return bucket, width

    def run(self, token_ids: torch.Tensor, spans: list[Span]) -> torch.Tensor | None:
        """The eager forward's logits (a copy), or None without touching anything."""
        key = self.key(spans)
        if key is None:
            return None
        if token_ids.numel() != len(spans):
            raise ValueError("token_ids must hold exactly the spans' tokens, in span order")
        self.model.check_spans(spans, self.slots)
        graph = self.graphs.get(key) or self._capture(*key)
        if graph is None:
            return None
        self.upload(graph.inp, key, token_ids, spans)
        graph.replay()
        self.replays += 1
        for sp in spans:
            self.slots.advance(sp.slot, sp.end)
        return graph.out[: len(spans)].clone()

    def capture_forward(self, bucket: int, width: int, inp: torch.Tensor) -> Callable:
        raise NotImplementedError

    def _capture(self, bucket: int, width: int) -> DecodeGraph | None:
        host = pack_inputs(None, [], bucket, width, self.spare_slot, self.spare_block)
        inp = host.to(self.device)
        forward = self.capture_forward(bucket, width, inp)
        got = self._try_capture((bucket, width), forward)
        if got is None:
            return None
        replay, out = got
        graph = DecodeGraph(inp, out, replay, forward)
        self.graphs[(bucket, width)] = graph
        log.info("captured %s: batch %d, width %d blocks", type(self).__name__, bucket, width)
        return graph
