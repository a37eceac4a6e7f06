"""A paged forward's index tensors (``ForwardPlan``), computed on the host from its spans.

Engram grams: every token at position p reads the ids at p - 3 .. p, from the forward's own
tokens for positions in its span and, before the span's start s, from the slot's history
(``StateSlots.gram_history``: H ids ending at the slot's frontier f, H = 3 + k): the id at
q < s is history entry H - f + q (a rewound span has f > s; f = s otherwise). With k >= 1 the
plan also holds each span's new frontier max(f, e) and the sources of the H ids before it
(``hist_src``), from the span's tokens and the old history (``paged`` module doc).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from atom.model_api import Span
from atom.models.common.prefill_plan import PrefillBatch, PrefillHost
from atom.models.deepseek_v41.paged_decode import DecodeBatch


@dataclass
class ForwardPlan:
    """A forward's index tensors, computed on the host from its spans (their start, end, slot
    and block table are host data) and uploaded in one copy: the layers never read the device
    to decide what to index."""

    token_ids: torch.Tensor  # [N] on the device
    positions: torch.Tensor  # [N] each token's position
    gram_src: torch.Tensor  # [N, 4] Engram ids t-3..t: indices into [token ids, S x H history]
    span_slots: torch.Tensor  # [S]
    span_ends: torch.Tensor  # [S]
    last: torch.Tensor  # [S] each span's last token in the flat batch
    reset: torch.Tensor  # [R] slots of spans starting at 0
    longer: list[PrefillBatch]  # the spans of several tokens, as one batch (or none)
    decode: DecodeBatch | None  # the single-token spans
    frontiers: torch.Tensor | None = None  # [S] each slot's new frontier (with ``history``)
    hist_src: torch.Tensor | None = None  # [S, H] its new history in [token ids, old history]

    @classmethod
    def build(
        cls,
        token_ids: torch.Tensor,
        spans: list[Span],
        device,
        shape,
        hist_width: int = 3,
        frontiers: list[int] | None = None,
        short: int = 1,
        dump_block: int | None = None,
    ) -> ForwardPlan:
        """``shape``: (sliding window, window ring rows, compressor ring rows, the ratios of
        the compressed layers), what the prefill batch's indices depend on. ``hist_width``: H,
        the history ids per slot; ``frontiers``: each span's slot frontier before the forward
        (0 for a span at 0; None: every span starts at its frontier and no history is kept
        beyond the cursor's, k = 0). Single-token spans run as decode rows, and so do spans past 0
        of at most ``short`` tokens (verify spans, 1 + k) when ``dump_block`` names a block for
        their rows that complete no group (``DecodeBatch.dump_block``); never a span marked
        ``Span.prefill``."""
        device = torch.device(device)
        n, nspan = token_ids.numel(), len(spans)
        segs: list[torch.Tensor] = []  # host int64 pieces of the one upload

        def put(t: torch.Tensor) -> int:
            segs.append(t.reshape(-1).to(torch.int64))
            return len(segs) - 1

        host_ids = token_ids.device.type == "cpu"
        at_ids = put(token_ids) if host_ids else None
        los, lo = [], 0
        for sp in spans:
            los.append(lo)
            lo += sp.num_tokens
        h = hist_width
        fronts = frontiers if frontiers is not None else [sp.start for sp in spans]
        positions, gram_src, hist_src, new_f = [], [], [], []
        for k, (sp, lo, f) in enumerate(zip(spans, los, fronts)):

            def source(q: torch.Tensor, sp=sp, lo=lo, f=f, k=k) -> torch.Tensor:
                # the id at positions q: the span's token, else old history entry H - f + q
                own = (q >= sp.start) & (q < sp.end)
                return torch.where(own, lo + q - sp.start, n + h * k + h - f + q)

            pos = torch.arange(sp.start, sp.end)
            gram_src.append(source(pos[:, None] - 3 + torch.arange(4)[None, :]))
            positions.append(pos)
            if frontiers is not None:
                new_f.append(max(f, sp.end))
                hist_src.append(source(torch.arange(new_f[-1] - h, new_f[-1])))
        at_pos, at_gram = put(torch.cat(positions)), put(torch.cat(gram_src))
        at_hist = put(torch.stack(hist_src)) if frontiers is not None else None
        at_front = put(torch.tensor(new_f, dtype=torch.int64)) if frontiers is not None else None
        meta = torch.tensor(
            [
                [sp.slot for sp in spans],
                [sp.end for sp in spans],
                [lo + sp.num_tokens - 1 for sp, lo in zip(spans, los)],
            ],
            dtype=torch.int64,
        )
        at_meta = put(meta)
        at_reset = put(torch.tensor([sp.slot for sp in spans if sp.start == 0], dtype=torch.int64))

        def as_rows(sp: Span) -> bool:
            if sp.prefill:
                return False
            if sp.num_tokens == 1:
                return True
            return dump_block is not None and sp.start > 0 and sp.num_tokens <= short

        single = [k for k, sp in enumerate(spans) if as_rows(sp)]
        longer = [k for k, sp in enumerate(spans) if not as_rows(sp)]
        # one decode row per token: (flat index, slot, position, span start, its first row)
        row_spans, rows = [], []
        for k in single:
            sp, first = spans[k], len(rows)
            for j in range(sp.num_tokens):
                rows.append([los[k] + j, sp.slot, sp.start + j, sp.start, first])
                row_spans.append(k)
        several = len(rows) > len(single)
        at_dec = None
        dec_host_tables = bool(single) and all(
            spans[k].block_table.device.type == "cpu" for k in single
        )
        if single:
            width = max(spans[k].block_table.numel() for k in single)
            at_dec = put(torch.tensor(rows, dtype=torch.int64).t())
            if dec_host_tables:
                padded = torch.zeros(len(rows), width, dtype=torch.int64)
                for r, k in enumerate(row_spans):
                    t = spans[k].block_table
                    padded[r, : t.numel()] = t
                at_dec_tables = put(padded)
        at_tables = {
            k: put(spans[k].block_table)
            for k in ([] if dec_host_tables else single)
            if spans[k].block_table.device.type == "cpu" and spans[k].block_table.device != device
        }
        prefill = None
        if longer:
            window, ring_rows, comp_rows, ratios = shape
            prefill = PrefillHost(
                [spans[k] for k in longer],
                [los[k] for k in longer],
                n,
                window,
                ring_rows,
                comp_rows,
                ratios,
                put,
            )
        host = torch.cat(segs)
        if device.type == "cuda":
            up = host.pin_memory().to(device, non_blocking=True)
        else:
            up = host.to(device)
        parts = list(torch.split(up, [s.numel() for s in segs]))
        ids = parts[at_ids] if host_ids else token_ids
        meta_d = parts[at_meta].view(3, nspan)

        def table(k: int) -> torch.Tensor:
            return parts[at_tables[k]] if k in at_tables else spans[k].block_table

        pos_d = parts[at_pos]
        carries = [prefill.resolve(parts, pos_d)] if prefill is not None else []
        decode = None
        if single:
            dec = parts[at_dec].view(5, len(rows))
            if dec_host_tables:
                tables = parts[at_dec_tables].view(len(rows), width)
            else:
                tables = pad_sequence([table(k) for k in row_spans], batch_first=True)
            spanned = dict(start=dec[3], first=dec[4], dump_block=dump_block) if several else {}
            max_end = max(spans[k].end for k in single)
            whole = not longer and [r[0] for r in rows] == list(range(n))
            decode = DecodeBatch(dec[0], dec[1], dec[2], tables, max_end, **spanned, all_rows=whole)
        return cls(
            ids,
            pos_d,
            parts[at_gram].view(n, 4),
            meta_d[0],
            meta_d[1],
            meta_d[2],
            parts[at_reset],
            carries,
            decode,
            None if at_front is None else parts[at_front],
            None if at_hist is None else parts[at_hist].view(nspan, h),
        )
