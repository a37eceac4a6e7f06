"""Writers for DeepSeek's published weight formats, for tests that build reduced checkpoints.

Written from the format descriptions (not with the loader's decoders), each returning the
exact value the stored bytes mean, so a test compares what was loaded with what was written.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from atom.models.common.formats import FP4_VALUES, round_fp4


def e8m0(exponent: torch.Tensor) -> torch.Tensor:
    """Power-of-two exponents -> E8M0 bytes (2^e is stored as e + 127)."""
    return (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def quant_fp8(w: torch.Tensor, block: tuple[int, int] = (128, 128)):
    """(e4m3 [out, in], E8M0 scale [ceil(out/bo), ceil(in/bi)], exact dequantized value)."""
    out, inp = w.shape
    bo, bi = block
    tiles = torch.zeros(-(-out // bo), -(-inp // bi))
    for i in range(tiles.shape[0]):
        for j in range(tiles.shape[1]):
            tile = w[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi]
            tiles[i, j] = torch.ceil(torch.log2(tile.abs().max().clamp(min=1e-8) / 448))
    full = torch.exp2(tiles.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:out, :inp])
    q = (w / full).to(torch.float8_e4m3fn)
    return q, e8m0(tiles), q.float() * full


def quant_fp4(w: torch.Tensor, group: int = 32, dtype: torch.dtype = torch.int8):
    """(packed [out, in/2] low nibble first, E8M0 scale [out, in/group], exact value).

    ``dtype``: how the bytes are stored (int8 as V4-Flash ships, ``float4_e2m1fn_x2`` as
    V4.1-Flash does)."""
    groups = w.unflatten(1, (-1, group))
    exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-8) / 6))
    values = round_fp4(groups / torch.exp2(exp)[..., None])
    table = torch.tensor(FP4_VALUES)
    codes = (values.abs()[..., None] == table).float().argmax(-1) | ((values < 0).long() << 3)
    codes = codes.flatten(1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(dtype)
    return packed, e8m0(exp), (values * torch.exp2(exp)[..., None]).flatten(1)


def save_shards(directory: Path, shards: tuple[dict, ...], drop=()) -> None:
    """Write ``shards`` as ``model-0000i-of-0000n.safetensors``, without the tensors ``drop``
    names (wherever they are)."""
    for name in drop:
        for shard in shards:
            shard.pop(name, None)
    directory.mkdir(parents=True, exist_ok=True)
    for i, shard in enumerate(shards):
        save_file(shard, str(directory / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"))
