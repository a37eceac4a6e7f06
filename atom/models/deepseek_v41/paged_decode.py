"""CSA2 attention of a forward's decode rows, batched across sequences: its single-token spans,
and its verify spans (at most 1 + k tokens past 0) row by row where a spare block takes the
writes of rows that complete no group (``DecodeBatch.start``, ``dump_block``).

The per-sequence loop of ``paged_attention`` launches some hundred small kernels per sequence
per layer; a decode step of 16 sequences spent most of its time launching them. Here every
single-token span of the forward runs through one set of batched operations per layer, with the
same math as the loop for a span [p, p + 1):

  window keys: the ring rows of positions p - window + 1 .. p - 1 (those before 0 masked) and
      p's own KV: always ``window`` keys;
  a FULL owner's group completing at p ((p + 1) % ratio == 0) is pooled from the compressor
      ring's earlier tokens and p's projection and written to PAGE; sequences whose group does
      not complete keep their row bytes (selected on the device: no host sync);
  index keys: rows [0, R) of every sequence, R the batch's largest row count; rows at or past a
      sequence's own count are invisible to it; the selection is padded to exactly
      ``index_topk`` picks, and only the picked main rows are gathered from PAGE.

Every shape a token's arithmetic sees is fixed by the config (window, index_topk), not by the
other sequences in its batch, except the indexer's row axis, which only ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn.utils.rnn import pad_sequence

from atom.kernels.attention import RingWindow, sink_attention_decode, sink_attention_usable
from atom.models.common.forward_memo import ForwardMemo
from atom.models.common.glue_compile import region
from atom.models.common.storage import pack_index, unpack_index
from atom.models.deepseek_v41.attention import (
    CSA2Attention,
    layer_selection,
    picked_ids,
    visible_rows,
)
from atom.models.deepseek_v41.config import LayerMode
from atom.models.deepseek_v41.paged import PagedKV, StateSlots


@dataclass
class DecodeBatch(ForwardMemo):
    """The single-token spans of one forward; selections flow from index layers to REUSE
    layers through it."""

    idx: torch.Tensor  # [B] each token's index in the flat batch
    slots: torch.Tensor  # [B] state slots
    pos: torch.Tensor  # [B] positions
    tables: torch.Tensor  # [B, blocks] block tables, padded with block 0 (never used for rows)
    max_end: int
    # spans of several rows (a verify span, ``span_graphs``): each row's span start position
    # and the batch row of that start [B]; None: every span is one token. Positions p' in
    # [start, p) of a row at p are then read from the batch's own rows, not from the rings.
    start: torch.Tensor | None = None
    first: torch.Tensor | None = None
    # with ``start``: the block that rows completing no group write to (several rows of one
    # span share a group, and one write per location keeps the writes deterministic)
    dump_block: int | None = None
    # the rows are the forward's whole flat batch, in order (``idx`` is arange(N)): ``take``
    # returns the tensor itself, and the attention rows are the layer's output as they are
    all_rows: bool = False
    selections: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    candidates: torch.Tensor | None = None

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of a flat-batch tensor at the batch's tokens (``x`` itself with ``all_rows``:
        no gather kernel)."""
        return x if self.all_rows else x[self.idx]

    def group_index(self, r: int, rc: int):
        """For a compressor of ratio ``r`` whose ring holds ``rc`` rows: (the ring rows of
        positions p - r + 1 .. p - 1 [B, r - 1] (None for r = 1), the group of p [B], whether
        it completes at p [B], p's ring row [B] (None for r = 1)). The same for every owner of
        that ratio: computed once a forward."""

        def compute():
            p = self.pos
            if r == 1:
                return (None, p, torch.ones_like(p, dtype=torch.bool), None)  # no ring
            earlier = p[:, None] - (r - 1) + torch.arange(r - 1, device=p.device)
            group = torch.div(p, r, rounding_mode="floor")
            return (earlier.clamp(min=0) % rc, group, (p + 1) % r == 0, p % rc)

        return self._once(("groups", r, rc), compute)

    def group_angles(self, rope, r: int, group: torch.Tensor, own=None):
        """``rope.cos_sin(group * r)``, the angles of the groups' first positions (``group``
        from ``group_index(r, ...)``), once a forward per rope table and ratio. With r = 1 a
        group's first position is p itself: ``own``, the batch's rows of the angles the layer
        computed for its tokens with the same rope, when given (the same bits: the angles are
        element-wise in the position)."""
        if r == 1 and own is not None:
            return own
        return self._once(
            ("group_cs", rope.table_key, r), lambda: rope.cos_sin(group if r == 1 else group * r)
        )

    def index_keys(self, kv: PagedKV, owner: int, ratio: int):
        """(owner ``owner``'s index keys [B, R, D] float32, rows [0, max_end // ratio) of every
        sequence; which of them each token sees [B]): the keys read once a forward per owner
        until its rows are written again (``rows_written``), the visibility once per ratio."""
        keys = self._once(
            ("keys", owner, ratio),
            lambda: unpack_index(*kv.read_index_rows(owner, self.tables, self.max_end // ratio)),
        )
        return keys, self._once(("visible", ratio), lambda: visible_rows(self.pos, ratio))

    def rows_written(self, owner: int) -> None:
        """Owner ``owner``'s PAGE rows changed: its keys are read again when next asked for."""
        self._forget(("keys", owner))

    def picks(self, sel_owner: int) -> torch.Tensor:
        """``picked_ids`` of layer ``sel_owner``'s selection, computed once a forward (the
        layers that reuse a selection read the same ids)."""
        return self._once(("picks", sel_owner), lambda: picked_ids(self.selections[sel_owner]))

    def row_offsets(self, kv: PagedKV, owner: int, sel_owner: int) -> torch.Tensor:
        """``kv.row_offsets`` of owner ``owner``'s rows that ``sel_owner``'s selection picks,
        once a forward per (owner, selection): the index math only, which the tables and the
        picks fix (the rows' bytes are read where they lie)."""
        return self._once(
            ("offsets", owner, sel_owner),
            lambda: kv.row_offsets(owner, self.tables, self.picks(sel_owner)),
        )

    def window_index(self, window: int, ring_rows: int):
        """(ring rows of positions p - window + 1 .. p - 1 [B, window - 1], key validity
        [B, window], ring row of p [B]): the same for every layer, computed once a forward."""

        def compute():
            p = self.pos
            prev = p[:, None] - (window - 1) + torch.arange(window - 1, device=p.device)
            valid = torch.cat([prev >= 0, torch.ones_like(prev[:, :1], dtype=torch.bool)], 1)
            return (prev.clamp(min=0) % ring_rows, valid, p % ring_rows)

        return self._once(("windows", window, ring_rows), compute)

    def window_offsets(self, plane: torch.Tensor, window: int) -> torch.Tensor:
        """Element offsets [B, window - 1] from a layer's ring plane (``plane`` [slots, rows,
        hd], one layer's view) of the ring rows ``window_index`` names: the same for every
        layer (their planes' strides are equal), computed once a forward."""
        ring_rows = self.window_index(window, plane.shape[1])[0]
        s0, s1 = plane.stride(0), plane.stride(1)
        return self._once(
            ("window_offsets", window, plane.shape[1], s0, s1),
            lambda: self.slots[:, None] * s0 + ring_rows * s1,
        )

    def own_rows(self, before: int):
        """For positions p - before .. p - 1 of each row at p: (whether the row's own span holds
        it [B, before], the batch row holding it [B, before], clamped where it does not); None
        for single-token spans."""
        if self.start is None:
            return None

        def compute():
            prev = self.pos[:, None] - before + torch.arange(before, device=self.pos.device)
            offset = prev - self.start[:, None]
            return (offset >= 0, (self.first[:, None] + offset).clamp(min=0))

        return self._once(("spans", before), compute)

    def earlier(self, own: torch.Tensor, ring: torch.Tensor, before: int) -> torch.Tensor:
        """``ring`` [B, before, ...] (rows of positions p - before .. p - 1 read from a ring)
        with the positions inside each row's own span taken from ``own`` [B, ...] instead."""
        got = self.own_rows(before)
        if got is None:
            return ring
        inside, src = got
        keep = inside.view(*inside.shape, *([1] * (ring.dim() - 2)))
        return torch.where(keep, own[src].to(ring.dtype), ring)

    @classmethod
    def build(cls, spans: list, offsets: list[int], device) -> DecodeBatch | None:
        """From single-token spans and their tokens' offsets in the flat batch."""
        if not spans:
            return None
        meta = torch.tensor(
            [offsets, [sp.slot for sp in spans], [sp.start for sp in spans]], dtype=torch.int64
        ).to(device)
        tables = pad_sequence([sp.block_table.to(device) for sp in spans], batch_first=True)
        return cls(meta[0], meta[1], meta[2], tables, max(sp.end for sp in spans))


def _complete_groups(
    attn: CSA2Attention,
    u: torch.Tensor,
    batch: DecodeBatch,
    kv: PagedKV,
    slots: StateSlots,
    cs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """A FULL owner's step at p: write the group completing at p, refresh the ring. ``cs``:
    the batch's rows of the layer's RoPE angles (``attn.rope`` at p), if the caller has them."""
    geo, r = kv.geometry, attn.ratio
    o = geo.index_planes.index(geo.index_plane(attn.layer))
    rc = geo.compressor_rows
    planes = slots.comp_values[:, o], slots.comp_scores[:, o]  # the layer's rings, as views
    index = batch.group_index(r, rc)
    ring_rows, group, complete, own_row = index
    angles = batch.group_angles(attn.rope, r, group, cs)
    values, scores, rows = _group_rows(attn, u, batch, planes, index, angles, geo.index_dtype)
    if batch.dump_block is None:
        kv.write_rows_where(attn.layer, batch.tables, group, complete, *rows)
    else:
        kv.write_rows_or_dump(attn.layer, batch.tables, group, complete, batch.dump_block, *rows)
    batch.rows_written(attn.layer)
    if r > 1:
        slots.comp_values[batch.slots, o, own_row] = values
        if scores is not None:
            slots.comp_scores[batch.slots, o, own_row] = scores


@region
def _group_rows(
    attn: CSA2Attention,
    u: torch.Tensor,
    batch: DecodeBatch,
    planes: tuple[torch.Tensor, torch.Tensor],
    index: tuple,
    angles: tuple[torch.Tensor, torch.Tensor],
    index_dtype: str,
):
    """What ``_complete_groups`` writes, computed without writing (compiled glue: the state's
    buffers are views of one tensor, which a compiled function must not mutate): (the
    compressor's values and scores at p, (main row, index payload, index scale)). ``planes``:
    the layer's compressor rings [slots, rows, ...]; ``index``: ``batch.group_index``;
    ``angles``: the groups' ``batch.group_angles``."""
    r, ring_rows = attn.ratio, index[0]
    values, scores = attn.compressor.raw(u)  # [B, hd] float32
    v, sc = values[:, None], None if scores is None else scores[:, None]
    if r > 1:
        at = (batch.slots[:, None], ring_rows)
        v = torch.cat([batch.earlier(values, planes[0][at], r - 1), v], 1)
        if scores is not None:
            sc = torch.cat([batch.earlier(scores, planes[1][at], r - 1), sc], 1)
    main, keys = attn.compressed_rows(attn.compressor.pool(v, sc), angles)
    payload, scale = pack_index(keys, index_dtype)
    return values, scores, (main, payload, scale)


@region
def _window_keys(
    win: torch.Tensor,
    batch: DecodeBatch,
    ring_plane: torch.Tensor,
    ring_rows: torch.Tensor,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the batch's own window KV rows [B, hd], the keys they attend in the window [B, window,
    hd]: the layer's ring rows (``ring_plane`` [slots, rows, hd]) of the positions before, then
    their own). The layer comes in as its plane, not its index: an index read from the module
    would make the compiler specialize on it, once per layer."""
    ring = ring_plane[batch.slots[:, None], ring_rows].to(win.dtype)
    own = batch.take(win)
    return own, torch.cat([batch.earlier(own, ring, window - 1), own[:, None]], 1)


@region
def _selection(attn: CSA2Attention, qlat, u, cs, batch: DecodeBatch, keys, visible):
    """An index-source layer's ((row ids, valid), candidate mask) for the batch's tokens over
    ``keys``, ``visible`` (``DecodeBatch.index_keys``: read outside, where the layer's plane
    index is a plain value) with ``layer_selection``."""
    return layer_selection(attn, qlat, u, cs, keys, visible, batch.candidates, fixed_k=True)


def decode_attention(
    attn: CSA2Attention,
    u: torch.Tensor,
    cs: tuple[torch.Tensor, torch.Tensor],
    q: torch.Tensor,
    qlat: torch.Tensor,
    win: torch.Tensor,
    batch: DecodeBatch,
    kv: PagedKV,
    slots: StateSlots,
) -> torch.Tensor:
    """The attention rows [B, H, hd] of the batch's tokens (q's dtype, contiguous, the
    caller's to rotate in place); writes their window ring rows."""
    take = batch.take
    kernel = sink_attention_usable(q, "decode_attention")
    ring_rows, win_valid, own_row = batch.window_index(attn.window, kv.geometry.window_rows)
    ring_plane = slots.window[:, attn.layer]
    if kernel and batch.start is None:  # the kernel reads the ring rows where they lie
        own = take(win)
        win_k = RingWindow(ring_plane, batch.window_offsets(ring_plane, attn.window), own)
    else:
        own, win_k = _window_keys(win, batch, ring_plane, ring_rows, attn.window)
    comp = valid = None
    if attn.ratio > 0:
        u_b, cs_b = take(u), (take(cs[0]), take(cs[1]))
        if attn.mode is LayerMode.FULL:
            _complete_groups(attn, u_b, batch, kv, slots, cs_b)
        if attn.mode in (LayerMode.FULL, LayerMode.REINDEX):
            keys, visible = batch.index_keys(kv, attn.kv_owner, attn.ratio)
            sel, cand = _selection(attn, take(qlat), u_b, cs_b, batch, keys, visible)
            batch.selections[attn.layer] = sel
            if cand is not None:
                batch.candidates = cand
        sel = batch.selections[attn.sel_owner]
        valid = sel[1]
        if kernel:  # the kernel reads the picked rows where they lie in PAGE
            comp = batch.row_offsets(kv, attn.kv_owner, attn.sel_owner)
        else:
            picks = batch.picks(attn.sel_owner)
            comp = kv.gather_rows(attn.kv_owner, batch.tables, picks).to(q.dtype)
    q_b = take(q)
    if kernel:
        plane = kv.main[attn.kv_owner] if comp is not None else None
        rows = sink_attention_decode(
            q_b, win_k, win_valid, plane, comp, valid, attn.attn_sink, attn.scale
        )
    else:
        rows = attn.attend(q_b, win_k, win_valid, comp, valid)
    slots.window[batch.slots, attn.layer, own_row] = own.to(slots.window.dtype)
    return rows.to(q.dtype).contiguous()
