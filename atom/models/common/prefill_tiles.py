"""Arithmetic on a ``PrefillBatch``'s tiles shared by both families: index scores of each
tile's queries against its sequence's keys, and sink attention of a tile's queries over the
tile's window keys and each query's compressed rows.

Tiles run in groups whose largest float32 intermediate stays under ``GROUP_ELEMENTS``.
"""

from __future__ import annotations

import torch

from atom.kernels import invariant, invariant_attention
from atom.kernels.attention import sink_attention
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


def query_windows(
    win_k: torch.Tensor, win_mask: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's own window of a ``PrefillBatch``'s tiles, laid out as a decode row's:
    win_k [B, L, hd], win_mask [B, Q, L] -> ([B * Q, window, hd], [B * Q, window]), the keys of
    positions p - window + 1 .. p in order (those before position 0 masked). A tile's keys end
    at its last query (``PrefillBatch``: positions [p0 + Q - L, p0 + Q)), so query j's window is
    keys [j + L - Q - window + 1, j + L - Q], a slice of the tile's."""
    b, q, n = win_mask.shape
    idx = (n - q - window + 1) + torch.arange(q, device=win_k.device)[:, None]
    idx = idx + torch.arange(window, device=win_k.device)  # [Q, window]
    keys = win_k[:, idx].reshape(b * q, window, win_k.shape[-1])
    mask = win_mask.gather(2, idx.expand(b, q, window)).reshape(b * q, window)
    return keys, mask


def kernel_tile_attention(
    q: torch.Tensor,
    win_k: torch.Tensor,
    win_mask: torch.Tensor,
    plane: torch.Tensor | None,
    offsets: torch.Tensor | None,
    valid: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    """The attention kernel (``atom.kernels.attention.sink_attention``) over a
    ``PrefillBatch``'s tiles: q [P, H, hd] (tile rows), win_k [nt, L, hd], win_mask [nt, Q, L],
    compressed rows of ``plane`` at ``offsets`` [P, K] where ``valid``. In the batch-invariant
    mode each query attends its own window (``query_windows``), in groups of tiles, as the mode's
    decode rows do: the kernel walks a row's keys in tiles counted from its first visible one,
    so in a tile's shared keys a query's tiles would start where its position puts them."""
    if not invariant.enabled():
        return sink_attention(q, win_k, win_mask, plane, offsets, valid, sink, scale)
    nt, tq = win_mask.shape[:2]
    out = []
    for t0, t1 in tile_groups(nt, tq * window * win_k.shape[-1]):
        a, z = t0 * tq, t1 * tq
        keys, mask = query_windows(win_k[t0:t1], win_mask[t0:t1], window)
        picks = None if offsets is None else offsets[a:z]
        flags = None if valid is None else valid[a:z]
        out.append(sink_attention(q[a:z], keys, mask, plane, picks, flags, sink, scale))
    return torch.cat(out)


def tile_attention(
    q: torch.Tensor,
    win_k: torch.Tensor,
    win_mask: torch.Tensor,
    comp: torch.Tensor | None,
    comp_valid: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Sink attention for B tiles of Q queries, each tile with its own window keys (K = V):
    q [B, Q, H, hd], win_k [B, L, hd], win_mask [B, Q, L], comp [B * Q, K, hd], comp_valid
    [B * Q, K], sink [H] float32 -> [B * Q, H, hd]. Scores are float32 products scaled by
    ``scale``; the sink joins the softmax denominator.

    ``window``: the tiles are a ``PrefillBatch``'s; in the batch-invariant mode each query then
    attends its own ``window`` keys (``query_windows``), the layout a decode row attends, so a
    token's bits are the same whether a prefill chunk or a decode step computes it (a tile's
    shared keys would order its reductions by the tile's other positions)."""
    if invariant.enabled():
        if window is not None:
            b, t, h, hd = q.shape
            win_k, win_mask = query_windows(win_k, win_mask, window)
            q, win_mask = q.reshape(b * t, 1, h, hd), win_mask[:, None]
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
