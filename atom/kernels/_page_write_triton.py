"""The Triton kernel behind ``atom.kernels.page_write`` (imported only where Triton is)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_row(dst, d0, d1, src, s0, blk, off, b, n, BLOCK: tl.constexpr):
    """Bytes [0, n) of source row b into row ``off`` of block ``blk`` (n = 0: nothing)."""
    j = tl.arange(0, BLOCK)
    for c in range(0, n, BLOCK):
        cols = c + j
        v = tl.load(src + b * s0 + cols, mask=cols < n)
        tl.store(dst + blk * d0 + off * d1 + cols, v, mask=cols < n)


@triton.jit
def _write_rows_where_kernel(
    tables,
    t_stride,
    ids,
    where,
    per_block,
    dst0,
    d00,
    d01,
    src0,
    s00,
    n0,
    dst1,
    d10,
    d11,
    src1,
    s10,
    n1,
    dst2,
    d20,
    d21,
    src2,
    s20,
    n2,
    PLANES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    # a row whose flag is off copies no bytes (a byte count times the 0/1 flag: the
    # interpreter takes no scalar masks); its location is read as the torch expression reads
    # every row's (the caller's ids lie inside their tables)
    w = (tl.load(where + b) != 0).to(tl.int32)
    row = tl.load(ids + b).to(tl.int64)
    blk = tl.load(tables + b * t_stride + row // per_block).to(tl.int64)
    off = row % per_block
    _copy_row(dst0, d00, d01, src0, s00, blk, off, b, n0 * w, BLOCK)
    if PLANES > 1:
        _copy_row(dst1, d10, d11, src1, s10, blk, off, b, n1 * w, BLOCK)
    if PLANES > 2:
        _copy_row(dst2, d20, d21, src2, s20, blk, off, b, n2 * w, BLOCK)


def write_rows_where_triton(
    dst: list[torch.Tensor],
    src: list[torch.Tensor],
    tables: torch.Tensor,
    ids: torch.Tensor,
    where: torch.Tensor,
    per_block: int,
) -> None:
    """``dst`` uint8 planes [blocks, per_block, n] (row bytes contiguous), ``src`` uint8 rows
    [B, n]; one program per batch row."""
    args = []
    for t in range(3):
        d, s = (dst[t], src[t]) if t < len(dst) else (dst[0], src[0])
        if d.stride(2) != 1 or s.stride(1) != 1:
            raise ValueError("page_write needs each row's bytes contiguous")
        args += [d, d.stride(0), d.stride(1), s, s.stride(0), d.shape[2]]
    if tables.stride(1) != 1:
        tables = tables.contiguous()
    block = min(1024, triton.next_power_of_2(max(d.shape[2] for d in dst)))
    _write_rows_where_kernel[(ids.shape[0],)](
        tables,
        tables.stride(0),
        ids.contiguous(),
        where.contiguous().view(torch.uint8),
        per_block,
        *args,
        PLANES=len(dst),
        BLOCK=block,
    )
