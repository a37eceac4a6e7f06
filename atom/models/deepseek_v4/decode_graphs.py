"""CUDA graphs for V4 decode forwards (every span one token), replayed per batch bucket.

Contract of ``V4DecodeGraphs.run(token_ids, spans)``:

* It returns what ``model.forward_paged(token_ids, spans, kv, slots)`` returns (float32 logits
  of each span, a copy the caller owns) and leaves the same state and host mirror, up to the
  rounding of another batch shape; or it returns ``None`` without touching anything, and the
  caller runs the eager forward. It refuses spans exactly as the eager forward does.
* It runs forwards whose spans are all one token at a position > 0 at their slot's cursor,
  with at most the largest bucket's spans and tables that fit ``max_blocks``, where the MoE's
  per-batch path is the same for the batch and its bucket and has no host sync (the fp32
  CUDA loop syncs: eager). Buckets, padding rows and the one upload are
  ``atom.models.common.graphs``'; the graph computes ``paged_decode``'s fixed-shape batch
  with ``max_end = width * block_size`` (rows a sequence cannot see are masked, so its
  selections equal the eager forward's).
* Padding rows (token 0 at position 0 in the spare slot, every table entry the spare block)
  write only that slot and block: their groups never complete (p + 1 < r), so their PAGE
  writes keep the spare block's bytes, and their window, partial and cursor writes go to the
  spare slot, which the engine never schedules.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from atom.model_api import Span
from atom.models.common.graphs import GraphSet, pack_inputs, width_bucket
from atom.models.deepseek_v4.paged_decode import DecodeBatch

log = logging.getLogger(__name__)


@dataclass
class _Graph:
    inp: torch.Tensor  # the static inputs (pack_inputs' layout) on the device
    out: torch.Tensor  # [bucket, V] static logits
    replay: Callable[[], object]
    forward: Callable[[], torch.Tensor]  # the captured function (holds what the graph reads)


class V4DecodeGraphs(GraphSet):
    def __init__(self, model, kv, slots, *, max_batch: int, **kw):
        super().__init__(model, kv, slots, max_rows=max_batch, moe=model.layers[0].ffn, **kw)
        self.replays = 0

    def key(self, spans: list[Span]) -> tuple[int, int] | None:
        """(batch bucket, width bucket) of a forward a graph can run, else None."""
        if not DecodeBatch.usable(spans):
            return None
        s = self.slots
        if any(not 0 <= sp.slot < s.num_slots for sp in spans):
            return None  # the eager forward refuses it
        if any(s.host_position[sp.slot] != sp.start for sp in spans):
            return None  # the eager forward refuses it too
        bucket = self.bucket(len(spans))
        if bucket is None:
            return None
        need = max(-(-sp.end // self.block_size) for sp in spans)
        width = width_bucket(need, self.max_blocks)
        if width is None or (bucket, width) in self.failed:
            return None
        return bucket, width

    def run(self, token_ids: torch.Tensor, spans: list[Span]) -> torch.Tensor | None:
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

    def _capture(self, bucket: int, width: int) -> _Graph | None:
        host = pack_inputs(None, [], bucket, width, self.spare_slot, self.spare_block)
        inp = host.to(self.device)
        ids, pos, slot_ids, _ = inp[: 4 * bucket].view(4, bucket)
        tables = inp[4 * bucket :].view(bucket, width)
        layout = self.model.decode_layout(self.slots)
        max_end = width * self.block_size

        @torch.no_grad()  # (with autograd on, the MoE would take its syncing loop)
        def forward() -> torch.Tensor:
            batch = DecodeBatch.on_device(ids, slot_ids, pos, tables, max_end, **layout)
            return self.model.logits(self.model.decode_streams(batch, self.kv, self.slots))

        got = self._try_capture((bucket, width), forward)
        if got is None:
            return None
        replay, out = got
        graph = _Graph(inp, out, replay, forward)
        self.graphs[(bucket, width)] = graph
        log.info("captured V4 decode graph: batch %d, width %d blocks", bucket, width)
        return graph
