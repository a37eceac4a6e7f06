"""The Triton reductions behind the batch-invariant mode on CUDA (``atom.kernels.invariant``;
imported only where Triton is): sums whose order depends on the reduced length alone.

``ordered_sum(x, dim)``: x viewed as [outer, n, inner] (``dim`` the middle). For any dim but
the last, each program takes a block of inner elements of one outer index and adds the n terms
one after another into float32 accumulators (term 0 first): an element's order is that of its
index along ``dim``, whatever the other rows. For the last dimension each row's terms go into
a [BN]-wide float32 accumulator in blocks of BN from term 0, then one ``tl.sum`` of the
accumulator: BN is set by n alone, so a row's additions are the same in any call. Which of the
two runs depends on ``dim``'s place alone, never on the sizes of the other dimensions (a batch
dimension of size 1 must not switch a sum to the other order). Either way a
sum is one launch (torch's CUDA reductions pick their split of a row by the number of rows,
and the mode's fallback added short dims one launch per term).

``add_partials(parts, out)``: the float32 partials [S, ...] of a split-K GEMM added in range
order (part 0 first) and rounded once into ``out``: bit for bit what S - 1 element-wise adds in
float32 and a copy compute, in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# inner elements per program of the middle-dimension sum; row blocks of the last-dimension sum
_BI, _BR = 256, 16


@triton.jit(do_not_specialize=["n", "inner"])
def _middle_sum_kernel(x_ptr, o_ptr, n, inner, s_o, s_n, BI: tl.constexpr):
    o = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1).to(tl.int64) * BI + tl.arange(0, BI)
    ok = i < inner
    base = x_ptr + o * s_o + i
    acc = tl.load(base, mask=ok, other=0.0).to(tl.float32)
    for j in range(1, n):
        acc += tl.load(base + j * s_n, mask=ok, other=0.0).to(tl.float32)
    tl.store(o_ptr + o * inner + i, acc.to(o_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["rows", "n"])
def _last_sum_kernel(x_ptr, o_ptr, rows, n, s_r, BR: tl.constexpr, BN: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    r_ok = r < rows
    acc = tl.zeros([BR, BN], tl.float32)
    for c0 in range(0, n, BN):
        c = c0 + tl.arange(0, BN)
        m = r_ok[:, None] & (c < n)[None, :]
        acc += tl.load(x_ptr + r[:, None] * s_r + c[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + r, tl.sum(acc, 1).to(o_ptr.dtype.element_ty), mask=r_ok)


def _last_block(n: int) -> int:
    """The accumulator width of a last-dimension sum of n terms: n's alone."""
    return min(256, max(16, triton.next_power_of_2(n)))


def ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x.sum(dim)`` (keepdim False) in x's dtype, float32 accumulation, in the module doc's
    order. ``x`` on CUDA (or under Triton's interpreter); any strides."""
    dim = dim % x.dim()
    n = x.shape[dim]
    out_shape = x.shape[:dim] + x.shape[dim + 1 :]
    outer = 1
    for s in x.shape[:dim]:
        outer *= s
    inner = x.numel() // max(1, outer * n) if n else 0
    out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if n == 0:
        return out.zero_()
    if dim == x.dim() - 1:
        rows = x.reshape(outer, n)
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        bn = _last_block(n)
        _last_sum_kernel[(triton.cdiv(outer, _BR),)](
            rows, out, outer, n, rows.stride(0), BR=_BR, BN=bn, num_warps=4
        )
        return out
    v = x.reshape(outer, n, inner)  # a view where strides allow, else one copy
    if v.stride(2) != 1:
        v = v.contiguous()
    _middle_sum_kernel[(outer, triton.cdiv(inner, _BI))](
        v, out, n, inner, v.stride(0), v.stride(1), BI=_BI, num_warps=4
    )
    return out


@triton.jit(do_not_specialize=["numel", "S"])
def _add_partials_kernel(p_ptr, o_ptr, numel, S, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < numel
    acc = tl.load(p_ptr + i, mask=ok, other=0.0)
    for s in range(1, S):
        acc += tl.load(p_ptr + s * numel + i, mask=ok, other=0.0)
    tl.store(o_ptr + i, acc.to(o_ptr.dtype.element_ty), mask=ok)


def add_partials(parts: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[...] = parts[0] + parts[1] + ... + parts[S - 1]`` (float32 adds, in that order,
    one rounding into out's dtype). parts [S, *out.shape] float32 contiguous, out contiguous."""
    numel = out.numel()
    if numel:
        block = 1024
        _add_partials_kernel[(triton.cdiv(numel, block),)](
            parts, out, numel, parts.shape[0], BLOCK=block, num_warps=4
        )
    return out
