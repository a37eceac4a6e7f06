"""The number formats of DeepSeek-V4's published safetensors, decoded to float32.

The code lives in ``atom.models.common.formats`` (shared with V4.1); this module re-exports
V4's names from there so existing importers keep working. V4 uses the defaults:

* **FP8** weights: ``float8_e4m3fn`` values with one E8M0 scale per 128 x 128 tile (scale
  tensor ``[ceil(out/128), ceil(in/128)]``); value = e4m3 * 2^(s - 127).
* **FP4** routed experts: int8 bytes holding two E2M1 codes each, element 2j in the low nibble
  and 2j+1 in the high nibble (``[out, in/2]``), with one E8M0 scale per 32 inputs
  (``[out, in/32]``). A code's bit 3 is the sign, bits 0-2 index ``FP4_VALUES``.
* E8M0 scales are exponent bytes (``float8_e8m0fnu``; a numeric copy would destroy them, so
  they are read as uint8). A scale stored as float32 is taken as the multiplier itself.
"""

from __future__ import annotations

from atom.models.common.formats import (
    FP4_GROUP,
    FP4_VALUES,
    FP8_TILE,
    dequant_fp4,
    dequant_fp8,
    e8m0_to_float,
    fp4_shapes,
    fp8_scale_shape,
    unpack_fp4,
)

__all__ = [
    "FP4_GROUP",
    "FP4_VALUES",
    "FP8_TILE",
    "dequant_fp4",
    "dequant_fp8",
    "e8m0_to_float",
    "fp4_shapes",
    "fp8_scale_shape",
    "unpack_fp4",
]
