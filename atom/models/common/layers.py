"""Position-local building blocks both DeepSeek families use: RMSNorm and bias-free linears.

``rms_norm`` is the one normalisation everywhere (a Triton kernel on CUDA where it applies,
``atom.kernels.norm``); ``hc_post`` is the mHC stream update X_j = post_j * out + sum_i C_ij X_i,
which both families' hyper-connections end with.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.kernels import invariant
from atom.kernels.norm import hc_post, rms_norm

__all__ = ["rms_norm", "hc_post", "RMSNorm", "Linear", "linear"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state dict) whose product is row-tiled in the
    batch-invariant mode (``atom.kernels.invariant.linear``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant.linear(x, self.weight, self.bias)


def linear(in_f: int, out_f: int, dtype: torch.dtype) -> Linear:
    return Linear(in_f, out_f, bias=False, dtype=dtype)
