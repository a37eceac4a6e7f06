"""V4's simulated activation quantization in one kernel: values rounded through FP8 E4M3 or
FP4 E2M1 per block of the last dim, with a power-of-two scale per block.

DeepSeek-V4 was trained with its window KV's NoPE dims (and its compressed rows') rounded
through E4M3 per 64 (``fp8_sim``) and its indexer's queries and keys rounded through E2M1 per
32 after a Hadamard rotation (``fp4_sim``); the forward reproduces both. As torch expressions
each call is about fifteen element-wise kernels (block amax, log2, ceil, exp2, division,
clamp, the cast or the E2M1 bucketing, the product, the casts; and a concatenation for the RoPE
dims the FP8 rounding skips), called two or three times per layer of a decode step. The kernel
reads each row once and writes it once with the same operations in the same order: the scale
as exp2(ceil(log2(amax * float32(1 / top)))) with libdevice's ``log2f`` and ``exp2f`` (torch's
CUDA kernels call them), IEEE division, E4M3 by the round-to-nearest-even cast, E2M1 by
comparison with the midpoints; so its bits equal the torch expression's on CUDA
(tests/kernels/test_block_round.py asserts equality there).
"""

from __future__ import annotations

import torch

from atom.kernels import use_triton
from atom.models.common.formats import (
    FP4_E8M0_AMAX_MIN,
    FP4_MAX,
    FP8_ACT_AMAX_MIN,
    FP8_MAX,
    fp4_sim,
    fp8_sim,
)

FORMATS = ("fp8", "fp4")


def block_round_torch(x: torch.Tensor, fmt: str, block: int, cols: int | None = None):
    """x [..., D] with its first ``cols`` (default all D; a multiple of ``block``) values
    through ``fp8_sim`` or ``fp4_sim`` (``fmt``) per ``block``, the rest as they are: a new
    tensor of x's shape and dtype."""
    sim = {"fp8": fp8_sim, "fp4": fp4_sim}[fmt]
    cols = x.shape[-1] if cols is None else cols
    if cols == x.shape[-1]:
        return sim(x, block)
    return torch.cat([sim(x[..., :cols], block), x[..., cols:]], -1)


def block_round(x: torch.Tensor, fmt: str, block: int, cols: int | None = None) -> torch.Tensor:
    """``block_round_torch`` as one Triton kernel where it can run (kernel ``block_round``;
    row-local: also in the batch-invariant mode; not under autograd): the same bits on CUDA."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    d = x.shape[-1]
    cols = d if cols is None else cols
    if not 0 < cols <= d or cols % block:
        raise ValueError(f"rounded columns {cols} must be a positive multiple of {block} <= {d}")
    grads = torch.is_grad_enabled() and x.requires_grad
    usable = not grads and x.dim() >= 1 and x.numel() > 0 and x.is_floating_point()
    if not (usable and use_triton(x, "block_round", row_local=True)):
        return block_round_torch(x, fmt, block, cols)
    from atom.kernels._block_round_triton import block_round_triton

    fp4 = fmt == "fp4"
    top, floor = (FP4_MAX, FP4_E8M0_AMAX_MIN) if fp4 else (FP8_MAX, FP8_ACT_AMAX_MIN)
    out = block_round_triton(x.reshape(-1, d), fp4, block, cols, top, floor)
    return out.view(x.shape)
