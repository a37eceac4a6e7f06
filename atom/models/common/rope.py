"""Rotary position embedding on the last ``dim`` features, with DeepSeek-style YaRN: ``Rope``
pairs features by halves (i, i + dim/2), ``InterleavedRope`` adjacent (2i, 2i + 1), as
DeepSeek's published V4 and V4.1 code rotate.

Angles are computed in float32 from integer positions, elementwise, so every path that rotates
position p computes the same bits for it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from atom.kernels import invariant
from atom.kernels.rope import rope_


def _yarn_inv_freq(dim: int, base: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    factor = float(scaling["factor"])
    orig = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast", 32))
    beta_slow = float(scaling.get("beta_slow", 1))
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))

    def correction(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction(beta_fast)), 0)
    high = min(math.ceil(correction(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    smooth = 1 - ramp
    freqs = freqs / factor * (1 - smooth) + freqs * smooth
    mscale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return freqs.float(), mscale


class Rope:
    """RoPE over the last ``dim`` features of a vector (rotate-half pairing)."""

    interleaved = False  # pairs (i, i + dim/2)

    def __init__(self, dim: int, theta: float, scaling: dict[str, Any] | None):
        self.dim = dim
        # what the angles depend on: ropes with equal keys compute equal cos and sin (``Angles``)
        self.table_key = (
            dim,
            float(theta),
            None if scaling is None else repr(sorted(scaling.items())),
        )
        if scaling is None:
            exps = torch.arange(0, dim, 2, dtype=torch.float64) / dim
            self.inv_freq = (1.0 / (theta**exps)).float()
            self.mscale = 1.0
        else:
            self.inv_freq, self.mscale = _yarn_inv_freq(dim, theta, scaling)
        self._cache: dict[torch.device, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, float32 [N, dim/2], for integer positions [N]."""
        inv = self._cache.get(positions.device)
        if inv is None:
            inv = self._cache.setdefault(positions.device, self.inv_freq.to(positions.device))
        angles = positions.to(torch.float32)[:, None] * inv[None, :]
        return invariant.pointwise(torch.cos, angles), invariant.pointwise(torch.sin, angles)

    def apply(
        self, x: torch.Tensor, cs: tuple[torch.Tensor, torch.Tensor], inverse: bool = False
    ) -> torch.Tensor:
        """Rotate the last ``dim`` features of x [N, ..., D] by the per-row angles in cs (a new
        tensor; ``apply_`` rotates in place)."""
        return self.apply_(x.clone(), cs, inverse)

    def apply_(
        self, x: torch.Tensor, cs: tuple[torch.Tensor, torch.Tensor], inverse: bool = False
    ) -> torch.Tensor:
        """``apply`` written into x's last ``dim`` features, the others untouched; returns x.
        For tensors the caller owns (a projection's output): only the rotated features are
        read and written, where ``apply`` copies all of them (a prefill chunk's queries are
        [tokens, 64, 512], of which 64 features rotate). The same bits as ``apply``; one
        kernel on CUDA (``atom.kernels.rope``)."""
        return rope_(x, cs[0], cs[1], self.dim, inverse, self.interleaved)


class InterleavedRope(Rope):
    """RoPE on the last ``dim`` features with pairs (2i, 2i+1), as DeepSeek's published V4 and
    V4.1 code rotates (feature pairs taken as complex numbers)."""

    interleaved = True  # pairs (2i, 2i + 1)


class Angles:
    """The cos and sin of one forward's positions, computed once per RoPE table: every layer
    whose rope has the same ``table_key`` (dimension, base, scaling) reads the same tensors,
    where each layer used to compute its own (four kernels a layer: cast, product, cos, sin).

    One per forward, made where the forward starts, never kept past it: a graph captures the
    one computation, and a later forward's positions (or a static buffer's new contents) are
    never answered from an earlier forward's tensors."""

    def __init__(self, positions: torch.Tensor):
        self.positions = positions
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def of(self, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """``rope.cos_sin(positions)``, shared with the ropes of the same table."""
        got = self._tables.get(rope.table_key)
        if got is None:
            got = self._tables[rope.table_key] = rope.cos_sin(self.positions)
        return got
