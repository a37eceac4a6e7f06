"""The experts' clamped SwiGLU product in one kernel: what runs between an expert's gate/up
projections and its down projection.

The torch expression (``swiglu_torch``) casts the two projections to float32, clamps each,
applies SiLU, multiplies, scales by the routing weight (gathered into expert order for the
grouped path) and rounds to the activations' dtype: eight or nine element-wise kernels for each
routed group and each shared expert, in every layer of a decode step. The kernel reads g and u
once and writes h once with the same operations in the same order: SiLU as torch's CUDA kernel
computes it, x / (1 + expf(-x)) with libdevice's ``expf`` and IEEE division, no fused
multiply-add, clamps that keep NaN as torch's do; so its bits equal the torch expression's on
CUDA (tests/kernels/test_swiglu.py asserts equality there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom.kernels import invariant, use_triton


def swiglu_torch(
    g: torch.Tensor,
    u: torch.Tensor,
    limit: float,
    dtype: torch.dtype,
    w: torch.Tensor | None = None,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """(silu(g.clamp(max=limit)) * u.clamp(-limit, limit) * w).to(dtype), in float32: g, u
    [R, I]; ``w`` [R] or [R, 1] the rows' weights, or with ``order`` [R] the weights of rows
    ``order`` of ``w`` flattened (the grouped path's expert order); None: no weight."""
    g = g.float().clamp(max=limit)
    u = u.float().clamp(-limit, limit)
    h = invariant.pointwise(F.silu, g) * u
    if w is not None:
        w = w.flatten() if order is None else w.flatten()[order]
        h = h * w[:, None]
    return h.to(dtype)


def swiglu(
    g: torch.Tensor,
    u: torch.Tensor,
    limit: float,
    dtype: torch.dtype,
    w: torch.Tensor | None = None,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """``swiglu_torch`` as one Triton kernel where it can run (kernel ``swiglu``; row-local:
    also in the batch-invariant mode; not under autograd): the same bits on CUDA."""
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (g, u, w))
    usable = not grads and g.dim() == 2 and g.shape == u.shape and g.shape[0] > 0
    if not (usable and use_triton(g, "swiglu", row_local=True)):
        return swiglu_torch(g, u, limit, dtype, w, order)
    from atom.kernels._swiglu_triton import swiglu_triton

    return swiglu_triton(g, u, float(limit), dtype, w, order)
