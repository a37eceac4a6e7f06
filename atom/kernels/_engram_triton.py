"""The Triton kernel behind ``atom.kernels.engram`` (imported only where Triton is)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n"])
def _engram_rows_kernel(
    cid_ptr, table_ptr, meta_ptr, out_ptr, n, n_tables, MASK: tl.constexpr, DE: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1)
    mult = tl.load(meta_ptr + k)
    size = tl.load(meta_ptr + n_tables + k)
    base = tl.load(meta_ptr + 2 * n_tables + k)
    order = tl.load(meta_ptr + 3 * n_tables + k)
    h = tl.zeros([], dtype=tl.int64)
    valid = order > 0
    for i in range(4):  # ids t-3..t; an order-n gram hashes the last n
        c = tl.load(cid_ptr + row * 4 + i)
        skip = i < 4 - order
        valid = valid & ((c >= 0) | skip)
        h = tl.where(skip, h, ((h * mult) & MASK) ^ tl.maximum(c, 0))
    r = base + h % size
    d = tl.arange(0, DE)
    vals = tl.load(table_ptr + r * DE + d)
    vals = tl.where(valid, vals, tl.zeros_like(vals))
    tl.store(out_ptr + row * (n_tables * DE) + k * DE + d, vals)


def engram_rows_triton(cid: torch.Tensor, table: torch.Tensor, meta: torch.Tensor, mask: int):
    n, n_tables, de = cid.shape[0], meta.shape[1], table.shape[1]
    out = torch.empty(n, n_tables * de, dtype=table.dtype, device=cid.device)
    if n:
        _engram_rows_kernel[(n, n_tables)](
            cid.contiguous(), table, meta, out, n, n_tables, MASK=mask, DE=de
        )
    return out
