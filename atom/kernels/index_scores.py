"""The indexer's scores of a prefill's query tiles over their sequences' index keys, in one
kernel: s[t, r] = sum_h w[t, h] * ReLU(q[t, h] . k[r]), rows a query cannot see at -inf.

The torch expression (``TiledKeys.index_scores`` in the paged prefill) multiplies every tile's
queries with its keys as float32 [tokens x heads, rows] products, then applies ReLU and weights
the heads in further passes: for a 4096-token chunk at position 4096 that is ~2 GB of float32
written and read three times per index layer, and the product itself runs on float32 FMA units
(TF32 is off). The kernel keeps a tile of rows' keys on chip, loops over the heads, and sums
the weighted ReLUs in registers; row blocks no query of the tile can see are not computed.

In the batch-invariant mode another kernel takes one query at a time: its heads are the rows
of one product with a block of keys, and the weighted ReLUs are summed over the heads by a
second product, so every query (a decode row, or one of a prefill tile's) runs the same two
products in the same shapes.

Arithmetic: the products are float32 to within ~1e-6 relative (three TF32 products of the split
operands, Triton's ``tf32x3``; ``ieee`` on request), summed over the key dimension and the heads
in another order than torch's. Scores only rank rows (top-k), so a difference can only change
a selection between rows whose scores tie to that precision.
"""

from __future__ import annotations

import torch

from atom.kernels import use_triton

NEG_INF = float("-inf")


def index_scores_usable(qi: torch.Tensor) -> bool:
    """Whether ``tiled_index_scores`` runs the kernel for float32 queries like ``qi`` [.., Hi,
    D] (CUDA, Triton, no gradient, a power-of-two D of at least 16)."""
    if torch.is_grad_enabled() and qi.requires_grad:
        return False
    d = qi.shape[-1]
    # row-local: a query's scores come from its own tile, whose size alone sets the launch
    return use_triton(qi, "index_scores", row_local=True) and d >= 16 and d & (d - 1) == 0


def index_scores_torch(qi, w, keys, tile_keys, visible):
    """What the kernel computes: qi [P, Hi, D] and w [P, Hi] float32 for P = tiles x Q query
    rows (row t in tile t // Q), keys [S, R, D] float32, tile_keys [tiles] (each tile's keys),
    visible [P] (rows [0, visible) of its keys each query sees) -> [P, R] float32, -inf at
    rows >= visible."""
    p, r = qi.shape[0], keys.shape[1]
    per = p // tile_keys.shape[0]
    k = keys[tile_keys].repeat_interleave(per, 0)  # [P, R, D]
    dots = torch.einsum("thd,trd->thr", qi, k)
    s = torch.einsum("th,thr->tr", w, torch.relu(dots))
    rows = torch.arange(r, device=qi.device)
    return s.masked_fill(rows[None, :] >= visible[:, None], NEG_INF)


def tiled_index_scores(qi, w, keys, tile_keys, visible, precision: str = "tf32x3"):
    """``index_scores_torch`` in one kernel (``precision``: "tf32x3" or "ieee" products).
    Only where ``index_scores_usable(qi)``."""
    from atom.kernels._index_scores_triton import index_scores_triton

    return index_scores_triton(qi, w, keys, tile_keys, visible, precision)
