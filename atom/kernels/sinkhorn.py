"""mHC's doubly stochastic mixing matrix, as DeepSeek's published V4 and V4.1 code computes it:
row softmax + eps, a column normalization, then ``iters - 1`` rounds of row and column
normalization, every denominator + eps (so it ends on columns), per token, in one kernel.

The torch expression launches 4 kernels per round (20 rounds, two hyper-connections per layer:
160 launches per layer per forward); on a GPU that is launch time, not math.
"""

from __future__ import annotations

import torch

from atom.kernels import invariant, use_triton


def sinkhorn_torch(logits: torch.Tensor, hc: int, iters: int, eps: float) -> torch.Tensor:
    """logits [N, hc * hc] float32 -> C [N, hc, hc] float32 (the reference expression)."""
    c = invariant.softmax(logits.reshape(-1, hc, hc), dim=-1) + eps
    c = c / (invariant.sum(c, 1, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (invariant.sum(c, 2, keepdim=True) + eps)
        c = c / (invariant.sum(c, 1, keepdim=True) + eps)
    return c


def sinkhorn(logits: torch.Tensor, hc: int, iters: int, eps: float) -> torch.Tensor:
    """Same as ``sinkhorn_torch``; one Triton kernel where ``use_triton`` allows (hc a power
    of two, no gradient wanted: the kernel has no backward), the torch expression elsewhere."""
    wants_grad = logits.requires_grad and torch.is_grad_enabled()
    usable = use_triton(logits, row_local=True) and logits.dtype == torch.float32
    if wants_grad or not usable or hc & (hc - 1):
        return sinkhorn_torch(logits, hc, iters, eps)
    from atom.kernels._sinkhorn_triton import sinkhorn_triton

    return sinkhorn_triton(logits, hc, iters, eps)
