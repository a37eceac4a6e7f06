"""The Triton kernel behind ``atom.kernels.rope`` (imported only where Triton is)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    m_rows,
    stride_n,
    stride_m,
    stride_cs,
    base,
    half,
    sign,
    INTERLEAVED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    i = tl.arange(0, BLOCK_H)
    hm = i < half
    c = tl.load(cos_ptr + n * stride_cs + i, mask=hm, other=0.0)
    s = tl.load(sin_ptr + n * stride_cs + i, mask=hm, other=0.0) * sign
    if INTERLEAVED:
        c1, c2 = base + 2 * i, base + 2 * i + 1
    else:
        c1, c2 = base + i, base + half + i
    row = x_ptr + n * stride_n + m.to(tl.int64)[:, None] * stride_m
    mask = (m < m_rows)[:, None] & hm[None, :]
    x1 = tl.load(row + c1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + c2[None, :], mask=mask, other=0.0).to(tl.float32)
    first = x1 * c[None, :] - x2 * s[None, :]
    second = x1 * s[None, :] + x2 * c[None, :]
    tl.store(row + c1[None, :], first.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(row + c2[None, :], second.to(x_ptr.dtype.element_ty), mask=mask)


def rope_triton_(
    x3: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    dim: int,
    inverse: bool,
    interleaved: bool,
) -> None:
    """Rotate x3 [N, M, D] (last stride 1) in place over its last ``dim`` features by cos, sin
    [N, dim/2] float32 (last stride 1, one row stride for both). Compiled without floating-point
    contraction, so each product and sum rounds as torch's separate element-wise kernels round:
    the same bits as ``rope_torch_``."""
    n, m_rows, d = x3.shape
    half = dim // 2
    block_h = triton.next_power_of_2(half)
    block_m = max(1, min(triton.next_power_of_2(m_rows), 4096 // block_h))
    grid = (n, triton.cdiv(m_rows, block_m))
    _rope_kernel[grid](
        x3,
        cos,
        sin,
        m_rows,
        x3.stride(0),
        x3.stride(1),
        cos.stride(0),
        d - dim,
        half,
        -1.0 if inverse else 1.0,
        INTERLEAVED=interleaved,
        BLOCK_M=block_m,
        BLOCK_H=block_h,
        enable_fp_fusion=False,
    )
