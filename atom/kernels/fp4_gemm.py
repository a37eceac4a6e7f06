"""Products with packed FP4 weights (DeepSeek's routed experts as shipped), without a
dequantized copy of the weights: ``fp4_grouped_linear`` (rows sorted by expert, each group
against its own expert) and ``fp4_linear`` (one weight).

The torch expression dequantizes the weight to the rows' dtype (``dequant_fp4``: exact, an
E2M1 value times a power of two fits bf16 and float32) and multiplies (``invariant.linear``:
row-tiled in the batch-invariant mode); it is the CPU path and the numerical reference. On
CUDA (or under Triton's interpreter) one Triton kernel (``atom.kernels._fp4_gemm_triton``)
dequantizes tiles in registers: the same products, summed in another order (a float32
accumulator over K tiles). Its launch is one per dtype whatever the
row count, and K is not split, so it is row-local: it runs in the batch-invariant mode too.
Switch: ``fp4_gemm`` (``triton_off``).
"""

from __future__ import annotations

import torch

from atom.kernels import invariant, use_triton
from atom.models.common.formats import FP4_GROUP, dequant_fp4


def fp4_usable(x: torch.Tensor) -> bool:
    """Whether the kernel runs for rows like ``x``: CUDA (or the interpreter), Triton, the
    ``fp4_gemm`` switch on, no gradient, a dtype it takes."""
    if torch.is_grad_enabled() and x.requires_grad:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    return use_triton(x, "fp4_gemm", row_local=True)


def dequantized(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., N, K/2] codes and [..., N, K/32] E8M0 scales -> [..., N, K] weights in ``dtype``."""
    lead = packed.shape[:-2]
    flat_p = packed.reshape(-1, packed.shape[-1])
    flat_s = scale.reshape(-1, scale.shape[-1])
    w = dequant_fp4(flat_p, flat_s, FP4_GROUP).to(dtype)
    return w.view(*lead, packed.shape[-2], -1)


def fp4_grouped_linear_torch(x, packed, scale, ends) -> torch.Tensor:
    """The kernel's expression: each group's rows times its dequantized weight (one host read
    of ``ends``)."""
    out = x.new_empty(x.shape[0], packed.shape[1])
    start = 0
    for g, end in enumerate(ends.tolist()):
        if end > start:
            w = dequantized(packed[g], scale[g], x.dtype)
            out[start:end] = invariant.linear(x[start:end], w)
        start = end
    return out


def fp4_grouped_linear(x, packed, scale, ends, tiles=None) -> torch.Tensor:
    """x [R, K] rows sorted by group (group g's end at ``ends[g]``, a cumulative count on x's
    device) times group g's FP4 weight (packed [G, N, K/2], scale [G, N, K/32]) -> [R, N] in
    x's dtype. ``tiles``: ``fp4_tiles(ends, R, x.dtype)`` for calls sharing the grouping."""
    if fp4_usable(x):
        from atom.kernels._fp4_gemm_triton import fp4_grouped_linear_triton

        return fp4_grouped_linear_triton(x, packed, scale, ends, tiles)
    return fp4_grouped_linear_torch(x, packed, scale, ends)


def fp4_tiles(ends: torch.Tensor, rows: int, x: torch.Tensor):
    """The kernel's tile table for a grouping (None where the kernel does not run for x)."""
    if not fp4_usable(x):
        return None
    from atom.kernels._fp4_gemm_triton import group_tiles_for

    return group_tiles_for(ends, rows, x.dtype)


def fp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] times one FP4 weight (packed [N, K/2], scale [N, K/32]) -> [..., N]."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    if fp4_usable(rows):
        ends = torch.full((1,), rows.shape[0], dtype=torch.int64, device=x.device)
        y = fp4_grouped_linear(rows, packed[None], scale[None], ends)
    else:
        y = invariant.linear(rows, dequantized(packed, scale, x.dtype))
    return y.view(*lead, packed.shape[0])
