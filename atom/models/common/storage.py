"""Storage rounding for PAGE rows and window rings (both families).

Whatever is stored is read back through the same rounding, and the reference forward applies
``roundtrip`` at the same points, so the paged and reference paths see identical values.
"""

from __future__ import annotations

import torch

from atom.models.common.geometry import FP8_DTYPE, FP8_MAX, KV_DTYPES


def pack_index(x: torch.Tensor, index_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x float32 [..., D] -> (stored payload, fp32 scale [..., 1] for fp8 else None)."""
    if index_dtype == "fp8":
        scale = (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        return (x / scale).to(FP8_DTYPE), scale
    return x.to(KV_DTYPES[index_dtype]), None


def unpack_index(payload: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    out = payload.float()
    return out * scale if scale is not None else out


def index_roundtrip(x: torch.Tensor, index_dtype: str) -> torch.Tensor:
    return unpack_index(*pack_index(x.float(), index_dtype))


def kv_roundtrip(x: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    return x.to(KV_DTYPES[kv_dtype]).to(x.dtype)
