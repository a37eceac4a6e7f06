"""CUDA graphs for speculative decoding's forwards: the target's verify forward and the draft
layers' forwards, replayed per (rows, width) bucket. (``decode_graphs`` runs plain decode.)

Contract of ``SpanGraphs.verify(token_ids, spans)``:

* It returns what ``model.forward_paged(token_ids, spans, kv, slots, all_logits=True,
  return_residual=True)`` returns (float32 logits of every row [N, V] and the last layer's
  streams [N, hc, d], copies the caller owns) and leaves the same state and host mirror, up to
  the rounding of another batch shape; or it returns ``None`` without touching anything, and
  the caller runs the eager forward. It refuses spans exactly as the eager forward does.
* It runs forwards whose spans are all 1 .. k + 1 tokens (a decode position and its drafts) at
  positions > 0, starting where their slot accepts them (at the cursor, or behind it within
  k: ``StateSlots.check_start``; the graph reads the Engram history the host computed for that
  frontier), with at most the largest bucket's rows and tables that fit ``max_blocks``, where
  the MoE path is the same for the real rows and the bucket and has no host sync.
* Every row is one row of a ``DecodeBatch`` that knows its span's start and first row
  (``paged_decode``): a position inside the row's own span is read from the batch, one before
  it from the rings, so each row sees what the eager forward's prefill path gives it. Rows that
  complete no compressed group write into ``spare_block`` (several rows of one span share a
  group's location).
* Buckets: rows 1, 2, 4, ... up to ``max_rows`` (plus every size after which the MoE path
  changes), widths as ``decode_graphs``. Padding rows are single-token spans at position 0 in
  ``spare_slot`` with every table entry ``spare_block``; they read and write only those.
* Per replay the host packs every index (``pack_rows``) into one int64 tensor, uploaded in one
  copy; gram sources, windows, selections, PAGE and ring writes, cursors, the new history and
  the LM head run inside the graph. After the replay the host updates the slots' mirror.

``SpanGraphs.draft(token_ids, residual, spans, layer, logit_rows)`` is the same for one draft
layer (``draft.forward_draft_paged``; spans of 1 .. k + 1 tokens, any start its cursor accepts):
the residual is copied into the graph's static buffer; it returns the logits of each span's last
row (or of the rows ``logit_rows`` names, a device tensor written into the graph's input) and
the layer's output streams, and writes the layer's ring and cursor. ``shift`` (one-row spans)
moves each span by a device offset, added to its packed position, start and end; the host
mirror of those cursors keeps the unshifted ends (``slots.verify``: the shifted ones) until the
caller settles them (``draft_forward``).

Capture is lazy, with ``decode_graphs``' backends; ``SpanGraphs`` has a backend of its own (its
own memory pool and side stream, apart from the decode graphs').
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from atom.model_api import Span
from atom.models.deepseek_v41.decode_graphs import GraphSet, width_bucket

log = logging.getLogger(__name__)

# per-row fields of the packed input, in order (each [rows]); then gram sources [rows, 4],
# history sources [rows, H] and tables [rows, width]. Span fields are indexed by span (a
# bucket holds at most one span per row; padding spans are the padding rows)
ROW_FIELDS = ("ids", "pos", "slot", "start", "first", "span_slot", "span_end", "span_last", "front")


def pack_rows(
    token_ids: torch.Tensor | None,
    spans: list[Span],
    frontiers: list[int] | None,
    bucket: int,
    width: int,
    hist: int,
    spare_slot: int,
    spare_block: int,
) -> torch.Tensor:
    """Host int64 [bucket * (len(ROW_FIELDS) + 4 + hist + width)] (layout above). ``frontiers``:
    each span's slot frontier before the forward (None: at its start). Gram and history
    sources index [the bucket's token ids, bucket x hist history ids] as ``ForwardPlan``'s do.
    Device token ids (``token_ids`` None) are left 0 for the caller to copy. Built from Python
    ints and converted once (a replay's host time is the step's)."""
    rows = {name: [] for name in ("pos", "slot", "start", "first")}
    span_slot, span_end = [spare_slot] * bucket, [1] * bucket
    span_last, front = list(range(bucket)), [1] * bucket
    # padding spans k (each the padding row k): ids from the spare slot's history, then row k
    hsrc = [[bucket + hist * k + i for i in range(1, hist)] + [k] for k in range(bucket)]
    gram: list[int] = []
    tables: list[int] = []
    lo = 0
    for k, sp in enumerate(spans):
        s, e = sp.start, sp.end
        f = s if frontiers is None else frontiers[k]
        old = bucket + hist * k + hist - f  # + q: history entry of position q

        def source(q: int, s=s, e=e, lo=lo, old=old) -> int:
            return lo + q - s if s <= q < e else old + q

        t = sp.block_table
        # device tables are copied in by the caller (reading them here would sync)
        table = t.reshape(-1)[:width].tolist() if width and t.device.type == "cpu" else []
        table += [spare_block] * (width - len(table))
        for p in range(s, e):
            rows["pos"].append(p)
            rows["slot"].append(sp.slot)
            rows["start"].append(s)
            rows["first"].append(lo)
            gram += [source(p - 3), source(p - 2), source(p - 1), lo + p - s]
            tables += table
        span_slot[k], span_end[k], span_last[k] = sp.slot, e, lo + e - s - 1
        front[k] = max(f, e)
        hsrc[k] = [source(q) for q in range(front[k] - hist, front[k])]
        lo += e - s
    for r in range(lo, bucket):  # padding rows: one token at 0 in the spare slot and block
        rows["pos"].append(0)
        rows["slot"].append(spare_slot)
        rows["start"].append(0)
        rows["first"].append(r)
        gram += [bucket + hist * r + i for i in range(hist - 3, hist)] + [r]
        tables += [spare_block] * width
    ids = token_ids.reshape(-1).tolist() if token_ids is not None else []
    ids += [0] * (bucket - len(ids))
    out = ids + rows["pos"] + rows["slot"] + rows["start"] + rows["first"]
    out += span_slot + span_end + span_last + front + gram + sum(hsrc, []) + tables
    return torch.tensor(out, dtype=torch.int64)


@dataclass
class _Graph:
    inp: torch.Tensor  # the static inputs (``pack_rows``' layout) on the device
    out: tuple[torch.Tensor, torch.Tensor]  # static (logits, streams)
    replay: Callable[[], object]
    forward: Callable  # the captured function (holds the static tensors it reads)
    residual: torch.Tensor | None = None  # a draft graph's static residual input


class SpanGraphs(GraphSet):
    def __init__(self, model, kv, slots, **kw):
        super().__init__(model, kv, slots, **kw)
        self.k = slots.speculative_tokens
        self.hist = slots.gram_history.shape[1]
        self.replays = {"verify": 0, "draft": 0}

    def _rows_bucket(self, spans: list[Span], min_start: int) -> int | None:
        """The rows bucket of spans of 1 to k + 1 tokens at ``min_start`` or later, none of
        them marked ``Span.prefill`` (the eager forward prefills those), else None."""
        if not spans or any(
            sp.start < min_start or not 1 <= sp.num_tokens <= self.k + 1 or sp.prefill
            for sp in spans
        ):
            return None
        if any(not 0 <= sp.slot < self.slots.num_slots for sp in spans):
            return None  # the eager forward refuses it
        return self.bucket(sum(sp.num_tokens for sp in spans))

    def verify_key(self, spans: list[Span]) -> tuple | None:
        """("verify", rows bucket, width bucket) of a forward a graph can run, else None."""
        bucket = self._rows_bucket(spans, 1)
        if bucket is None:
            return None
        need = max(-(-sp.end // self.block_size) for sp in spans)
        width = width_bucket(need, self.max_blocks)
        key = ("verify", bucket, width)
        return None if width is None or key in self.failed else key

    def draft_key(self, spans: list[Span], layer: int) -> tuple | None:
        bucket = self._rows_bucket(spans, 0)
        key = ("draft", layer, bucket)
        return None if bucket is None or key in self.failed else key

    def verify(self, token_ids: torch.Tensor, spans: list[Span]):
        key = self.verify_key(spans)
        if key is None:
            return None
        if token_ids.numel() != sum(sp.num_tokens for sp in spans):
            raise ValueError("token_ids must hold exactly the spans' tokens, in span order")
        self.model.check_spans(spans, self.slots)
        graph = self.graphs.get(key) or self._capture(key)
        if graph is None:
            return None
        fronts = None
        if self.slots.history is not None:
            fronts = [self.slots.frontier(sp.slot) for sp in spans]
        self._upload(graph, key, token_ids, spans, fronts)
        graph.replay()
        self.replays["verify"] += 1
        for sp in spans:
            self.slots.advance(sp.slot, sp.end)
        n = token_ids.numel()
        return graph.out[0][:n].clone(), graph.out[1][:n].clone()

    def draft(
        self,
        token_ids: torch.Tensor,
        residual: torch.Tensor,
        spans: list[Span],
        layer: int,
        logit_rows: torch.Tensor | None = None,
        shift: torch.Tensor | None = None,
    ):
        key = self.draft_key(spans, layer)
        if key is None:
            return None
        from atom.models.deepseek_v41.draft import _check_inputs, check_draft_spans

        _check_inputs(self.model, token_ids, residual, sum(sp.num_tokens for sp in spans))
        check_draft_spans(self.model, spans, self.slots, layer)
        graph = self.graphs.get(key) or self._capture(key)
        if graph is None:
            return None
        self._upload(graph, key, token_ids, spans, None)
        v = self._views(graph.inp, key[2], 0)
        if logit_rows is not None:  # the rows whose logits come back (on the device)
            v["span_last"][: len(spans)].copy_(logit_rows, non_blocking=True)
        if shift is not None:  # one-row spans, each at start + shift (on the device)
            for field in ("pos", "start", "span_end"):
                v[field][: len(spans)] += shift
        n = token_ids.numel()
        graph.residual[:n].copy_(residual)
        graph.replay()
        self.replays["draft"] += 1
        ends = [sp.end for sp in spans]
        if shift is not None and self.slots.verify:  # (the debug mode reads the device anyway)
            ends = [e + d for e, d in zip(ends, shift.tolist())]
        for sp, end in zip(spans, ends):
            self.slots.advance_draft(sp.slot, layer, end)
        return graph.out[0][: len(spans)].clone(), graph.out[1][:n].clone()

    def _upload(self, graph: _Graph, key, token_ids, spans, fronts) -> None:
        bucket, width = self._shape(key)
        on_host = token_ids.device.type == "cpu"
        host = pack_rows(
            token_ids if on_host else None,
            spans,
            fronts,
            bucket,
            width,
            self.hist,
            self.spare_slot,
            self.spare_block,
        )
        if self.device.type == "cuda":
            graph.inp.copy_(host.pin_memory(), non_blocking=True)
        else:
            graph.inp.copy_(host)
        if not on_host:
            graph.inp[: token_ids.numel()].copy_(token_ids.reshape(-1))
        if any(sp.block_table.device.type != "cpu" for sp in spans) and width:
            tables = self._views(graph.inp, bucket, width)["tables"]
            lo = 0
            for sp in spans:
                m = min(width, sp.block_table.numel())
                tables[lo : lo + sp.num_tokens, :m] = sp.block_table.reshape(-1)[:m]
                lo += sp.num_tokens

    @staticmethod
    def _shape(key) -> tuple[int, int]:
        return (key[1], key[2]) if key[0] == "verify" else (key[2], 0)

    def _views(self, inp: torch.Tensor, bucket: int, width: int) -> dict[str, torch.Tensor]:
        nf = len(ROW_FIELDS)
        v = dict(zip(ROW_FIELDS, inp[: nf * bucket].view(nf, bucket)))
        at = nf * bucket
        v["gram"] = inp[at : at + 4 * bucket].view(bucket, 4)
        at += 4 * bucket
        v["hist"] = inp[at : at + self.hist * bucket].view(bucket, self.hist)
        at += self.hist * bucket
        v["tables"] = inp[at:].view(bucket, width)
        return v

    def _capture(self, key) -> _Graph | None:
        bucket, width = self._shape(key)
        dev = self.device
        inp = pack_rows(None, [], None, bucket, width, self.hist, self.spare_slot, self.spare_block)
        inp = inp.to(dev)
        v = self._views(inp, bucket, width)
        rows = torch.arange(bucket, dtype=torch.int64, device=dev)
        residual = None
        if key[0] == "verify":
            forward = self._verify_fn(v, rows, width * self.block_size)
        else:
            c = self.model.config
            residual = torch.zeros(bucket, c.hc_mult, c.hidden_size, dtype=self.model.dtype)
            residual = residual.to(dev)
            forward = self._draft_fn(v, rows, residual, key[1])
        got = self._try_capture(key, forward)
        if got is None:
            return None
        graph = _Graph(inp, got[1], got[0], forward, residual)
        self.graphs[key] = graph
        log.info("captured span graph %s", key)
        return graph

    def _batch(self, v, rows, max_end: int, dump: bool):
        from atom.models.deepseek_v41.paged_decode import DecodeBatch

        return DecodeBatch(
            rows,
            v["slot"],
            v["pos"],
            v["tables"],
            max_end,
            start=v["start"],
            first=v["first"],
            dump_block=self.spare_block if dump else None,
            all_rows=True,  # rows is arange(bucket): the forward's every row
        )

    def _verify_fn(self, v, rows, max_end: int):
        from atom.models.deepseek_v41.model import ForwardPlan

        empty = torch.zeros(0, dtype=torch.int64, device=self.device)
        with_history = self.slots.history is not None

        @torch.no_grad()
        def forward():
            plan = ForwardPlan(
                v["ids"],
                v["pos"],
                v["gram"],
                v["span_slot"],
                v["span_end"],
                v["span_last"],
                empty,
                [],
                self._batch(v, rows, max_end, dump=True),
            )
            if with_history:
                plan.frontiers, plan.hist_src = v["front"], v["hist"]
            return self.model.run_plan(
                plan, self.kv, self.slots, all_logits=True, return_residual=True
            )

        return forward

    def _draft_fn(self, v, rows, residual: torch.Tensor, layer: int):
        from atom.models.deepseek_v41.draft import draft_window_attention

        model, slots = self.model, self.slots
        block = model.mtp[layer]

        @torch.no_grad()  # (with grad the MoE takes its per-expert loop, which syncs)
        def forward():
            batch = self._batch(v, rows, 0, dump=False)
            x = block.draft(
                model.model.embed_tokens(v["ids"]),
                residual,
                lambda u: draft_window_attention(block.self_attn, u, batch, slots),
            )
            slots.draft_cursor[:, layer].index_copy_(0, v["span_slot"], v["span_end"])
            return block.logits(x[v["span_last"]], model.lm_head), x

        return forward
