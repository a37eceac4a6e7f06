"""The number formats of DeepSeek-V4's published safetensors, decoded to float32.

* **FP8** weights: ``float8_e4m3fn`` values with one E8M0 scale per 128 x 128 tile (scale
  tensor ``[ceil(out/128), ceil(in/128)]``); value = e4m3 * 2^(s - 127).
* **FP4** routed experts: int8 bytes holding two E2M1 codes each, element 2j in the low nibble
  and 2j+1 in the high nibble (``[out, in/2]``), with one E8M0 scale per 32 inputs
  (``[out, in/32]``). A code's bit 3 is the sign, bits 0-2 index ``FP4_VALUES``.
* E8M0 scales are exponent bytes (``float8_e8m0fnu``; a numeric copy would destroy them, so
  they are read as uint8). A scale stored as float32 is taken as the multiplier itself.
"""

from __future__ import annotations

import torch

from atom.models.deepseek_v4.quant import FP4_VALUES

FP8_TILE = 128
FP4_GROUP = 32


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes (or float multipliers) -> float32 multipliers."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return torch.exp2(scale.view(torch.uint8).float() - 127.0)
    return scale.float()


def fp8_scale_shape(shape: tuple[int, int]) -> tuple[int, int]:
    return (-(-shape[0] // FP8_TILE), -(-shape[1] // FP8_TILE))


def dequant_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """weight e4m3 [out, in], scale [ceil(out/128), ceil(in/128)] -> float32 [out, in]."""
    out, inp = weight.shape
    s = e8m0_to_float(scale).repeat_interleave(FP8_TILE, 0).repeat_interleave(FP8_TILE, 1)
    return weight.float() * s[:out, :inp]


def fp4_shapes(shape: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """(packed weight shape, scale shape) of a logical [out, in] FP4 matrix."""
    return (shape[0], shape[1] // 2), (shape[0], shape[1] // FP4_GROUP)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed bytes [out, in/2] -> E2M1 values float32 [out, in] (low nibble first)."""
    b = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)
    table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=packed.device)
    mag = table[codes & 0x7]
    return torch.where(codes & 0x8 != 0, -mag, mag)


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Packed [out, in/2], scale [out, in/32] -> float32 [out, in]."""
    values = unpack_fp4(packed)
    return values * e8m0_to_float(scale).repeat_interleave(FP4_GROUP, 1)
