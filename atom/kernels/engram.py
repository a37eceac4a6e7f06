"""Engram's n-gram lookups: every (order, head) table's hashed row of each token, in one kernel.

The torch expression runs the rolling multiply-XOR hash as a chain of int64 elementwise ops per
table and position (orders 2..4, 4 heads: 12 tables, ~110 kernels per Engram layer) and gathers
each table separately; on a GPU a decode step spent ~0.7 ms of launches there. The kernel
computes one token's hash for one table and copies that row.
"""

from __future__ import annotations

import torch

from atom.kernels import use_triton


def engram_rows_torch(
    cid: torch.Tensor,
    tables: list[torch.Tensor],
    orders: list[int],
    heads: int,
    multipliers: list[int],
    sizes: list[int],
    mask: int,
) -> torch.Tensor:
    """cid [N, 4] compressed ids of t-3..t (-1: before the sequence) -> [N, tables * de]: for
    order n and head j (table k = order index * heads + j), the row hash(last n ids) % size_k of
    table k, zero where any of the n ids is -1; hash: h = ((h * mult_k) & mask) ^ id."""
    parts, k = [], 0
    for n in orders:
        window = cid[:, 4 - n :]
        valid = (window >= 0).all(-1)
        for _ in range(heads):
            h = torch.zeros_like(window[:, 0])
            for i in range(n):
                h = ((h * multipliers[k]) & mask) ^ window[:, i].clamp(min=0)
            rows = tables[k][h % sizes[k]]
            parts.append(rows * valid[:, None].to(rows.dtype))
            k += 1
    return torch.cat(parts, dim=-1)


def engram_kernel_usable(cid: torch.Tensor, table: torch.Tensor) -> bool:
    """The kernel runs on CUDA (``use_triton``), without gradients, for a power-of-two row."""
    de = table.shape[1]
    if torch.is_grad_enabled() and table.requires_grad:
        return False
    return use_triton(cid, "engram") and de & (de - 1) == 0


def engram_rows(cid: torch.Tensor, table: torch.Tensor, meta: torch.Tensor, mask: int):
    """``engram_rows_torch`` with the tables stacked into ``table`` [sum of sizes, de] and meta
    int64 [4, tables] on the device: multiplier, size, first row in ``table``, order."""
    from atom.kernels._engram_triton import engram_rows_triton

    return engram_rows_triton(cid, table, meta, mask)
