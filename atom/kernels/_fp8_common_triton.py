"""Pieces both FP8 GEMM kernels share (``_fp8_gemm_triton``, ``_fp8_dq_triton``): the UE8M0
scale of a block's amax, a split's range of K steps, and the split-K output buffer and its
fixed-order reduction. Imported only where Triton is."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# float32(1/448), rounded from the double by the compiler as torch rounds it
_INV_FP8_MAX = tl.constexpr(1.0 / 448.0)


@triton.jit
def _ue8m0(amax):
    """(scale, 1 / scale) of ``ue8m0_scale(amax, 448)``, both exact powers of two."""
    bits = (tl.maximum(amax, 1e-4) * _INV_FP8_MAX).to(tl.int32, bitcast=True)
    expo = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (expo << 23).to(tl.float32, bitcast=True), ((254 - expo) << 23).to(
        tl.float32, bitcast=True
    )


@triton.jit
def _split_range(n, split, SPLIT: tl.constexpr):
    """[start, end) of split ``split``'s share of ``n`` steps: contiguous, in order."""
    per = tl.cdiv(n, SPLIT)
    start = split * per
    return start, tl.minimum(start + per, n)


def split_buffer(split: int, m: int, n: int, dtype, device) -> torch.Tensor:
    """Where a kernel of ``split`` K ranges writes: float32 partials [split, M, N], or the
    output [M, N] itself with one range."""
    if split > 1:
        return torch.empty(split, m, n, dtype=torch.float32, device=device)
    return torch.empty(m, n, dtype=dtype, device=device)


def reduce_splits(out: torch.Tensor, split: int, dtype) -> torch.Tensor:
    """The output from ``split_buffer``'s partials: one fixed-order reduction over the splits
    (no atomics: the same bits every run)."""
    return out.sum(0).to(dtype) if split > 1 else out
