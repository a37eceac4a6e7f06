"""Arithmetic on a ``PrefillBatch``'s tiles shared by both families: index scores of each
tile's queries against its sequence's keys, and sink attention of a tile's queries over the
tile's window keys and each query's compressed rows.

Tiles run in groups whose largest float32 intermediate stays under ``GROUP_ELEMENTS``.
"""

from __future__ import annotations

import torch

from atom.kernels import invariant, invariant_attention
from atom.kernels.index_scores import index_scores_usable, tiled_index_scores
from atom.models.common.prefill_plan import PrefillBatch

NEG_INF = float("-inf")

# elements of the largest float32 intermediate (index dots, attention scores) one group of tiles
# makes: larger batches run in groups of tiles
GROUP_ELEMENTS = 1 << 28


def tile_groups(num_tiles: int, per_tile: int) -> list[tuple[int, int]]:
    """[t0, t1) ranges of tiles whose intermediates of ``per_tile`` elements a tile fit."""
    step = max(1, GROUP_ELEMENTS // max(1, per_tile))
    return [(t0, min(num_tiles, t0 + step)) for t0 in range(0, num_tiles, step)]


class TiledKeys:
    """Index keys of each sequence ([S, R, D] float32) scored by the queries of its tiles;
    ``visible`` [N]: the rows each prefill token sees."""

    def __init__(self, keys: torch.Tensor, batch: PrefillBatch, visible: torch.Tensor):
        self.keys, self.batch, self.visible = keys, batch, visible

    def index_scores(self, qi: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """qi [N, Hi, D], w [N, Hi] of the prefill tokens -> s [N, R] = sum_h w ReLU(q.k)
        (the kernel's rows at or past ``visible`` are -inf; the torch path leaves them to the
        caller's mask)."""
        b, q = self.batch, self.batch.q
        hi, d, r = qi.shape[1], qi.shape[2], self.keys.shape[1]
        if r == 0:  # no key yet (every token before its first compressed group)
            return qi.new_zeros(qi.shape[0], 0)
        qi_p, w_p = qi[b.pad_src], w[b.pad_src]
        if index_scores_usable(qi):
            vis = self.visible[b.pad_src]
            return tiled_index_scores(qi_p, w_p, self.keys, b.tile_span, vis)[b.unpad]
        out = []
        for t0, t1 in tile_groups(b.num_tiles, q * hi * r):
            keys = self.keys[b.tile_span[t0:t1]]  # [tiles, R, D]
            qs = qi_p[t0 * q : t1 * q].reshape(t1 - t0, q * hi, d)
            if invariant.enabled():
                out.append(invariant_attention.tile_index_scores(qs, w_p[t0 * q : t1 * q], keys))
                continue
            dots = torch.bmm(qs, keys.transpose(1, 2)).view(-1, hi, r)
            out.append(torch.einsum("th,thr->tr", w_p[t0 * q : t1 * q], torch.relu(dots)))
        return torch.cat(out)[b.unpad]


def tile_attention(
    q: torch.Tensor,
    win_k: torch.Tensor,
    win_mask: torch.Tensor,
    comp: torch.Tensor | None,
    comp_valid: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Sink attention for B tiles of Q queries, each tile with its own window keys (K = V):
    q [B, Q, H, hd], win_k [B, L, hd], win_mask [B, Q, L], comp [B * Q, K, hd], comp_valid
    [B * Q, K], sink [H] float32 -> [B * Q, H, hd]. Scores are float32 products scaled by
    ``scale``; the sink joins the softmax denominator."""
    if invariant.enabled():
        return invariant_attention.sink_attention(q, win_k, win_mask, comp, comp_valid, sink, scale)
    b, t, h, hd = q.shape
    nw = win_k.shape[1]
    win = torch.bmm(q.reshape(b, t * h, hd), win_k.transpose(1, 2)).float()
    win = win.view(b * t, h, nw)
    parts = [(win * scale).masked_fill(~win_mask.view(b * t, 1, nw), NEG_INF)]
    qf = q.reshape(b * t, h, hd)
    if comp is not None:
        sc = torch.bmm(qf, comp.transpose(1, 2)).float() * scale
        parts.append(sc.masked_fill(~comp_valid[:, None, :], NEG_INF))
    parts.append(sink.view(1, -1, 1).expand(b * t, -1, 1))
    width = sum(p.shape[-1] for p in parts)
    if width % 8:  # -inf columns (probability 0): the probabilities' rows stay aligned
        parts.append(parts[0].new_full((b * t, h, 8 - width % 8), NEG_INF))
    probs = torch.softmax(torch.cat(parts, dim=-1), dim=-1).to(q.dtype)
    out = torch.bmm(probs[..., :nw].reshape(b, t * h, nw), win_k).view(b * t, h, hd)
    if comp is not None:
        out = out + torch.bmm(probs[..., nw : nw + comp.shape[1]], comp)
    return out
