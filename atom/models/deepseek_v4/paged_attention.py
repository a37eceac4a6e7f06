"""V4 attention of one layer over a paged batch: window rings, compressor state, PAGE rows.

For a span [s, e) of a sequence (positions pos):
  window keys = ring rows of [max(0, s - window + 1), s) + this span's own KV; after attending,
      the span's last ``window_rows`` KV rows are written to the ring;
  a compressed layer completes groups [s // r, e // r): a group straddling s takes its earlier
      tokens' raw projections from the partial rows (row = position % r), a CSA group also its
      predecessor's first halves (the group before it in the span, else the slot's overlap
      fields); finished rows (and a CSA layer's indexer keys) go to PAGE, the overlap fields
      take the span's last completed group and the partial rows the span's last tokens;
  a CSA layer attends the top ``index_topk`` of its rows [0, e // 4) by its indexer's scores, an
      HCA layer every visible row, both read from PAGE.

All multi-token spans of a forward run together (``PrefillBatch``, the tile plan built on the
host by ``forward_plan``): one set of batched operations per layer, whatever the number of
sequences. Every span's rows are written before any span reads them (the spans of one forward
are different sequences: they write no row another one reads). The single-token spans of the
forward run the decode path (``paged_decode``: the same rules over a batch of one token each).
"""

from __future__ import annotations

import torch

from atom.kernels.attention import sink_attention_usable
from atom.models.common.prefill_plan import CompressorPlan, PrefillBatch
from atom.models.common.prefill_tiles import (
    NEG_INF,
    TiledKeys,
    kernel_tile_attention,
    tile_attention,
    tile_groups,
)
from atom.models.common.selection import mask_invisible, picked_ids, select_topk, visible_rows
from atom.models.common.storage import pack_index, unpack_index
from atom.models.deepseek_v4.attention import V4Attention, V4Compressor
from atom.models.deepseek_v4.forward_plan import V4ForwardPlan
from atom.models.deepseek_v4.paged import V4PagedKV, V4StateSlots
from atom.models.deepseek_v4.paged_decode import decode_core


def complete_groups(
    comp: V4Compressor, u: torch.Tensor, b: PrefillBatch, state
) -> tuple[CompressorPlan, torch.Tensor | None]:
    """Pool the groups completing in the spans (u [Np, d]: the prefill tokens' sublayer input)
    and refresh the overlap fields and partial rows. Returns (the ratio's plan, pooled [G, dim]
    float32, or None when no group completes)."""
    plan = b.comp[comp.ratio]
    overlap, partial = state
    kv_raw, score_raw = comp.raw(u, b.positions)
    pooled = None
    if plan.g_row.numel():
        kvg = torch.cat([partial[0][plan.c_slot, plan.c_row], kv_raw])[plan.g_src]
        scg = torch.cat([partial[1][plan.c_slot, plan.c_row], score_raw])[plan.g_src]
        prev = (None, None)
        if comp.overlap:
            d, r, entries = comp.dim, comp.ratio, overlap[0].shape[1]
            empty_kv = kvg.new_zeros(1, r, d)
            empty_sc = kvg.new_full((1, r, d), NEG_INF)
            held = plan.ov_slots, plan.ov_group % entries
            src_kv = torch.cat([overlap[0][held], empty_kv, kvg[:, :, :d]])
            src_sc = torch.cat([overlap[1][held], empty_sc, scg[:, :, :d]])
            prev = (src_kv[plan.prev_src], src_sc[plan.prev_src])
            into = plan.ow_slot, plan.ow_group % entries
            overlap[0][into] = kvg[plan.ow_src, :, :d]
            overlap[1][into] = scg[plan.ow_src, :, :d]
        pooled = comp.pool(kvg, scg, *prev)
    partial[0][plan.rr_slot, plan.rr_row] = kv_raw[plan.rr_src]
    partial[1][plan.rr_slot, plan.rr_row] = score_raw[plan.rr_src]
    return plan, pooled


def _selection(attn: V4Attention, u_l, qr_l, cs_l, b: PrefillBatch, kv, slots):
    """Write the layer's completed rows, then (row ids [Np, K], valid [Np, K]) each prefill
    token attends, or None when no sequence has a row yet."""
    r, layer = attn.ratio, attn.layer
    plan, pooled = complete_groups(attn.compressor, u_l, b, slots.compressor_fields(layer, r))
    rows_cs = attn.rope.cos_sin(plan.g_row * r)
    ix, count = attn.indexer, b.rows[r]
    visible = visible_rows(b.positions, r)
    if ix is None:  # HCA: every visible row
        if pooled is not None:
            kv.write_main_of(
                layer, b.tables, plan.g_span, plan.g_row, attn.main_rows(pooled, rows_cs)
            )
        if count == 0:
            return None
        ids = torch.arange(count, device=u_l.device)[None, :].expand(u_l.shape[0], count)
        return ids, ids < visible[:, None]
    index_state = slots.compressor_fields(layer, r, index=True)
    _, pooled_i = complete_groups(ix.compressor, u_l, b, index_state)
    if pooled is not None:
        keys = ix.compressor.rows(pooled_i, attn.rope, rows_cs)
        payload, scale = pack_index(keys, kv.geometry.index_dtype)
        main = attn.main_rows(pooled, rows_cs)
        kv.write_rows_of(layer, b.tables, plan.g_span, plan.g_row, main, payload, scale)
    if count == 0:
        return None
    keys = unpack_index(*kv.read_index_rows(layer, b.tables, count))  # [S, C, D]
    qi, w = ix.query(qr_l, u_l, attn.rope, cs_l)
    scores = mask_invisible(TiledKeys(keys, b, visible).index_scores(qi, w), visible)
    sel = select_topk(scores, ix.topk)
    return picked_ids(sel), sel[1]


def prefill_attention(
    attn: V4Attention, u, cs, q, qr, win, b: PrefillBatch, kv: V4PagedKV, slots: V4StateSlots
) -> torch.Tensor:
    """The attention output [Np, H, hd] of the prefill tokens; writes their rows and ring
    rows."""
    layer, nt, tq = attn.layer, b.num_tiles, b.q
    win_l = b.take(win)
    ring = slots.window[b.ring_slot, layer, b.ring_row].to(win.dtype)
    win_k = torch.cat([ring, win_l])[b.win_src]  # [nt, L, hd]
    mask = b.window_mask(attn.window)
    ids = valid = None
    if attn.ratio:
        cs_l = (b.take(cs[0]), b.take(cs[1]))
        picked = _selection(attn, b.take(u), b.take(qr), cs_l, b, kv, slots)
        if picked is not None:
            ids, valid = picked[0][b.pad_src], picked[1][b.pad_src]
    q_p = b.take(q)[b.pad_src]  # [P, H, hd]
    heads, hd = q.shape[1], q.shape[2]
    k = 0 if ids is None else ids.shape[1]
    res = []
    plane = None if ids is None else kv.main[layer]
    if sink_attention_usable(q) and (plane is None or plane.dtype == q.dtype):
        offsets = None
        if ids is not None:
            picks = ids.reshape(nt, tq * k)
            offsets = kv.row_offsets(layer, b.tables[b.tile_span], picks).view(-1, k)
        res.append(
            kernel_tile_attention(
                q_p, win_k, mask, plane, offsets, valid, attn.attn_sink, attn.scale, attn.window
            )
        )
    groups = [] if res else tile_groups(nt, tq * heads * (win_k.shape[1] + k + 1))
    for t0, t1 in groups:
        a, z = t0 * tq, t1 * tq
        comp = None
        if ids is not None:
            picks = ids[a:z].reshape(t1 - t0, tq * k)
            tables = b.tables[b.tile_span[t0:t1]]
            comp = kv.gather_rows(layer, tables, picks).view(z - a, k, hd).to(q.dtype)
        qs = q_p[a:z].view(t1 - t0, tq, heads, hd)
        valid_g = None if valid is None else valid[a:z]
        res.append(
            tile_attention(
                qs,
                win_k[t0:t1],
                mask[t0:t1],
                comp,
                valid_g,
                attn.attn_sink,
                attn.scale,
                attn.window,
            )
        )
    slots.window[b.ww_slot, layer, b.ww_row] = win_l[b.ww_src].to(slots.window.dtype)
    return torch.cat(res)[b.unpad]


def paged_attention(
    attn: V4Attention,
    u: torch.Tensor,
    plan: V4ForwardPlan,
    kv: V4PagedKV | None,
    slots: V4StateSlots,
) -> torch.Tensor:
    """u [N, d] (normed sublayer input of the whole flat batch) -> attention output [N, d].
    A window-only layer (the MTP draft layers among them) never reads ``kv``."""
    cs = attn.rope.cos_sin(plan.positions)
    q, qr = attn.queries(u, cs)
    win = attn.window_kv(u, cs)
    out = torch.empty_like(q)
    b = plan.prefill
    if b is not None:
        o = prefill_attention(attn, u, cs, q, qr, win, b, kv, slots)
        if b.all_tokens:
            out.copy_(o)
        else:
            out[b.tok] = o
    if plan.decode is not None:
        t = plan.dec_tok
        o = decode_core(
            attn, u[t], (cs[0][t], cs[1][t]), q[t], qr[t], win[t], plan.decode, kv, slots
        )
        out[t] = o
    return attn.output(out, cs)
