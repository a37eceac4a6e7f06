"""CSA2 attention of one layer over a paged batch: window rings, compressor rings, PAGE rows.

For a span [s, e) of a sequence (positions pos, T = e - s tokens):
  window keys = ring rows of [max(0, s - window + 1), s) + this span's own KV; after attending,
      the span's last ``window_rows`` KV rows are written to the ring;
  FULL owners complete groups [s // r, e // r); a group straddling s takes its earlier tokens'
      raw projections from the compressor ring; the rows go to PAGE, the ring is refreshed;
  every compressed layer reads its owner's rows [0, e // r) from PAGE and attends the top-k
      selection of its index-source layer (computed here on FULL/REINDEX layers, carried in
      the batch to REUSE layers of the same forward).

All multi-token spans of a forward run together (``PrefillBatch``, built on the host by
``prefill_plan``): one set of batched operations per layer, whatever the number of sequences.
Every span's rows are written before any span reads (spans of one forward are different
sequences: they share no rows being written). Single-token spans (decode) take the batched path
of ``paged_decode``.
"""

from __future__ import annotations

import torch

from atom.kernels.attention import sink_attention_usable
from atom.models.common.prefill_plan import PrefillBatch
from atom.models.common.prefill_tiles import TiledKeys, kernel_tile_attention, tile_groups
from atom.models.common.rope import Angles
from atom.models.common.storage import pack_index, unpack_index
from atom.models.deepseek_v41.attention import (
    CSA2Attention,
    layer_selection,
    picked_ids,
    visible_rows,
)
from atom.models.deepseek_v41.config import LayerMode
from atom.models.deepseek_v41.paged import PagedKV, StateSlots
from atom.models.deepseek_v41.paged_decode import DecodeBatch, decode_attention


def _update_compressor(
    attn: CSA2Attention, u: torch.Tensor, b: PrefillBatch, kv: PagedKV, slots: StateSlots
) -> None:
    """Complete the owner's groups ending inside the spans; write rows and refresh the rings."""
    geo, r = kv.geometry, attn.ratio
    plan = b.comp[r]
    o = geo.index_planes.index(geo.index_plane(attn.layer))
    values, scores = attn.compressor.raw(u)  # [N, hd] float32
    if plan.g_row.numel():
        v = torch.cat([slots.comp_values[plan.c_slot, o, plan.c_row], values])[plan.g_src]
        sc = None
        if scores is not None:
            sc = torch.cat([slots.comp_scores[plan.c_slot, o, plan.c_row], scores])[plan.g_src]
        latents = attn.compressor.pool(v, sc)
        main, keys = attn.compressed_rows(latents, attn.rope.cos_sin(plan.g_row * r))
        payload, scale = pack_index(keys, geo.index_dtype)
        kv.write_rows_of(attn.layer, b.tables, plan.g_span, plan.g_row, main, payload, scale)
    if r > 1:
        slots.comp_values[plan.rr_slot, o, plan.rr_row] = values[plan.rr_src]
        if scores is not None:
            slots.comp_scores[plan.rr_slot, o, plan.rr_row] = scores[plan.rr_src]


def prefill_attention(
    attn: CSA2Attention,
    u: torch.Tensor,
    cs: tuple[torch.Tensor, torch.Tensor],
    q: torch.Tensor,
    qlat: torch.Tensor,
    win: torch.Tensor,
    b: PrefillBatch,
    kv: PagedKV,
    slots: StateSlots,
    out: torch.Tensor,
) -> None:
    """Fill ``out`` [N, H, hd] at the prefill tokens; write their rows and ring rows."""
    layer, nt, tq = attn.layer, b.num_tiles, b.q
    win_l = b.take(win)
    ring = slots.window[b.ring_slot, layer, b.ring_row].to(win.dtype)
    win_k = torch.cat([ring, win_l])[b.win_src]  # [nt, L, hd]
    mask = b.window_mask(attn.window)
    ids = valid = None
    if attn.ratio > 0:
        u_l = b.take(u)
        if attn.mode is LayerMode.FULL:
            _update_compressor(attn, u_l, b, kv, slots)
        if attn.mode in (LayerMode.FULL, LayerMode.REINDEX):
            count = b.rows[attn.ratio]
            keys = unpack_index(*kv.read_index_rows(attn.kv_owner, b.tables, count))
            visible = visible_rows(b.positions, attn.ratio)
            sel, cand = layer_selection(
                attn,
                b.take(qlat),
                u_l,
                (b.take(cs[0]), b.take(cs[1])),
                TiledKeys(keys, b, visible),
                visible,
                b.candidates,
                fixed_k=True,
            )
            b.selections[attn.layer] = sel
            if cand is not None:
                b.candidates = cand
        sel = b.selections[attn.sel_owner]
        ids, valid = picked_ids(sel)[b.pad_src], sel[1][b.pad_src]
    q_p = b.take(q)[b.pad_src]  # [P, H, hd]
    heads, hd = q.shape[1], q.shape[2]
    k = 0 if ids is None else ids.shape[1]
    res = []
    if sink_attention_usable(q):  # one pass over every tile, nothing materialized per query
        plane = offsets = None
        if ids is not None:
            plane = kv.main[attn.kv_owner]
            picks = ids.view(nt, tq * k)
            offsets = kv.row_offsets(attn.kv_owner, b.tables[b.tile_span], picks).view(-1, k)
        sink, scale = attn.attn_sink, attn.scale
        res.append(
            kernel_tile_attention(q_p, win_k, mask, plane, offsets, valid, sink, scale, attn.window)
        )
    groups = [] if res else tile_groups(nt, tq * heads * (win_k.shape[1] + k + 1))
    for t0, t1 in groups:
        a, z = t0 * tq, t1 * tq
        comp = None
        if ids is not None:
            picks = ids[a:z].reshape(t1 - t0, tq * k)
            tables = b.tables[b.tile_span[t0:t1]]
            comp = kv.gather_rows(attn.kv_owner, tables, picks).view(z - a, k, hd).to(q.dtype)
        qs = q_p[a:z].view(t1 - t0, tq, heads, hd)
        res.append(
            attn.attend_tiles(
                qs,
                win_k[t0:t1],
                mask[t0:t1],
                comp,
                None if valid is None else valid[a:z],
                window=attn.window,
            )
        )
    o = torch.cat(res)[b.unpad]
    if b.all_tokens:
        out.copy_(o)
    else:
        out[b.tok] = o
    slots.window[b.ww_slot, layer, b.ww_row] = win_l[b.ww_src].to(slots.window.dtype)


def paged_attention(
    attn: CSA2Attention,
    u: torch.Tensor,
    angles: Angles,
    seqs: list[PrefillBatch],
    decode: DecodeBatch | None,
    kv: PagedKV,
    slots: StateSlots,
) -> torch.Tensor:
    """u [N, d] (normed sublayer input of the whole flat batch) -> attention output [N, d].
    ``angles``: the forward's positions' RoPE angles (shared by the layers), ``seqs``: the
    multi-token spans as one batch (or none), ``decode``: the single-token ones."""
    cs = angles.of(attn.rope)
    q, qlat = attn.queries(u, cs)
    win = attn.window_kv(u, cs)
    if decode is not None and decode.all_rows:  # a decode step: its rows are the output
        if seqs:
            raise ValueError("a decode batch of all rows beside prefill spans")
        return attn.output(decode_attention(attn, u, cs, q, qlat, win, decode, kv, slots), cs)
    out = torch.empty_like(q)
    for batch in seqs:
        prefill_attention(attn, u, cs, q, qlat, win, batch, kv, slots, out)
    if decode is not None:
        out[decode.idx] = decode_attention(attn, u, cs, q, qlat, win, decode, kv, slots)
    return attn.output(out, cs)
