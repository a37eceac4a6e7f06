"""Rotary position embedding in place, one kernel per call instead of ten.

The torch expression (``rope_torch_``) reads the rotated features as float32, computes the two
rotated halves with four products and two sums, stacks them, casts and writes them back: about
ten element-wise kernels for a [tokens, heads, dim] tensor, and V4.1's decode step rotates four
or five of them per layer (queries, window KV, index queries, the inverse on the attention
output, compressed rows). The kernel reads each pair once and writes it once, with the same
arithmetic in the same order and no fused multiply-add, so its bits equal the torch
expression's (tests/kernels/test_rope.py asserts equality, not closeness).
"""

from __future__ import annotations

import torch

from atom.kernels import use_triton


def rope_torch_(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    dim: int,
    inverse: bool = False,
    interleaved: bool = True,
) -> torch.Tensor:
    """Rotate x [N, ..., D]'s last ``dim`` features in place by cos, sin [N, dim/2] float32
    (one angle per row N); pairs (2i, 2i+1) when ``interleaved``, else (i, i + dim/2).
    ``inverse`` rotates by the negated angles. Returns x."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    if inverse:
        sin = -sin
    if interleaved:
        rot = x[..., -dim:].float()
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
        x[..., -dim:] = out.to(x.dtype)
        return x
    h = dim // 2
    rot = x[..., -dim:].to(torch.float32, copy=True)  # not a view of x: x is written below
    x1, x2 = rot[..., :h], rot[..., h:]
    first, second = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    x[..., -dim:-h] = first
    x[..., -h:] = second
    return x


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """x as [N, M, D] sharing its storage, or None where its strides do not allow one view."""
    if x.dim() < 2 or x.stride(-1) != 1:
        return None
    try:
        return x.view(x.shape[0], -1, x.shape[-1])
    except RuntimeError:
        return None


def rope_(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    dim: int,
    inverse: bool = False,
    interleaved: bool = True,
) -> torch.Tensor:
    """``rope_torch_`` as one Triton kernel where it can run (a CUDA tensor, or Triton's
    interpreter; row-local, so also in the batch-invariant mode; not under autograd or inside
    compiled glue): the same bits. Returns x."""
    x3 = None
    if not (torch.is_grad_enabled() and x.requires_grad) and use_triton(x, "rope", True):
        x3 = _rows(x)
    if x3 is None or x.shape[0] == 0 or x3.shape[1] == 0:
        return rope_torch_(x, cos, sin, dim, inverse, interleaved)
    from atom.kernels._rope_triton import rope_triton_

    cos = cos.reshape(x.shape[0], -1)
    sin = sin.reshape(x.shape[0], -1)
    if cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0):
        cos, sin = cos.contiguous(), sin.contiguous()
    rope_triton_(x3, cos.float(), sin.float(), dim, inverse, interleaved)
    return x
