"""The Triton kernel behind ``atom.kernels.host_gather`` (imported only where Triton is)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

WORDS = 4096  # 4-byte words a program copies (16 KiB)


@triton.jit(do_not_specialize=["table_addr"])
def _gather_kernel(table_addr, dst_ptr, BLOCK: tl.constexpr):
    """Program (c, p) copies words [p * BLOCK, (p + 1) * BLOCK) of copy c, whose table row
    (three int64 at ``table_addr``, host memory the device reads directly) holds the source
    address (host memory the device can read), the destination offset in ``dst_ptr``'s words,
    and the copy's length in words. Sources and destinations are 16-byte aligned."""
    c = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1).to(tl.int64)
    table = table_addr.to(tl.pointer_type(tl.int64))
    src_addr = tl.multiple_of(tl.load(table + 3 * c), 16)
    dst_off = tl.multiple_of(tl.load(table + 3 * c + 1), 4)
    words = tl.load(table + 3 * c + 2)
    w = p * BLOCK + tl.arange(0, BLOCK)
    ok = w < words
    src = src_addr.to(tl.pointer_type(tl.int32))
    v = tl.load(src + w, mask=ok)
    tl.store(dst_ptr + dst_off + w, v, mask=ok)


def gather(table: torch.Tensor, rows: int, longest: int, dst: torch.Tensor) -> None:
    """Launch on the current stream: ``table`` [rows * 3] int64 in pinned host memory,
    ``longest`` the most words of one copy, ``dst`` an int32 device tensor."""
    grid = (rows, triton.cdiv(longest, WORDS))
    _gather_kernel[grid](table.data_ptr(), dst, BLOCK=WORDS, num_warps=8)
