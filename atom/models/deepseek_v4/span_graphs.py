"""CUDA graphs for V4's speculative decoding: the target's verify forward and the MTP draft
layers' forwards, replayed per (rows, width) bucket. (``decode_graphs`` runs plain decode.)

Contract of ``V4SpanGraphs.verify(token_ids, spans)``:

* It returns what ``model.forward_paged(token_ids, spans, kv, slots, all_logits=True,
  return_residual=True)`` returns (float32 logits of every row [N, V] and the last layer's
  streams [N, hc, d], copies the caller owns) and leaves the same state and host mirror, up to
  the rounding of another batch shape; or it returns ``None`` without touching anything, and
  the caller runs the eager forward. It refuses spans exactly as the eager forward does.
* It runs forwards whose spans are all 1 .. k + 1 tokens at positions > 0, starting where
  their slot accepts them (at the cursor, or behind it within k: ``V4StateSlots.check_start``),
  with at most the largest bucket's rows and tables that fit ``max_blocks``, where the MoE path
  is the same for the rows and the bucket and has no host sync.
* Every row is a row of the fixed-shape ``DecodeBatch`` that knows its span (start, end, first
  row): ``paged_decode`` reads a position inside the row's span from the batch, one before it
  from the rings, and every row of a group writes what the row completing it writes.
* Padding rows are one-token spans at position 0 in ``spare_slot`` with every table entry
  ``spare_block``; they read and write only those (as the decode graphs' padding rows).
* Per replay the host packs every index into one int64 tensor (``pack_rows``), uploaded in one
  copy; after the replay it updates the slots' mirror.

``V4SpanGraphs.draft(token_ids, residual, spans, layer)`` is the same for one MTP draft layer
(``model.forward_draft_paged``; spans of 1 .. k + 1 tokens, any start its draft cursor
accepts): the residual is copied into the graph's static buffer; it returns the logits of each
span's last row and the layer's output streams, and writes only the layer's ring and cursor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from atom.model_api import Span
from atom.models.common.graphs import GraphSet, width_bucket
from atom.models.deepseek_v4.paged_decode import DecodeBatch, decode_attention

log = logging.getLogger(__name__)

# per row [bucket] each; "last": each span's last row (then the padding rows, one span each)
ROW_FIELDS = ("ids", "pos", "slot", "start", "end", "first", "last")


def pack_rows(
    token_ids: torch.Tensor | None,
    spans: list[Span],
    bucket: int,
    width: int,
    spare_slot: int,
    spare_block: int,
) -> torch.Tensor:
    """Host int64 [bucket * (len(ROW_FIELDS) + width)]: the row fields (each [bucket]), then
    the tables [bucket, width]. Device token ids (``token_ids`` None) and device tables are
    left 0 / spare for the caller to copy. Built from Python ints, converted once."""
    pos, slot, start, end, first, last, tables = [], [], [], [], [], [], []
    lo = 0
    for sp in spans:
        last.append(lo + sp.num_tokens - 1)
        t = sp.block_table
        table = t.reshape(-1)[:width].tolist() if t.device.type == "cpu" else []
        table += [spare_block] * (width - len(table))
        for p in range(sp.start, sp.end):
            pos.append(p)
            slot.append(sp.slot)
            start.append(sp.start)
            end.append(sp.end)
            first.append(lo)
            tables += table
        lo += sp.num_tokens
    last += range(lo, bucket)  # the padding rows' spans, then any valid row (unread)
    last += [bucket - 1] * (bucket - len(last))
    for r in range(lo, bucket):  # padding rows: one token at 0 in the spare slot and block
        pos.append(0)
        slot.append(spare_slot)
        start.append(0)
        end.append(1)
        first.append(r)
        tables += [spare_block] * width
    ids = token_ids.reshape(-1).tolist() if token_ids is not None else []
    ids += [0] * (bucket - len(ids))
    out = ids + pos + slot + start + end + first + last + tables
    return torch.tensor(out, dtype=torch.int64)


@dataclass
class _Graph:
    inp: torch.Tensor  # the static inputs (``pack_rows``' layout) on the device
    out: tuple[torch.Tensor, torch.Tensor]  # static (logits, streams)
    replay: Callable[[], object]
    forward: Callable  # the captured function (holds the static tensors it reads)
    residual: torch.Tensor | None = None  # a draft graph's static residual input


class V4SpanGraphs(GraphSet):
    def __init__(self, model, kv, slots, **kw):
        super().__init__(model, kv, slots, moe=model.layers[0].ffn, **kw)
        self.k = slots.geometry.speculative_tokens
        self.replays = {"verify": 0, "draft": 0}

    def verify_key(self, spans: list[Span]) -> tuple | None:
        """("verify", rows bucket, width bucket) of a forward a graph can run, else None."""
        if not spans or any(
            sp.start < 1 or not 1 <= sp.num_tokens <= self.k + 1 or sp.prefill for sp in spans
        ):
            return None
        if any(not 0 <= sp.slot < self.slots.num_slots for sp in spans):
            return None  # the eager forward refuses it
        bucket = self.bucket(sum(sp.num_tokens for sp in spans))
        if bucket is None:
            return None
        width = width_bucket(max(-(-sp.end // self.block_size) for sp in spans), self.max_blocks)
        key = ("verify", bucket, width)
        return None if width is None or key in self.failed else key

    def draft_key(self, spans: list[Span], layer: int) -> tuple | None:
        """("draft", layer, rows bucket) of a draft forward a graph can run, else None."""
        if not spans or any(not 1 <= sp.num_tokens <= self.k + 1 for sp in spans):
            return None
        if any(not 0 <= sp.slot < self.slots.num_slots for sp in spans):
            return None
        bucket = self.bucket(sum(sp.num_tokens for sp in spans))
        key = ("draft", layer, bucket)
        return None if bucket is None or key in self.failed else key

    def draft(
        self,
        token_ids: torch.Tensor,
        residual: torch.Tensor,
        spans: list[Span],
        layer: int,
        logit_rows: torch.Tensor | None = None,
        shift: torch.Tensor | None = None,
    ):
        """One draft layer's forward (the eager one's contract); ``logit_rows``: the rows whose
        logits come back instead of each span's last (a device tensor written into the graph's
        input); ``shift``: one-row spans each moved by a device offset (its position, start
        and end), the host mirror keeping the unshifted ends until the caller settles them.
        None: the caller runs the eager forward."""
        key = self.draft_key(spans, layer)
        if key is None:
            return None
        n = token_ids.numel()
        c = self.model.config
        if n != sum(sp.num_tokens for sp in spans) or tuple(residual.shape) != (
            n,
            c.hc_mult,
            c.hidden_size,
        ):
            return None  # the eager forward says what is wrong
        self.model.check_draft_spans(spans, self.slots, layer)
        graph = self.graphs.get(key) or self._capture(key)
        if graph is None:
            return None
        self._upload(graph, key, token_ids, spans)
        v = self._views(graph.inp, key[2], 0)
        if logit_rows is not None:
            v["last"][: len(spans)].copy_(logit_rows, non_blocking=True)
        if shift is not None:
            for field in ("pos", "start", "end"):
                v[field][: len(spans)] += shift
        graph.residual[:n].copy_(residual)
        graph.replay()
        self.replays["draft"] += 1
        for sp in spans:
            self.slots.advance_draft(sp.slot, layer, sp.end)
        return graph.out[0][: len(spans)].clone(), graph.out[1][:n].clone()

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
        self._upload(graph, key, token_ids, spans)
        graph.replay()
        self.replays["verify"] += 1
        for sp in spans:
            self.slots.advance(sp.slot, sp.end)
        n = token_ids.numel()
        return graph.out[0][:n].clone(), graph.out[1][:n].clone()

    @staticmethod
    def _shape(key) -> tuple[int, int]:
        return (key[1], key[2]) if key[0] == "verify" else (key[2], 0)

    def _upload(self, graph: _Graph, key, token_ids, spans) -> None:
        bucket, width = self._shape(key)
        on_host = token_ids.device.type == "cpu"
        host = pack_rows(
            token_ids if on_host else None, spans, bucket, width, self.spare_slot, self.spare_block
        )
        if self.device.type == "cuda":
            graph.inp.copy_(host.pin_memory(), non_blocking=True)
        else:
            graph.inp.copy_(host)
        if not on_host:
            graph.inp[: token_ids.numel()].copy_(token_ids.reshape(-1))
        if width and any(sp.block_table.device.type != "cpu" for sp in spans):
            tables = self._views(graph.inp, bucket, width)["tables"]
            lo = 0
            for sp in spans:
                m = min(width, sp.block_table.numel())
                tables[lo : lo + sp.num_tokens, :m] = sp.block_table.reshape(-1)[:m]
                lo += sp.num_tokens

    @staticmethod
    def _views(inp: torch.Tensor, bucket: int, width: int) -> dict[str, torch.Tensor]:
        nf = len(ROW_FIELDS)
        v = dict(zip(ROW_FIELDS, inp[: nf * bucket].view(nf, bucket)))
        v["tables"] = inp[nf * bucket :].view(bucket, width)
        return v

    def _capture(self, key) -> _Graph | None:
        bucket, width = self._shape(key)
        inp = pack_rows(None, [], bucket, width, self.spare_slot, self.spare_block)
        inp = inp.to(self.device)
        v = self._views(inp, bucket, width)
        residual = None
        if key[0] == "verify":
            forward = self._verify_fn(v, width * self.block_size)
        else:
            c = self.model.config
            residual = torch.zeros(bucket, c.hc_mult, c.hidden_size, dtype=self.model.dtype)
            residual = residual.to(self.device)
            forward = self._draft_fn(v, residual, key[1])
        got = self._try_capture(key, forward)
        if got is None:
            return None
        graph = _Graph(inp, got[1], got[0], forward, residual)
        self.graphs[key] = graph
        log.info("captured V4 span graph %s", key)
        return graph

    def _batch(self, v, max_end: int, layout: dict) -> DecodeBatch:
        return DecodeBatch.on_device(
            v["ids"],
            v["slot"],
            v["pos"],
            v["tables"],
            max_end,
            start=v["start"],
            end=v["end"],
            first=v["first"],
            **layout,
        )

    def _verify_fn(self, v, max_end: int):
        layout = self.model.decode_layout(self.slots)
        model, kv, slots = self.model, self.kv, self.slots

        @torch.no_grad()  # (with autograd on, the MoE would take its syncing loop)
        def forward():
            x = model.decode_streams(self._batch(v, max_end, layout), kv, slots)
            return model.logits(x), x

        return forward

    def _draft_fn(self, v, residual: torch.Tensor, layer: int):
        model, slots = self.model, self.slots
        block = model.mtp[layer]
        layout = dict(
            ratios=[], window=model.config.sliding_window, ring=slots.geometry.window_rows
        )

        @torch.no_grad()
        def forward():
            batch = self._batch(v, 0, layout)
            x = block.draft(
                model.embed(v["ids"]),
                residual,
                v["ids"],
                lambda u: decode_attention(block.attn, u, batch, None, slots),
            )
            slots.draft_cursor[v["slot"], layer] = v["end"]  # a span's rows: the same end
            return block.logits(x[v["last"]], model.head), x

        return forward
