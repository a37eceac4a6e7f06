"""Which compressed rows a query attends: visibility, top-k selection with ties to the smaller
row, candidate blocks, window masks. The same discrete choices wherever they run (paged path,
reference, both families), so two paths can only differ by arithmetic.

A query at position p sees ``(p + 1) // ratio`` compressed rows and the window keys at
p - window + 1 .. p.
"""

from __future__ import annotations

import torch

from atom.kernels import invariant, invariant_attention

NEG_INF = float("-inf")


def visible_rows(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    return torch.div(positions + 1, ratio, rounding_mode="floor")


def candidate_row_mask(
    scores: torch.Tensor, visible: torch.Tensor, block_rows: int, keep_blocks: int
) -> torch.Tensor:
    """Rows inside each query's candidate blocks: blocks of ``block_rows`` rows scored by their
    best visible row, the newest block always kept, the top ``keep_blocks`` kept (ties to the
    smaller block). scores [T, R] with invisible rows at -inf; returns bool [T, R]."""
    t, r = scores.shape
    nb = -(-r // block_rows)
    padded = torch.full((t, nb * block_rows), NEG_INF, dtype=scores.dtype, device=scores.device)
    padded[:, :r] = scores
    block = padded.view(t, nb, block_rows).amax(-1)
    newest = torch.div(visible - 1, block_rows, rounding_mode="floor").clamp(min=0)
    has_rows = (visible > 0)[:, None]
    is_newest = torch.arange(nb, device=scores.device)[None, :] == newest[:, None]
    block = torch.where(is_newest & has_rows, torch.full_like(block, float("inf")), block)
    order = torch.sort(block, dim=-1, descending=True, stable=True).indices[:, :keep_blocks]
    chosen = torch.zeros(t, nb, dtype=torch.bool, device=scores.device)
    chosen.scatter_(1, order, block.gather(1, order) > NEG_INF)
    # repeat each block's flag over its rows (an expand: repeat_interleave may sync on CUDA)
    return chosen[:, :, None].expand(t, nb, block_rows).reshape(t, nb * block_rows)[:, :r]


def select_topk(
    scores: torch.Tensor, k: int, fixed: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top min(k, R) rows per query (exactly k with ``fixed``: short rows padded invalid), ties
    to the smaller row; ineligible rows are -inf. Returns (row ids [T, K], valid [T, K])."""
    if fixed and scores.shape[1] < k:
        scores = torch.nn.functional.pad(scores, (0, k - scores.shape[1]), value=NEG_INF)
    k = min(k, scores.shape[1])
    ranked = torch.sort(scores, dim=-1, descending=True, stable=True)
    ids, valid = ranked.indices[:, :k], ranked.values[:, :k] > NEG_INF
    if invariant.enabled():  # picks in row order (``atom.kernels.invariant``)
        return invariant_attention.order_selection(ids, valid)
    return ids, valid


def mask_invisible(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(scores.shape[1], device=scores.device)
    return scores.masked_fill(rows[None, :] >= visible[:, None], NEG_INF)


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Query at p sees keys at positions p - window + 1 .. p."""
    diff = q_pos[:, None] - k_pos[None, :]
    return (diff >= 0) & (diff < window)


def picked_ids(sel: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Selection ids [T, K] safe to gather with: invalid picks point at row 0."""
    ids, valid = sel
    return torch.where(valid, ids, torch.zeros_like(ids))


def gather_selected(rows: torch.Tensor, sel: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """rows [R, hd], selection ids [T, K] -> [T, K, hd] (invalid picks read row 0)."""
    return rows[picked_ids(sel)]
