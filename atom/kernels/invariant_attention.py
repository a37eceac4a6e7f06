"""The batch-invariant mode's attention and indexer (``atom.kernels.invariant``'s arithmetic
applied to them): each query's result in an order set by its own keys alone.

- ``sink_attention`` / ``sink_attention_rows`` and ``index_scores`` on CUDA: the attention and
  index-score Triton kernels (``atom.kernels.attention``, ``atom.kernels.index_scores``), one
  program per query row (and block of heads) or per tile of positions, their launch fixed in
  the mode.
- ``sink_attention`` elsewhere: the keys of each query are reduced in a fixed order of
  fixed-size parts: its window keys (one part), then its compressed rows in chunks of
  ``KEY_CHUNK`` from row 0, then the sink, by an online softmax. A chunk of masked (padding)
  rows is an exact no-op (its maximum is -inf, so the running maximum, sum and output are
  multiplied by exp(0) = 1 and added 0), so scanning more padding rows for a longer sequence
  in the batch changes no bit.
- ``index_scores`` / ``tile_index_scores`` elsewhere: rows in chunks of ``KEY_CHUNK``, the
  heads summed in order; ``order_selection``: a top-k's picks in row order.
"""

from __future__ import annotations

import torch

from atom.kernels.invariant import (
    KEY_PAD,
    NEG_INF,
    aligned,
    bmm,
    linear,
    operand,
    pad_rows,
    pointwise,
)
from atom.kernels.invariant import sum as ordered_sum

# compressed rows per attention chunk in the mode
KEY_CHUNK = 64


def sink_attention(
    q: torch.Tensor,
    win_k: torch.Tensor,
    win_mask: torch.Tensor,
    comp: torch.Tensor | None,
    comp_valid: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Sink attention for B tiles of Q queries (K = V), each tile with its own window keys:
    q [B, Q, H, hd], win_k [B, L, hd], win_mask [B, Q, L], comp [B * Q, K, hd] rows per query
    with comp_valid [B * Q, K], sink [H] float32 -> [B * Q, H, hd] in q's dtype. The same
    function as ``atom.models.common.prefill_tiles.tile_attention``, reduced in the mode's
    order (module doc): window part, ``KEY_CHUNK``-row chunks of ``comp``, sink. Every query
    needs one valid window key (its own). On CUDA where Triton imports, the attention kernel
    (``_kernel_attention``) instead."""
    b, t, h, hd = q.shape
    n = b * t
    if _attention_kernel(q):
        return _kernel_attention(q, win_k, win_mask, comp, comp_valid, sink, scale)
    # masked zero keys up to a multiple of KEY_PAD: p = 0 there, exactly
    win_k, win_mask = pad_rows(win_k, 1, KEY_PAD), pad_rows(win_mask, 2, KEY_PAD)
    win_k, qt = aligned(win_k), aligned(q.reshape(b, t * h, hd))
    win = bmm(qt, operand(win_k.transpose(1, 2))).float().view(n, h, -1)
    logits = (win * scale).masked_fill(~win_mask.reshape(n, 1, -1), NEG_INF)
    m = logits.amax(-1, keepdim=True)  # finite: the own key is valid
    p = pointwise(torch.exp, logits - m)
    total = ordered_sum(p, -1, keepdim=True)
    pv = bmm(operand(p.to(q.dtype).view(b, t * h, -1)), win_k).float().view(n, h, hd)
    acc = pv
    qf = qt.view(n, h, hd)
    if comp is not None and comp.shape[1]:
        comp, comp_valid = pad_rows(comp, 1, KEY_CHUNK), pad_rows(comp_valid, 1, KEY_CHUNK)
        for c0 in range(0, comp.shape[1], KEY_CHUNK):
            rows = operand(comp[:, c0 : c0 + KEY_CHUNK])
            sc = bmm(qf, operand(rows.transpose(1, 2))).float() * scale
            sc = sc.masked_fill(~comp_valid[:, None, c0 : c0 + KEY_CHUNK], NEG_INF)
            m_new = torch.maximum(m, sc.amax(-1, keepdim=True))
            alpha = pointwise(torch.exp, m - m_new)
            p = pointwise(torch.exp, sc - m_new)
            total = total * alpha + ordered_sum(p, -1, keepdim=True)
            acc = acc * alpha + bmm(operand(p.to(q.dtype)), rows).float()
            m = m_new
    s = sink.float().view(1, h, 1)
    m_new = torch.maximum(m, s)
    alpha = pointwise(torch.exp, m - m_new)
    total = total * alpha + pointwise(torch.exp, s - m_new)
    return (acc * alpha / total).to(q.dtype)


def _attention_kernel(q: torch.Tensor) -> bool:
    """Whether the mode's sink attention on tensors like ``q`` runs the Triton kernel
    (``atom.kernels.attention``): one program per query row and block of heads, walking the
    row's window keys, then its compressed rows, in tiles of a launch configuration fixed for
    the mode (``sink_attention_config``), so a row's bits do not depend on the batch."""
    from atom.kernels.attention import sink_attention_usable

    return sink_attention_usable(q)


def _kernel_attention(q, win_k, win_mask, comp, comp_valid, sink, scale) -> torch.Tensor:
    """``sink_attention``'s arguments through the kernel: the gathered rows ``comp`` [N, K, hd]
    are its plane, read at offsets of whole rows."""
    from atom.kernels.attention import sink_attention as kernel

    b, t, h, hd = q.shape
    plane = offsets = valid = None
    if comp is not None and comp.shape[1]:
        plane = comp.to(q.dtype).contiguous()
        n, k = comp.shape[:2]
        offsets = torch.arange(n * k, device=q.device, dtype=torch.int64).view(n, k) * hd
        valid = comp_valid
    return kernel(
        q.reshape(b * t, h, hd),
        win_k,
        win_mask.reshape(b * t, -1),
        plane,
        offsets,
        valid,
        sink.float(),
        scale,
    )


def sink_attention_rows(
    q: torch.Tensor,
    win_k: torch.Tensor,
    win_mask: torch.Tensor,
    comp: torch.Tensor | None,
    comp_valid: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``sink_attention`` for T queries: q [T, H, hd]; window keys [T, Nw, hd] per query or
    [Nw, hd] shared, mask [T, Nw]; comp [T, K, hd] per query or [K, hd] shared, comp_valid
    [T, K] -> [T, H, hd]."""
    t = q.shape[0]
    if win_k.dim() == 3:  # one tile per query
        out = sink_attention(
            q[:, None], win_k, win_mask[:, None], _per_query(comp, t), comp_valid, sink, scale
        )
        return out
    return sink_attention(
        q[None], win_k[None], win_mask[None], _per_query(comp, t), comp_valid, sink, scale
    )


def _per_query(comp: torch.Tensor | None, t: int) -> torch.Tensor | None:
    if comp is None or comp.dim() == 3:
        return comp
    return comp[None].expand(t, -1, -1)


def index_scores(qi: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Indexer scores s [T, R] = sum_h w[t, h] ReLU(qi[t, h] . keys[r]): qi [T, H, D], w [T, H],
    keys [R, D] shared or [T, R, D] per query (float32). In the mode's order: rows in chunks of
    ``KEY_CHUNK`` (one GEMM shape per chunk, shared keys row-tiled over T * H), the heads summed
    in order; a row's score does not depend on R or T. On CUDA where Triton imports, the index
    kernel (``atom.kernels.index_scores``) with every query its own tile: its launch set by the
    tile size (one query), so again by nothing the batch changes."""
    t, h, d = qi.shape
    r = keys.shape[-2]
    if r == 0:  # no key yet (every query before its first compressed group): nothing to score
        return qi.new_zeros(t, 0)
    from atom.kernels.index_scores import index_scores_usable, tiled_index_scores

    if index_scores_usable(qi):
        per_query = keys.dim() == 3
        tiles = torch.arange(t, device=qi.device)
        if not per_query:
            tiles = torch.zeros_like(tiles)
        visible = torch.full((t,), r, dtype=torch.int32, device=qi.device)
        return tiled_index_scores(qi, w, keys if per_query else keys[None], tiles, visible)
    keys = pad_rows(keys, -2, KEY_CHUNK)
    per_query = keys.dim() == 3
    qa = aligned(qi) if per_query else qi.reshape(t * h, d)
    out = []
    for c0 in range(0, keys.shape[-2], KEY_CHUNK):
        chunk = operand(keys[..., c0 : c0 + KEY_CHUNK, :])
        if per_query:
            dots = bmm(qa, operand(chunk.transpose(1, 2)))
        else:
            dots = linear(qa, chunk).view(t, h, -1)
        out.append(head_sum(w, dots))
    return torch.cat(out, 1)[:, :r]


def head_sum(w: torch.Tensor, dots: torch.Tensor) -> torch.Tensor:
    """sum_h w[t, h] ReLU(dots[t, h, r]) -> [T, R], the heads added in order."""
    terms = w[:, :, None] * torch.relu(dots)
    total = terms[:, 0]
    for i in range(1, terms.shape[1]):
        total = total + terms[:, i]
    return total


def tile_index_scores(qs: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Index scores of tiles: qs [B, Q * H, D] (Q queries of H heads per tile), w [B * Q, H],
    keys [B, R, D] (each tile's sequence's rows) -> [B * Q, R], in ``index_scores``' order."""
    h, r = w.shape[1], keys.shape[1]
    keys, qa = pad_rows(keys, 1, KEY_CHUNK), aligned(qs)
    out = []
    for c0 in range(0, keys.shape[1], KEY_CHUNK):
        chunk = operand(keys[:, c0 : c0 + KEY_CHUNK].transpose(1, 2))
        dots = bmm(qa, chunk).view(-1, h, KEY_CHUNK)
        out.append(head_sum(w, dots))
    return torch.cat(out, 1)[:, :r]


def order_selection(ids: torch.Tensor, valid: torch.Tensor):
    """A top-k selection (ids [T, K], valid [T, K]) with the valid picks in row order, first,
    the invalid after: the attention then meets a token's picks in an order set by the picks
    alone, not by their scores' last bits."""
    key = torch.where(valid, ids, torch.full_like(ids, torch.iinfo(ids.dtype).max))
    order = torch.sort(key, dim=-1, stable=True).indices
    return ids.gather(1, order), valid.gather(1, order)
