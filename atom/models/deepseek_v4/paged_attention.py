"""V4 attention of one layer over a paged batch: window rings, compressor state, PAGE rows.

Per sequence, for its span [s, e) (positions pos):
  window keys = ring rows of [max(0, s - window + 1), s) + this span's own KV; after attending,
      the span's last ``window_rows`` KV rows are written to the ring;
  a compressed layer completes groups [s // r, e // r): a group straddling s takes its earlier
      tokens' raw projections from the scratch, a CSA group also its predecessor's first halves
      from the slot's overlap fields; finished rows (and a CSA layer's indexer keys) go to PAGE,
      the overlap fields and the scratch are refreshed;
  a CSA layer attends the top ``index_topk`` of its rows [0, e // 4) by its indexer's scores, an
      HCA layer every visible row, both read from PAGE.

A forward whose spans are all one token long (decode) runs batched instead (``paged_decode``:
the same rules over the whole batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atom.model_api import Span
from atom.models.common.selection import (
    mask_invisible,
    picked_ids,
    select_topk,
    visible_rows,
    window_mask,
)
from atom.models.common.storage import pack_index, unpack_index
from atom.models.deepseek_v4.attention import V4Attention, V4Compressor, V4Indexer, overlap_prev
from atom.models.deepseek_v4.paged import V4PagedKV, V4StateSlots


@dataclass
class SeqCarry:
    """One sequence's context in a paged forward (the forward loops over these).

    ``table`` is the span's block table on the model's device: PAGE rows are located on the
    device with device group ids, and ``Span.block_table`` may be a host tensor (the engine
    builds tables on the host)."""

    span: Span
    lo: int  # offset of the span's first token in the flat batch
    positions: torch.Tensor
    table: torch.Tensor

    @property
    def hi(self) -> int:
        return self.lo + self.span.num_tokens


def compress_span(
    comp: V4Compressor,
    u: torch.Tensor,
    pos: torch.Tensor,
    start: int,
    end: int,
    overlap: tuple[torch.Tensor, torch.Tensor] | None,
    partial: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Complete the groups ending inside [start, end); refresh the overlap and partial state.
    Returns (group ids [G], pooled [G, dim] float32, or None when no group completes)."""
    r = comp.ratio
    kv, score = comp.raw(u, pos)
    k = start % r
    if k:  # the current group began in an earlier forward
        kv = torch.cat([partial[0][:k], kv])
        score = torch.cat([partial[1][:k], score])
    g0, g1 = start // r, end // r
    n = (g1 - g0) * r
    pooled = None
    if n:
        kvg, scg = kv[:n].view(g1 - g0, r, -1), score[:n].view(g1 - g0, r, -1)
        prev = (None, None)
        if comp.overlap:
            first = (overlap[0], overlap[1]) if g0 > 0 else None
            prev = overlap_prev(kvg, scg, first, comp.dim)
            overlap[0].copy_(kvg[-1, :, : comp.dim])
            overlap[1].copy_(scg[-1, :, : comp.dim])
        pooled = comp.pool(kvg, scg, *prev)
    tail = end - g1 * r
    if tail:
        partial[0][:tail] = kv[n:]
        partial[1][:tail] = score[n:]
    return torch.arange(g0, g1, device=u.device), pooled


def _compressed(attn: V4Attention, u, qr, cs, seq: SeqCarry, kv: V4PagedKV, slots: V4StateSlots):
    """Update the layer's rows for the span, then (rows to attend, their mask) per query."""
    span, pos, r = seq.span, seq.positions, attn.ratio
    s, e, table, layer = span.start, span.end, seq.table, attn.layer
    overlap, partial = slots.compressor_state(span.slot, layer, r, index=False)
    groups, pooled = compress_span(attn.compressor, u, pos, s, e, overlap, partial)
    rows_cs = attn.rope.cos_sin(groups * r)
    ix = attn.indexer
    if ix is None:
        if pooled is not None:
            kv.write_main(layer, table, groups, attn.main_rows(pooled, rows_cs))
        count = e // r
        rows = kv.read_main(layer, table, count)
        return rows, torch.arange(count, device=u.device)[None, :] < visible_rows(pos, r)[:, None]
    overlap, partial = slots.compressor_state(span.slot, layer, r, index=True)
    _, pooled_i = compress_span(ix.compressor, u, pos, s, e, overlap, partial)
    if pooled is not None:
        keys = ix.compressor.rows(pooled_i, attn.rope, rows_cs)
        payload, scale = pack_index(keys, kv.geometry.index_dtype)
        kv.write_rows(layer, table, groups, attn.main_rows(pooled, rows_cs), payload, scale)
    main, payload, scale = kv.read_rows(layer, table, e // r)
    qi, w = ix.query(qr, u, attn.rope, cs)
    scores = V4Indexer.scores(qi, w, unpack_index(payload, scale))
    sel = select_topk(mask_invisible(scores, visible_rows(pos, r)), ix.topk)
    return main[picked_ids(sel)], sel[1]


def paged_attention(
    attn: V4Attention,
    u: torch.Tensor,
    positions: torch.Tensor,
    seqs: list[SeqCarry],
    kv: V4PagedKV | None,
    slots: V4StateSlots,
) -> torch.Tensor:
    """u [N, d] (normed sublayer input of the whole flat batch) -> attention output [N, d].
    A window-only layer (the MTP draft layers among them) never reads ``kv``."""
    cs = attn.rope.cos_sin(positions)
    q, qr = attn.queries(u, cs)
    win = attn.window_kv(u, cs)
    rw, window = slots.geometry.window_rows, attn.window
    out = torch.empty_like(q)
    for seq in seqs:
        span, lo, hi = seq.span, seq.lo, seq.hi
        s, e, pos = span.start, span.end, seq.positions
        ring = slots.window[span.slot, attn.layer]
        prev = torch.arange(max(0, s - window + 1), s, device=u.device)
        win_k = torch.cat([ring[prev % rw].to(win.dtype), win[lo:hi]])
        mask = window_mask(pos, torch.cat([prev, pos]), window)
        comp = comp_mask = None
        if attn.ratio:
            cs_seq = (cs[0][lo:hi], cs[1][lo:hi])
            comp, comp_mask = _compressed(attn, u[lo:hi], qr[lo:hi], cs_seq, seq, kv, slots)
            comp = comp.to(q.dtype)
        out[lo:hi] = attn.attend(q[lo:hi], win_k, mask, comp, comp_mask)
        keep = min(rw, e - s)
        ring[torch.arange(e - keep, e, device=u.device) % rw] = win[hi - keep : hi].to(ring.dtype)
    return attn.output(out, cs)
