"""The quantization V4 was trained with, simulated in float (round to the format and back).

The code lives in ``atom.models.common.formats`` (shared with V4.1); this module re-exports
V4's names from there so existing importers keep working.

* ``fp8_sim``: blocks of 64 along the last dim, scale = the power of two at or above
  amax / 448 (an E8M0 scale), values rounded to FP8 E4M3. V4 applies it to the NoPE dims of
  window KV and of compressed rows.
* ``fp4_sim``: blocks of 32, scale = the power of two at or above amax / 6, values rounded to
  the nearest FP4 E2M1 value. V4 applies it to the indexer's queries and keys after a
  ``hadamard`` rotation (orthonormal, so without the rounding it changes no score).

Each works row by row, so the paged forward and the oracle round the same values identically.
"""

from __future__ import annotations

from atom.models.common.formats import (
    FP4_MAX,
    FP4_VALUES,
    FP8_MAX,
    fp4_sim,
    fp8_sim,
    hadamard,
    pow2_scale,
    round_fp4,
)

_pow2_scale = pow2_scale  # the name this module used before the move

__all__ = [
    "FP4_MAX",
    "FP4_VALUES",
    "FP8_MAX",
    "fp4_sim",
    "fp8_sim",
    "hadamard",
    "round_fp4",
]
