"""A V4 forward's index tensors, computed on the host from its spans and uploaded in one copy:
the layers never read the device to decide what to index.

The spans of several tokens (and any span at position 0) form one ``PrefillBatch`` (the tile
plan both families share: ``atom.models.common.prefill_plan``, with V4's compressor state: a
ratio-r group's partial rows are a ring of r rows, and the CSA groups overlap their
predecessors); the single-token spans past position 0 form one ``DecodeBatch`` (its indices
derived on the device from the same upload).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from atom.model_api import Span
from atom.models.common.prefill_plan import PrefillBatch, PrefillHost
from atom.models.deepseek_v4.config import CSA_RATIO
from atom.models.deepseek_v4.paged_decode import DecodeBatch, _upload


@dataclass
class V4ForwardPlan:
    token_ids: torch.Tensor  # [N] on the device
    positions: torch.Tensor  # [N] each token's position
    span_slots: torch.Tensor  # [S]
    span_ends: torch.Tensor  # [S]
    last: torch.Tensor  # [S] each span's last token in the flat batch
    reset: torch.Tensor  # [R] slots of spans starting at 0
    prefill: PrefillBatch | None  # the longer spans (and spans at 0), as one batch
    decode: DecodeBatch | None  # the single-token spans past 0
    dec_tok: torch.Tensor | None  # [B] their tokens in the flat batch

    @staticmethod
    def as_rows(sp: Span, short: int) -> bool:
        """Whether the span runs as decode rows: past position 0 and at most ``short`` tokens
        (one, or a verify span of 1 + speculative_tokens), unless marked ``Span.prefill``."""
        return sp.num_tokens <= short and sp.start > 0 and not sp.prefill

    @classmethod
    def build(
        cls,
        token_ids: torch.Tensor,
        spans: list[Span],
        device,
        *,
        ratios: list[int],
        window: int,
        ring: int,
        partial: dict[int, int] | None = None,
        entries: int = 1,
        short: int = 1,
    ) -> V4ForwardPlan:
        """``ratios``: the compressed layers' ratios; ``window``/``ring``: the sliding window
        and the ring rows; ``partial``: each ratio's partial ring rows (r when absent);
        ``entries``: each overlap field's (``V4Model.decode_layout``). Spans past 0 of at most
        ``short`` tokens run as decode rows (``short`` = 1 + speculative_tokens: verify spans,
        whose rings keep that many rows more), unless marked ``Span.prefill``."""
        device = torch.device(device)
        n = token_ids.numel()
        segs: list[torch.Tensor] = []

        def put(t: torch.Tensor) -> int:
            segs.append(t.reshape(-1).to(torch.int64))
            return len(segs) - 1

        host_ids = token_ids.device.type == "cpu"
        at_ids = put(token_ids) if host_ids else None
        los, lo = [], 0
        for sp in spans:
            los.append(lo)
            lo += sp.num_tokens
        at_pos = put(torch.cat([torch.arange(sp.start, sp.end) for sp in spans]))
        meta = [
            [sp.slot for sp in spans],
            [sp.end for sp in spans],
            [lo + sp.num_tokens - 1 for sp, lo in zip(spans, los)],
        ]
        at_meta = put(torch.tensor(meta, dtype=torch.int64))
        at_reset = put(torch.tensor([sp.slot for sp in spans if sp.start == 0], dtype=torch.int64))
        rows_of = [cls.as_rows(sp, short) for sp in spans]
        single = [k for k, r in enumerate(rows_of) if r]
        longer = [k for k, r in enumerate(rows_of) if not r]
        rows, row_spans = [], []  # per row: token, position, slot, span start, end, first row
        for k in single:
            sp, first = spans[k], len(rows)
            for j in range(sp.num_tokens):
                rows.append([los[k] + j, sp.start + j, sp.slot, sp.start, sp.end, first])
                row_spans.append(k)
        at_dec = put(torch.tensor(rows, dtype=torch.int64).reshape(-1, 6).t())
        host_tables = all(spans[k].block_table.device.type == "cpu" for k in single)
        if single and host_tables:
            tabs = pad_sequence([spans[k].block_table.long() for k in single], True)
            at_dec_tables = put(tabs[[single.index(k) for k in row_spans]])
        host = None
        if longer:
            rs = sorted(set(ratios))
            host = PrefillHost(
                [spans[k] for k in longer],
                [los[k] for k in longer],
                n,
                window,
                ring,
                {r: (partial or {}).get(r, r) for r in rs},
                rs,
                put,
                overlap={CSA_RATIO} & set(rs),
                overlap_entries=entries,
            )
        parts = _upload(segs, device)
        ids = parts[at_ids] if host_ids else token_ids.reshape(-1)
        pos = parts[at_pos]
        meta_d = parts[at_meta].view(3, len(spans))
        prefill = host.resolve(parts, pos) if host is not None else None
        decode = dec_tok = None
        if single:
            dec_tok, dec_pos, dec_slots, r_start, r_end, r_first = parts[at_dec].view(6, -1)
            if host_tables:
                tables = parts[at_dec_tables].view(len(rows), -1)
            else:
                tables = pad_sequence([spans[k].block_table.to(device) for k in row_spans], True)
            several = any(spans[k].num_tokens > 1 for k in single)
            decode = DecodeBatch.on_device(
                ids[dec_tok],
                dec_slots,
                dec_pos,
                tables,
                max(spans[k].end for k in single),
                ratios=ratios,
                window=window,
                ring=ring,
                partial=partial,
                entries=entries,
                **(dict(start=r_start, end=r_end, first=r_first) if several else {}),
            )
        return cls(
            ids, pos, meta_d[0], meta_d[1], meta_d[2], parts[at_reset], prefill, decode, dec_tok
        )
