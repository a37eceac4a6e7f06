"""V4 decode batched across sequences: a forward whose spans are all one token long.

The same state rules as a prefill (``paged_attention``, module doc), applied to B sequences of
one token each, in shapes fixed by (B, max_end) and with masks instead of row lists, so that
nothing reads the device on the host and a CUDA graph can capture the forward
(``decode_graphs``). For the token at position p of each sequence:

  window keys  = ring rows of p - window + 1 .. p - 1 (those >= 0) + its own KV; its KV then
                 goes to ring row p % ring rows;
  compressor   = its raw (kv, score) goes to partial row p % r; every sequence's group is
                 pooled as it stands (at ratio 4 with the overlap fields, or nothing for group
                 0), and where the group completes at p (p % r == r - 1) its row p // r is
                 written to PAGE (and the indexer's key) and the overlap fields are refreshed;
                 the other sequences' rows and fields keep their bytes;
  rows         = an HCA layer attends every visible row [0, (p + 1) // r), a CSA layer exactly
                 ``index_topk`` of them by its indexer (short rows padded invalid), both
                 gathered per sequence from its blocks; rows [0, max_end // r) are scanned and
                 those a sequence cannot see are masked.

The math of each row, group and attention is the loop's (``V4Attention``, ``V4Compressor``,
``V4Indexer``); only reduction shapes differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atom.kernels import invariant, invariant_attention
from atom.kernels.attention import RingWindow, sink_attention_decode, sink_attention_usable
from atom.kernels.compressor_pool import compressor_pool
from atom.kernels.index_scores import index_scores_usable, tiled_index_scores
from atom.model_api import Span
from atom.models.common.forward_memo import ForwardMemo
from atom.models.common.selection import select_topk
from atom.models.common.storage import pack_index, unpack_index
from atom.models.deepseek_v4.attention import NEG_INF, V4Attention
from atom.models.deepseek_v4.paged import V4PagedKV, V4StateSlots


@dataclass
class RatioIndex:
    """What the layers of one compress ratio r read and write in a decode batch: fixed shapes
    (C = max_end // r rows per sequence), masks instead of lists of rows."""

    ids: torch.Tensor  # [B, C] row ids 0 .. C - 1
    valid: torch.Tensor  # [B, C] row < the sequence's visible count (p + 1) // r
    visible: torch.Tensor  # [B] that count
    phase: torch.Tensor  # [B] p % (r + k), the partial row the token's raw projections go to
    done: torch.Tensor  # [B] bool: the sequence's group completes at p
    group: torch.Tensor  # [B] group ids p // r
    first: torch.Tensor  # [B] bool: group 0 (no predecessor to overlap)
    members: torch.Tensor  # [B, r] the partial rows of the group's r positions
    prev_entry: torch.Tensor  # [B] the overlap entry of the group before (ratio 4)
    own_entry: torch.Tensor  # [B] the overlap entry the completed group goes to
    # rows of several-token spans: the row of the same span completing the row's group (it,
    # for a one-token span), whether that row is in the span; the row completing the group
    # before, whether it is in the span (never, for a one-token span)
    closer: torch.Tensor
    closes: torch.Tensor
    pred: torch.Tensor
    pred_in: torch.Tensor


@dataclass
class DecodeBatch(ForwardMemo):
    ids: torch.Tensor  # [B] the tokens
    slots: torch.Tensor  # [B]
    pos: torch.Tensor  # [B]
    tables: torch.Tensor  # [B, blocks] each sequence's block table, padded
    max_end: int  # rows scanned per ratio: max_end // r (at least every sequence's p + 1)
    ring_rows: torch.Tensor  # [B, window - 1] ring rows of p - window + 1 .. p - 1
    ring_valid: torch.Tensor  # [B, window - 1] those positions >= 0
    ring_own: torch.Tensor  # [B] p % ring rows
    ratios: dict[int, RatioIndex]
    # window keys of positions p - window + 1 .. p - 1 inside the row's own span: [B, window
    # - 1] whether, and the batch row holding it (rows of one span are consecutive)
    own_in: torch.Tensor
    own_row: torch.Tensor
    ends: torch.Tensor  # [B] each row's span end: the cursor its slot takes
    one_token: bool = True  # every span one token long (own_in all false)

    def window_mask(self) -> torch.Tensor:
        """[B, window]: the ring keys' validity, then the row's own key (always valid); once
        a forward."""

        def compute():
            own = torch.ones_like(self.ring_valid[:, :1])
            return torch.cat([self.ring_valid, own], 1)

        return self._once(("window_mask",), compute)

    def phase(self, r: int) -> torch.Tensor:
        """[B] the tokens' positions % r (a compressor's ``ape`` row), once a forward."""
        return self._once(("phase", r), lambda: self.pos % r)

    def rows(self) -> torch.Tensor:
        """[B] 0 .. B - 1, once a forward."""
        pos = self.pos
        return self._once(("rows",), lambda: torch.arange(pos.shape[0], device=pos.device))

    def visible_offsets(self, kv: V4PagedKV, layer: int, r: int) -> torch.Tensor:
        """``kv.row_offsets`` of rows [0, max_end // r) of every sequence in ``layer``'s main
        plane: the same in every layer whose plane has the same rows per block and strides
        (offsets count from each plane's first element), computed once a forward."""
        plane = kv.main[layer]
        key = ("visible_offsets", r, plane.shape[1], plane.stride(0), plane.stride(1))
        return self._once(key, lambda: kv.row_offsets(layer, self.tables, self.ratios[r].ids))

    def window_offsets(self, plane: torch.Tensor) -> torch.Tensor:
        """Element offsets [B, window - 1] from a layer's ring plane (``plane`` [slots, ring,
        hd], one layer's view) of the ring rows the keys come from: the same for every layer
        (their planes' strides are equal), computed once a forward."""
        s0, s1 = plane.stride(0), plane.stride(1)
        return self._once(
            ("window_offsets", s0, s1), lambda: self.slots[:, None] * s0 + self.ring_rows * s1
        )

    def cos_sin(self, rope, r: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``rope.cos_sin`` of the tokens' positions (r = 0) or of their groups' first
        positions at ratio r, once a forward per rope table (``Rope.table_key``) and ratio: the
        layers whose ropes share a table read the same tensors (``common.rope.Angles``)."""
        return self._once(
            ("angles", rope.table_key, r),
            lambda: rope.cos_sin(self.pos if r == 0 else self.ratios[r].group * r),
        )

    @staticmethod
    def usable(spans: list[Span]) -> bool:
        return bool(spans) and all(
            sp.num_tokens == 1 and sp.start > 0 and not sp.prefill for sp in spans
        )

    @classmethod
    def on_device(
        cls,
        ids: torch.Tensor,
        slots: torch.Tensor,
        pos: torch.Tensor,
        tables: torch.Tensor,
        max_end: int,
        *,
        ratios: list[int],
        window: int,
        ring: int,
        partial: dict[int, int] | None = None,
        entries: int = 1,
        start: torch.Tensor | None = None,
        end: torch.Tensor | None = None,
        first: torch.Tensor | None = None,
    ) -> DecodeBatch:
        """Every index from the batch's tensors with device ops only, in shapes fixed by
        (B, max_end): no host read, so a CUDA graph can capture it. ``tables`` must cover
        ``max_end`` positions. ``partial``: rows of each ratio's partial ring (r when absent),
        ``entries``: of each overlap field (``V4PoolGeometry``). ``start``/``end``/``first``
        [B]: each row's span and the batch row of its start, for spans of several tokens (a
        verify span: its rows consecutive); absent, every row is a one-token span."""
        dev = pos.device
        one_token = start is None
        if one_token:
            start, end, first = pos, pos + 1, torch.arange(pos.shape[0], device=dev)
        back = pos[:, None] - window + 1 + torch.arange(window - 1, device=dev)
        rows_b = pos.shape[0]

        def row_of(p: torch.Tensor) -> torch.Tensor:  # the batch row of position p, clamped
            return (first + p - start).clamp(0, rows_b - 1)

        per_ratio = {}
        for r in sorted(set(ratios)):
            count = max_end // r
            row_ids = torch.arange(count, device=dev)[None, :].expand(pos.shape[0], count)
            group = torch.div(pos, r, rounding_mode="floor")
            rows = (partial or {}).get(r, r)
            visible = torch.div(pos + 1, r, rounding_mode="floor")
            per_ratio[r] = RatioIndex(
                ids=row_ids,
                valid=row_ids < visible[:, None],
                visible=visible,
                phase=pos % rows,
                done=(pos + 1) % r == 0,
                group=group,
                first=group == 0,
                members=(group[:, None] * r + torch.arange(r, device=dev)) % rows,
                prev_entry=(group - 1) % entries,
                own_entry=group % entries,
                closer=row_of(group * r + r - 1),
                closes=group * r + r - 1 < end,
                pred=row_of(group * r - 1),
                pred_in=group * r - 1 >= start,
            )
        return cls(
            ids,
            slots,
            pos,
            tables,
            max_end,
            back.clamp(min=0) % ring,
            back >= 0,
            pos % ring,
            per_ratio,
            back >= start[:, None],
            (first[:, None] + back - start[:, None]).clamp(0, rows_b - 1),
            end,
            one_token,
        )

    @classmethod
    def build(
        cls,
        spans: list[Span],
        token_ids: torch.Tensor,
        ratios: list[int],
        window: int,
        ring: int,
        device,
        partial: dict[int, int] | None = None,
        entries: int = 1,
    ) -> DecodeBatch:
        """A decode forward's batch (every span one token at p = start > 0): positions,
        slots, padded tables and host token ids uploaded in one copy (device token ids stay
        where they are), then ``on_device`` with max_end = the largest p + 1."""
        width = max(sp.block_table.numel() for sp in spans)
        tables = torch.stack(
            [
                torch.cat([t := sp.block_table.cpu().long(), t[-1:].expand(width - t.numel())])
                for sp in spans
            ]
        )
        meta = torch.tensor([[sp.start for sp in spans], [sp.slot for sp in spans]])
        on_host = token_ids.device.type == "cpu"
        parts = [meta, tables] + ([token_ids.long()] if on_host else [])
        moved = _upload(parts, device)
        ids = moved[2] if on_host else token_ids.reshape(-1)
        max_end = max(sp.end for sp in spans)
        return cls.on_device(
            ids,
            moved[0][1],
            moved[0][0],
            moved[1],
            max_end,
            ratios=ratios,
            window=window,
            ring=ring,
            partial=partial,
            entries=entries,
        )


def _upload(tensors: list[torch.Tensor], device) -> list[torch.Tensor]:
    """Host int64 tensors to ``device`` in one copy (pinned on CUDA, so it does not block the
    host), as views of one buffer, each with its own shape."""
    flat = torch.cat([t.reshape(-1).long() for t in tensors])
    dev = torch.device(device)
    if dev.type == "cuda":
        flat = flat.pin_memory().to(dev, non_blocking=True)
    else:
        flat = flat.to(dev)
    out, lo = [], 0
    for t in tensors:
        out.append(flat[lo : lo + t.numel()].view(t.shape))
        lo += t.numel()
    return out


def decode_attention(
    attn: V4Attention, u: torch.Tensor, batch: DecodeBatch, kv: V4PagedKV, slots: V4StateSlots
) -> torch.Tensor:
    """u [B, d] (the normed sublayer input, one token per sequence) -> attention output
    [B, d]; updates the layer's ring, compressor state and PAGE rows as a prefill does."""
    cs = batch.cos_sin(attn.rope)
    q, qr = attn.queries(u, cs)
    win = attn.window_kv(u, cs)
    return attn.output(decode_core(attn, u, cs, q, qr, win, batch, kv, slots), cs)


def decode_core(
    attn: V4Attention, u, cs, q, qr, win, batch: DecodeBatch, kv: V4PagedKV, slots: V4StateSlots
) -> torch.Tensor:
    """The attention of the batch's tokens given their queries (q [B, H, hd], latent qr) and
    window KV, before the output projection: [B, H, hd]. Writes the ring, compressor state and
    PAGE rows. Where the decode kernel runs (``sink_attention_usable(q, "decode_attention")``,
    storage in q's dtype) it reads the ring's keys and the compressed rows where they lie;
    otherwise they are gathered and ``attn.attend`` computes the same attention."""
    ring_plane = slots.window[:, attn.layer]
    kernel = sink_attention_usable(q, "decode_attention") and ring_plane.dtype == win.dtype
    ids = valid = None
    if attn.ratio:
        ids, valid = _compressed(attn, u, qr, cs, batch, kv, slots)
        kernel = kernel and kv.main[attn.layer].dtype == q.dtype
    win_mask = batch.window_mask()
    if kernel and batch.one_token:
        win_k = RingWindow(ring_plane, batch.window_offsets(ring_plane), win)
    else:
        ring = slots.window[batch.slots[:, None], attn.layer, batch.ring_rows].to(win.dtype)
        if not batch.one_token:
            ring = torch.where(batch.own_in[:, :, None], win[batch.own_row], ring)
        win_k = torch.cat([ring, win[:, None]], 1)
    if kernel:
        plane = offsets = None
        if ids is not None:
            plane = kv.main[attn.layer]
            if attn.indexer is None:  # every visible row: the HCA layers of a ratio share them
                offsets = batch.visible_offsets(kv, attn.layer, attn.ratio)
            else:
                offsets = kv.row_offsets(attn.layer, batch.tables, ids)
        out = sink_attention_decode(
            q, win_k, win_mask, plane, offsets, valid, attn.attn_sink, attn.scale
        )
    else:
        comp = None if ids is None else kv.gather_rows(attn.layer, batch.tables, ids).to(q.dtype)
        out = attn.attend(q, win_k, win_mask, comp, valid)
    slots.window[batch.slots, attn.layer, batch.ring_own] = win.to(slots.window.dtype)
    return out


def _pool_completed(comp, u, batch: DecodeBatch, ri: RatioIndex, state):
    """Append the batch's raw projections to the partial groups and pool every sequence's
    group as it stands (only those completing at p, ``ri.done``, are kept by the caller);
    refresh the overlap fields of the completing ones at ratio 4. Returns pooled [B, dim]."""
    overlap, partial = state
    if batch.one_token:  # one kernel where it runs (atom.kernels.compressor_pool)
        kv_raw, score_raw = comp.project(u)
        fields = dict(ape=comp.ape, ape_row=batch.phase(comp.ratio))
        if comp.overlap:
            fields.update(overlap=overlap, prev_entry=ri.prev_entry, own_entry=ri.own_entry)
            fields.update(first=ri.first, closes=ri.closes)
        return compressor_pool(
            kv_raw, score_raw, partial, batch.slots, ri.phase, ri.members, **fields
        )
    kv_raw, score_raw = comp.raw(u, batch.pos)
    partial[0][batch.slots, ri.phase] = kv_raw
    partial[1][batch.slots, ri.phase] = score_raw
    members = batch.slots[:, None], ri.members
    kvg, scg = partial[0][members], partial[1][members]  # [B, r, width]
    prev = (None, None)
    if comp.overlap:
        d, first = comp.dim, ri.first[:, None, None]
        held, into = (batch.slots, ri.prev_entry), (batch.slots, ri.own_entry)
        # the group before: completed by an earlier row of the span, else in the fields
        pred_in = ri.pred_in[:, None, None]
        old = (
            torch.where(pred_in, kvg[ri.pred, :, :d], overlap[0][held]),
            torch.where(pred_in, scg[ri.pred, :, :d], overlap[1][held]),
        )
        mine = (kvg[ri.closer, :, :d], scg[ri.closer, :, :d])
        # old is this forward's own (a gather or a select): group 0's predecessor in place
        prev = (old[0].masked_fill_(first, 0.0), old[1].masked_fill_(first, NEG_INF))
        # every row of a group writes what the row completing it writes (or the bytes there,
        # when no row of the span completes it): rows sharing an entry write the same values
        closes = ri.closes[:, None, None]
        overlap[0][into] = torch.where(closes, mine[0], overlap[0][into])
        overlap[1][into] = torch.where(closes, mine[1], overlap[1][into])
    return comp.pool(kvg, scg, *prev)


def _compressed(attn: V4Attention, u, qr, cs, batch: DecodeBatch, kv, slots: V4StateSlots):
    """(ids of the rows to attend [B, K], their mask [B, K]) after writing the rows of the
    groups completing at p (the other sequences' rows keep their bytes)."""
    r, layer = attn.ratio, attn.layer
    ri = batch.ratios[r]
    pooled = _pool_completed(attn.compressor, u, batch, ri, slots.compressor_fields(layer, r))
    rows_cs = batch.cos_sin(attn.rope, r)
    # each row writes its closer's row (a one-token row writes only its own, where it closes)
    own = batch.one_token
    main = attn.main_rows(pooled, rows_cs)
    main = main if own else main[ri.closer]
    ix = attn.indexer
    if ix is None:  # HCA: every visible row
        kv.write_main_where(layer, batch.tables, ri.group, ri.closes, main)
        return ri.ids, ri.valid
    index_state = slots.compressor_fields(layer, r, index=True)
    pooled_i = _pool_completed(ix.compressor, u, batch, ri, index_state)
    keys = ix.compressor.rows(pooled_i, attn.rope, rows_cs)
    keys = keys if own else keys[ri.closer]
    payload, scale = pack_index(keys, kv.geometry.index_dtype)
    kv.write_rows_where(layer, batch.tables, ri.group, ri.closes, main, payload, scale)
    payload, scale = kv.read_index_rows(layer, batch.tables, ri.ids.shape[1])
    qi, w = ix.query(qr, u, attn.rope, cs)
    keys = unpack_index(payload, scale)  # [B, C, D]
    if invariant.enabled():
        scores = invariant_attention.index_scores(qi, w, keys).masked_fill(~ri.valid, NEG_INF)
    elif index_scores_usable(qi):  # one kernel: each row its own tile of keys, as in prefill
        rows = batch.rows()
        scores = tiled_index_scores(qi, w, keys, rows, ri.visible)
    else:
        scores = torch.einsum("th,thr->tr", w, torch.relu(torch.einsum("thd,trd->thr", qi, keys)))
        scores = scores.masked_fill(~ri.valid, NEG_INF)
    sel = select_topk(scores, ix.topk, fixed=True)
    picked = torch.where(sel[1], sel[0], torch.zeros_like(sel[0]))
    return picked, sel[1]
