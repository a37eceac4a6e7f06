"""The quantization V4 was trained with, simulated in float (round to the format and back).

* ``fp8_sim``: blocks of 64 along the last dim, scale = the power of two at or above
  amax / 448 (an E8M0 scale), values rounded to FP8 E4M3. V4 applies it to the NoPE dims of
  window KV and of compressed rows.
* ``fp4_sim``: blocks of 32, scale = the power of two at or above amax / 6, values rounded to
  the nearest FP4 E2M1 value. V4 applies it to the indexer's queries and keys after a
  ``hadamard`` rotation (orthonormal, so without the rounding it changes no score).

Each works row by row, so the paged forward and the oracle round the same values identically.
"""

from __future__ import annotations

import math

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # E2M1 magnitudes, by code 0..7


def _pow2_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(amax / top)))


def fp8_sim(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """x [..., D] (D % block == 0) rounded through E4M3 with a power-of-two scale per block."""
    xb = x.float().unflatten(-1, (-1, block))
    scale = _pow2_scale(xb.abs().amax(-1, keepdim=True).clamp(min=1e-4), FP8_MAX)
    q = (xb / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).flatten(-2).to(x.dtype)


def round_fp4(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value (|x| <= 6), ties to the even code, sign kept."""
    grid = torch.tensor(FP4_VALUES, dtype=torch.float32, device=x.device)
    mag = x.abs().clamp(max=FP4_MAX)
    hi = torch.bucketize(mag, grid).clamp(max=len(FP4_VALUES) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return torch.where(pick_hi, grid[hi], grid[lo]) * torch.sign(x)


def fp4_sim(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x [..., D] (D % block == 0) rounded through E2M1 with a power-of-two scale per block."""
    xb = x.float().unflatten(-1, (-1, block))
    scale = _pow2_scale(xb.abs().amax(-1, keepdim=True).clamp(min=FP4_MAX * 2.0**-126), FP4_MAX)
    return (round_fp4(xb / scale) * scale).flatten(-2).to(x.dtype)


_HADAMARD: dict[tuple[int, torch.device], torch.Tensor] = {}


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform of the last dim (a power of two), in float32."""
    n = x.shape[-1]
    key = (n, x.device)
    h = _HADAMARD.get(key)
    if h is None:
        h = torch.ones(1, 1)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        h = _HADAMARD.setdefault(key, (h / math.sqrt(n)).to(x.device))
    return x.float() @ h
