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

import torch

from atom.models.common.graphs import DecodeGraphSet
from atom.models.deepseek_v4.paged_decode import DecodeBatch


class V4DecodeGraphs(DecodeGraphSet):
    def __init__(self, model, kv, slots, *, max_batch: int, **kw):
        super().__init__(model, kv, slots, max_batch=max_batch, moe=model.layers[0].ffn, **kw)

    def capture_forward(self, bucket: int, width: int, inp: torch.Tensor):
        ids, pos, slot_ids, _ = inp[: 4 * bucket].view(4, bucket)
        tables = inp[4 * bucket :].view(bucket, width)
        layout = self.model.decode_layout(self.slots)
        max_end = width * self.block_size

        @torch.no_grad()  # (with autograd on, the MoE would take its syncing loop)
        def forward() -> torch.Tensor:
            batch = DecodeBatch.on_device(ids, slot_ids, pos, tables, max_end, **layout)
            return self.model.logits(self.model.decode_streams(batch, self.kv, self.slots))

        return forward
