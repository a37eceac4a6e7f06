"""CUDA graphs for V4.1 decode forwards (every span one token), replayed per batch bucket.

Contract of ``DecodeGraphs.run(token_ids, spans)``:

* It returns what ``model.forward_paged(token_ids, spans, kv, slots)`` returns (float32 logits
  of each span, a copy the caller owns) and leaves the same state and host mirror, up to the
  rounding of another batch shape; or it returns ``None`` without touching anything, and the
  caller runs the eager forward. It refuses spans exactly as the eager forward does.
* It runs a forward whose spans are all one token at a position > 0 (a span at 0 resets its
  slot: eager) at their slot's cursor and frontier (a rewound span, ``speculative_tokens``
  >= 1, or a slot whose frontier is past its cursor: eager; the graph's Engram history is
  the plain step's shift, ``paged`` module doc), with at most the largest bucket's spans and
  tables that fit ``max_blocks``, and where the model's per-batch path (MoE: dense / grouped)
  is the same for the real batch and its bucket and has no host sync (``MoE.path``; the fp32
  CUDA loop syncs: eager).
* A graph is keyed by (batch bucket, width bucket). Batch buckets: 1, 2, 4, ... up to
  ``max_batch``, plus ``max_batch`` and every size after which the MoE path changes (so
  padding never changes a real row's path). Width buckets (blocks per table): 1, 2, 3, 4, 6,
  8, 12, ... (2^k and 3 * 2^k): the indexer scans at most 1.5x the rows the batch needs, and
  ``max_end`` (the rows it scans) is ``width * block_size``: rows a sequence cannot see are
  masked, so the selections equal the eager forward's.
* Padding rows: token 0 at position 0 in ``spare_slot`` with every table entry
  ``spare_block``. They read and write only that slot and block, which the engine never
  schedules, so no real sequence reads what they write. Real tables are cut or padded (with
  ``spare_block``) to the width: blocks past a sequence's end are neither read for its rows
  nor written.
* Per replay the host packs ids, positions, slots, ends and padded tables into one int64
  tensor, uploaded in one copy into the graph's static buffer (device token ids or tables are
  copied in after it); gram sources, windows, index scoring, top-k, candidate blocks, PAGE
  and ring writes, cursors and the LM head all run inside the graph. After the replay the host
  updates the slots' mirror.
* Capture is lazy, on a key's first use: two warm-up forwards of padding rows only (they
  write only the spare slot and block), then the capture of the same on one side stream, in
  one memory pool shared by every graph. A capture that fails is logged and recorded in
  ``failed``; that key runs eagerly from then on.

``backend`` does the capture: CUDA graphs by default; tests pass ``EagerBackend``, whose
"replay" re-runs the captured function, to exercise buckets, padding and buffers on CPU.
"""

from __future__ import annotations

import torch

from atom.model_api import Span
from atom.models.common.graphs import (  # noqa: F401  (re-exported: the V4.1 graphs' home)
    CudaGraphBackend,
    DecodeGraphSet,
    EagerBackend,
    GraphSet,
    batch_buckets,
    pack_inputs,
    pick_bucket,
    width_bucket,
)


class DecodeGraphs(DecodeGraphSet):
    def at_cursor(self, sp: Span) -> bool:
        """Also at the slot's frontier: a rewound span (or a frontier past the cursor) runs
        eagerly."""
        return super().at_cursor(sp) and self.slots.frontier(sp.slot) == sp.start

    def capture_forward(self, bucket: int, width: int, inp: torch.Tensor):
        from atom.models.deepseek_v41.model import ForwardPlan
        from atom.models.deepseek_v41.paged_decode import DecodeBatch

        dev = self.device
        ids, pos, slot_ids, ends = inp[: 4 * bucket].view(4, bucket)
        tables = inp[4 * bucket :].view(bucket, width)
        rows = torch.arange(bucket, dtype=torch.int64)
        # Engram ids t-3..t of row k: the last 3 of history k (H per row, after the bucket's
        # ids), then k; with ``history`` (k >= 1) the new history is the old one shifted by k
        h = self.slots.gram_history.shape[1]
        hist = bucket + h * rows[:, None] + torch.arange(h)
        gram_src = torch.cat([hist[:, h - 3 :], rows[:, None]], 1).to(dev)
        hist_src = torch.cat([hist[:, 1:], rows[:, None]], 1).to(dev)
        rows = rows.to(dev)
        with_history = self.slots.history is not None
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        max_end = width * self.block_size

        def forward() -> torch.Tensor:
            decode = DecodeBatch(rows, slot_ids, pos, tables, max_end, all_rows=True)
            plan = ForwardPlan(ids, pos, gram_src, slot_ids, ends, rows, empty, [], decode)
            if with_history:
                plan.frontiers, plan.hist_src = ends, hist_src
            return self.model.run_plan(plan, self.kv, self.slots)

        return forward
