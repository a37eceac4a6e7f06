"""CSA2 attention of one layer over a paged batch: window rings, compressor rings, PAGE rows.

Per sequence, for its span [s, e) (positions pos, T = e - s tokens):
  window keys = ring rows of [max(0, s - window + 1), s) + this span's own KV; after attending,
      the span's last ``window_rows`` KV rows are written to the ring;
  FULL owners complete groups [s // r, e // r); a group straddling s takes its earlier tokens'
      raw projections from the compressor ring; the rows go to PAGE, the ring is refreshed;
  every compressed layer reads its owner's rows [0, e // r) from PAGE and attends the top-k
      selection of its index-source layer (computed here on FULL/REINDEX layers, carried in
      ``SeqCarry`` to REUSE layers of the same forward).

Single-token spans (decode) take the batched path of ``paged_decode`` instead of this loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from atom.model_api import Span
from atom.models.deepseek_v41.attention import (
    CSA2Attention,
    gather_selected,
    layer_selection,
    visible_rows,
    window_mask,
)
from atom.models.deepseek_v41.config import LayerMode
from atom.models.deepseek_v41.paged import PagedKV, StateSlots
from atom.models.deepseek_v41.paged_decode import DecodeBatch, decode_attention
from atom.models.deepseek_v41.quant import pack_index, unpack_index


@dataclass
class SeqCarry:
    """One sequence's per-forward context; selections flow from index layers to REUSE layers."""

    span: Span
    lo: int  # offset of the span's first token in the flat batch
    positions: torch.Tensor
    selections: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    candidates: torch.Tensor | None = None

    @property
    def hi(self) -> int:
        return self.lo + self.span.num_tokens


def _update_compressor(
    attn: CSA2Attention, u: torch.Tensor, seq: SeqCarry, kv: PagedKV, slots: StateSlots, cs_fn
) -> None:
    """Complete the owner's groups ending inside the span; write rows and refresh the ring."""
    geo, span = kv.geometry, seq.span
    s, e, r = span.start, span.end, attn.ratio
    o = geo.index_planes.index(geo.index_plane(attn.layer))
    ring_v, ring_s = slots.comp_values[span.slot, o], slots.comp_scores[span.slot, o]
    rc = geo.compressor_rows
    values, scores = attn.compressor.raw(u)
    first_tok = (s // r) * r
    if first_tok < s:  # a group straddles the previous forward
        carried = torch.arange(first_tok, s, device=u.device) % rc
        values = torch.cat([ring_v[carried], values])
        if scores is not None:
            scores = torch.cat([ring_s[carried], scores])
    groups = e // r - s // r
    if groups > 0:
        n = groups * r
        v = values[:n].view(groups, r, -1)
        sc = scores[:n].view(groups, r, -1) if scores is not None else None
        latents = attn.compressor.pool(v, sc)
        rows = torch.arange(s // r, e // r, device=u.device)
        main, keys = attn.compressed_rows(latents, cs_fn(rows * r))
        payload, scale = pack_index(keys, geo.index_dtype)
        kv.write_rows(attn.layer, span.block_table, rows, main, payload, scale)
    if r > 1:
        keep = min(rc, e - s)
        pos = torch.arange(e - keep, e, device=u.device)
        tail = values[-keep:]
        ring_v[pos % rc] = tail
        if scores is not None:
            ring_s[pos % rc] = scores[-keep:]


def paged_attention(
    attn: CSA2Attention,
    u: torch.Tensor,
    positions: torch.Tensor,
    seqs: list[SeqCarry],
    decode: DecodeBatch | None,
    kv: PagedKV,
    slots: StateSlots,
) -> torch.Tensor:
    """u [N, d] (normed sublayer input of the whole flat batch) -> attention output [N, d].
    ``seqs`` are the multi-token spans, ``decode`` the single-token ones."""
    cs = attn.rope.cos_sin(positions)
    q, qlat = attn.queries(u, cs)
    win = attn.window_kv(u, cs)
    geo = kv.geometry
    rw, window = geo.window_rows, attn.window
    out = torch.empty_like(q)
    for seq in seqs:
        span, lo, hi = seq.span, seq.lo, seq.hi
        s, e, pos = span.start, span.end, seq.positions
        ring = slots.window[span.slot, attn.layer]
        prev = torch.arange(max(0, s - window + 1), s, device=u.device)
        win_k = torch.cat([ring[prev % rw].to(win.dtype), win[lo:hi]])
        mask = window_mask(pos, torch.cat([prev, pos]), window)
        comp = valid = None
        if attn.ratio > 0:
            if attn.mode is LayerMode.FULL:
                _update_compressor(attn, u[lo:hi], seq, kv, slots, attn.rope.cos_sin)
            count = e // attn.ratio
            main, payload, scale = kv.read_rows(attn.kv_owner, span.block_table, count)
            rows = main.to(q.dtype)
            if attn.mode in (LayerMode.FULL, LayerMode.REINDEX):
                sel, cand = layer_selection(
                    attn,
                    qlat[lo:hi],
                    u[lo:hi],
                    (cs[0][lo:hi], cs[1][lo:hi]),
                    unpack_index(payload, scale),
                    visible_rows(pos, attn.ratio),
                    seq.candidates,
                )
                seq.selections[attn.layer] = sel
                if cand is not None:
                    seq.candidates = cand
            sel = seq.selections[attn.sel_owner]
            comp, valid = gather_selected(rows, sel), sel[1]
        out[lo:hi] = attn.attend(q[lo:hi], win_k, mask, comp, valid)
        keep = min(rw, e - s)
        ring[torch.arange(e - keep, e, device=u.device) % rw] = win[hi - keep : hi].to(ring.dtype)
    if decode is not None:
        decode_attention(attn, u, cs, q, qlat, win, decode, kv, slots, out)
    return attn.output(out, cs)
