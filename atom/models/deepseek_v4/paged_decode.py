"""V4 decode batched across sequences: a forward whose spans are all one token long.

The same state rules as the per-sequence loop (``paged_attention``, module doc), applied to B
sequences at once with indices the host builds from the spans (``DecodeBatch.build``, one
upload): for the token at position p of each sequence,

  window keys  = ring rows of p - window + 1 .. p - 1 (those >= 0) + its own KV; its KV then
                 goes to ring row p % ring rows;
  compressor   = its raw (kv, score) goes to partial row p % r; the sequences whose group
                 completes at p (p % r == r - 1, known on the host) pool it (at ratio 4 with
                 the overlap fields, or nothing for group 0), write row p // r to PAGE (and
                 the indexer's key), and refresh the overlap fields;
  rows         = an HCA layer attends every visible row [0, (p + 1) // r), a CSA layer the
                 top ``index_topk`` of them by its indexer, both gathered per sequence from
                 its blocks (padded to the batch's largest count, the padding masked).

Nothing here reads the device on the host. The math of each row, group and attention is the
loop's (``V4Attention``, ``V4Compressor``, ``V4Indexer``); only reduction shapes differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atom.model_api import Span
from atom.models.common.selection import select_topk
from atom.models.common.storage import pack_index, unpack_index
from atom.models.deepseek_v4.attention import NEG_INF, V4Attention
from atom.models.deepseek_v4.paged import V4PagedKV, V4StateSlots


@dataclass
class RatioIndex:
    """What the layers of one compress ratio r read and write in a decode batch."""

    ids: torch.Tensor  # [B, C] row ids 0 .. C - 1 (C the batch's largest visible count)
    valid: torch.Tensor  # [B, C] row < the sequence's visible count
    phase: torch.Tensor  # [B] p % r, the partial row the token's raw projections go to
    done: torch.Tensor  # [G] batch rows whose group completes at p
    group: torch.Tensor  # [G] their group ids p // r
    first: torch.Tensor  # [G] bool: group 0 (no predecessor to overlap)
    count: int  # C


@dataclass
class DecodeBatch:
    ids: torch.Tensor  # [B] the tokens
    slots: torch.Tensor  # [B]
    pos: torch.Tensor  # [B]
    tables: torch.Tensor  # [B, blocks] each sequence's block table, padded with its last block
    ring_rows: torch.Tensor  # [B, window - 1] ring rows of p - window + 1 .. p - 1
    ring_valid: torch.Tensor  # [B, window - 1] those positions >= 0
    ring_own: torch.Tensor  # [B] p % ring rows
    ratios: dict[int, RatioIndex]

    @staticmethod
    def usable(spans: list[Span]) -> bool:
        return bool(spans) and all(sp.num_tokens == 1 and sp.start > 0 for sp in spans)

    @classmethod
    def build(
        cls,
        spans: list[Span],
        token_ids: torch.Tensor,
        ratios: list[int],
        window: int,
        ring: int,
        device,
    ) -> DecodeBatch:
        """Indices of a decode forward (every span one token at p = start > 0) and its token
        ids, on the host, then uploaded to ``device`` in one copy."""
        pos = torch.tensor([sp.start for sp in spans], dtype=torch.int64)
        slots = torch.tensor([sp.slot for sp in spans], dtype=torch.int64)
        width = max(sp.block_table.numel() for sp in spans)
        tables = torch.stack(
            [
                torch.cat([t := sp.block_table.cpu().long(), t[-1:].expand(width - t.numel())])
                for sp in spans
            ]
        )
        back = pos[:, None] - window + 1 + torch.arange(window - 1)
        out = dict(
            ids=token_ids.cpu().long(),
            slots=slots,
            pos=pos,
            tables=tables,
            ring_rows=back.clamp(min=0) % ring,
            ring_valid=back >= 0,
            ring_own=pos % ring,
        )
        per_ratio: dict[int, dict] = {}
        for r in sorted(set(ratios)):
            visible = (pos + 1) // r
            count = int(visible.max())
            ids = torch.arange(count)[None, :].expand(len(spans), count)
            done = torch.nonzero((pos + 1) % r == 0).flatten()
            per_ratio[r] = dict(
                ids=ids,
                valid=ids < visible[:, None],
                phase=pos % r,
                done=done,
                group=pos[done] // r,
                first=pos[done] // r == 0,
                count=count,
            )
        host = list(out.items()) + [
            ((r, k), v) for r, d in per_ratio.items() for k, v in d.items() if k != "count"
        ]
        moved = dict(zip([k for k, _ in host], _upload([v for _, v in host], device)))
        return cls(
            **{k: moved[k] for k in out},
            ratios={
                r: RatioIndex(**{k: (v if k == "count" else moved[(r, k)]) for k, v in d.items()})
                for r, d in per_ratio.items()
            },
        )


def _upload(tensors: list[torch.Tensor], device) -> list[torch.Tensor]:
    """Host tensors (int64 or bool) to ``device`` in one copy (pinned on CUDA, so it does not
    block the host), as views of one buffer, each with its own dtype and shape."""
    flat = torch.cat([t.reshape(-1).long() for t in tensors])
    dev = torch.device(device)
    if dev.type == "cuda":
        flat = flat.pin_memory().to(dev, non_blocking=True)
    else:
        flat = flat.to(dev)
    out, lo = [], 0
    for t in tensors:
        part = flat[lo : lo + t.numel()].view(t.shape)
        out.append(part.bool() if t.dtype == torch.bool else part)
        lo += t.numel()
    return out


def decode_attention(
    attn: V4Attention, u: torch.Tensor, batch: DecodeBatch, kv: V4PagedKV, slots: V4StateSlots
) -> torch.Tensor:
    """u [B, d] (the normed sublayer input, one token per sequence) -> attention output
    [B, d]; updates the layer's ring, compressor state and PAGE rows as the loop does."""
    cs = attn.rope.cos_sin(batch.pos)
    q, qr = attn.queries(u, cs)
    win = attn.window_kv(u, cs)
    ring = slots.window[batch.slots[:, None], attn.layer, batch.ring_rows].to(win.dtype)
    win_k = torch.cat([ring, win[:, None]], 1)
    own = torch.ones_like(batch.ring_valid[:, :1])
    win_mask = torch.cat([batch.ring_valid, own], 1)
    comp = comp_mask = None
    if attn.ratio:
        comp, comp_mask = _compressed(attn, u, qr, cs, batch, kv, slots)
        comp = comp.to(q.dtype)
    out = attn.attend(q, win_k, win_mask, comp, comp_mask)
    slots.window[batch.slots, attn.layer, batch.ring_own] = win.to(slots.window.dtype)
    return attn.output(out, cs)


def _pool_completed(comp, u, batch: DecodeBatch, ri: RatioIndex, state):
    """Append the batch's raw projections to the partial groups; pool the groups completing
    now (refreshing the overlap fields at ratio 4). Returns pooled [G, dim] or None."""
    overlap, partial = state
    kv_raw, score_raw = comp.raw(u, batch.pos)
    partial[0][batch.slots, ri.phase] = kv_raw
    partial[1][batch.slots, ri.phase] = score_raw
    if not ri.done.numel():
        return None
    sl = batch.slots[ri.done]
    kvg, scg = partial[0][sl], partial[1][sl]  # [G, r, width]
    prev = (None, None)
    if comp.overlap:
        d, first = comp.dim, ri.first[:, None, None]
        prev = (
            torch.where(first, torch.zeros_like(overlap[0][sl]), overlap[0][sl]),
            torch.where(first, torch.full_like(overlap[1][sl], NEG_INF), overlap[1][sl]),
        )
        overlap[0][sl] = kvg[:, :, :d]
        overlap[1][sl] = scg[:, :, :d]
    return comp.pool(kvg, scg, *prev)


def _compressed(attn: V4Attention, u, qr, cs, batch: DecodeBatch, kv, slots: V4StateSlots):
    """(rows to attend [B, K, hd], their mask [B, K]) after updating the layer's rows."""
    r, layer = attn.ratio, attn.layer
    ri = batch.ratios[r]
    pooled = _pool_completed(attn.compressor, u, batch, ri, slots.compressor_fields(layer, r))
    done_tables = batch.tables[ri.done]
    rows_cs = attn.rope.cos_sin(ri.group * r)
    ix = attn.indexer
    if ix is None:  # HCA: every visible row
        if pooled is not None:
            kv.write_main_each(layer, done_tables, ri.group, attn.main_rows(pooled, rows_cs))
        return kv.gather_rows(layer, batch.tables, ri.ids), ri.valid
    index_state = slots.compressor_fields(layer, r, index=True)
    pooled_i = _pool_completed(ix.compressor, u, batch, ri, index_state)
    if pooled is not None:
        keys = ix.compressor.rows(pooled_i, attn.rope, rows_cs)
        payload, scale = pack_index(keys, kv.geometry.index_dtype)
        seq = torch.arange(ri.done.numel(), device=u.device)
        kv.write_rows_of(
            layer, done_tables, seq, ri.group, attn.main_rows(pooled, rows_cs), payload, scale
        )
    payload, scale = kv.read_index_rows(layer, batch.tables, ri.count)
    qi, w = ix.query(qr, u, attn.rope, cs)
    keys = unpack_index(payload, scale)  # [B, C, D]
    scores = torch.einsum("th,thr->tr", w, torch.relu(torch.einsum("thd,trd->thr", qi, keys)))
    sel = select_topk(scores.masked_fill(~ri.valid, NEG_INF), ix.topk)
    picked = torch.where(sel[1], sel[0], torch.zeros_like(sel[0]))
    return kv.gather_rows(layer, batch.tables, picked), sel[1]
