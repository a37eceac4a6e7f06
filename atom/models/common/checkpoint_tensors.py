"""Stored tensors of a published checkpoint, read and put into their targets (the half of
``checkpoint.py`` that moves bytes; that file checks the whole checkpoint first).

``Reader`` reads a stored tensor, whole or a slice along one dimension (``Cut``), from
whichever shard holds it; ``load_tensor`` fills one target from one stored tensor: byte for byte
into a stored-precision target whose format and blocks match, else decoded (``decode``: FP8 /
FP4 with their E8M0 scales, only the scale blocks the slice covers) and, into an FP8 or FP4
target, quantized again (FP4 only if that gives the values back exactly). The formats are
``checkpoint.py``'s docstring's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from atom.models.common.formats import (
    e8m0_to_float,
    fp4_weight_quant,
    fp8_scale_shape,
    fp8_weight_quant,
    unpack_fp4,
)
from atom.models.common.fp8_rows import e8m0_bytes
from atom.models.common.weights import WeightLoadError

BF16, F32, FP8, FP8_ROWS, FP4, I64 = "bf16", "f32", "fp8", "fp8_rows", "fp4", "i64"

STORED = {  # safetensors dtype -> the stored format (any other: BF16)
    "F8_E4M3": FP8,
    "F4": FP4,
    "I8": FP4,
    "U8": FP4,
    "I64": I64,
    "I32": I64,
    "F32": F32,
}


def scale_name(name: str) -> str:
    """Where a quantized tensor's scale is stored: ``X.weight`` -> ``X.scale``."""
    return name.removesuffix(".weight") + ".scale"


#: (dim, first, end) of a tensor's logical elements a target holds; None: all of it
Cut = tuple[int, int, int] | None


def target_kind(params: Mapping[str, torch.Tensor], param: str) -> str:
    """FP8 (an ``Fp8Linear``'s weight), FP4 (an ``Fp4Linear``'s codes: uint8 beside uint8
    scales) or BF16 (any dense tensor, whatever its dtype)."""
    target, scale = params[param], params.get(param + "_scale")
    if target.dtype == torch.float8_e4m3fn:
        return FP8
    if target.dtype == torch.uint8 and scale is not None and scale.dtype == torch.uint8:
        return FP4
    return BF16


def logical_shape(params: Mapping[str, torch.Tensor], param: str) -> tuple[int, ...]:
    """The shape of the values a target holds (an FP4 target packs two per byte)."""
    shape = tuple(params[param].shape)
    if target_kind(params, param) == FP4:
        return shape[:-1] + (shape[-1] * 2,)
    return shape


class Reader:
    """Stored tensors, whole or a slice along one dimension, from whichever open file holds
    them (a quantized tensor's scale may be in another shard). ``__call__(name, cut)``: ``cut``
    is (dim, first, end) in stored elements (an FP4 tensor's bytes: two values each)."""

    def __init__(self, files: dict, found: dict):
        self.files, self.found = files, found

    def __call__(self, name: str, cut: Cut = None) -> torch.Tensor:
        file, dtype, _ = self.found[name]
        if dtype == "F4":
            return read_f4(file, name, cut)
        sf = self.files[file]
        if cut is None:
            return sf.get_tensor(name)
        dim, first, end = cut
        return sf.get_slice(name)[(slice(None),) * dim + (slice(first, end),)]


def _blocks(cut: Cut, block: tuple[int, ...]) -> tuple[Cut, int]:
    """(the cut of the scale tensor covering ``cut``'s blocks, the offset of ``cut`` in its
    first block)."""
    if cut is None:
        return None, 0
    dim, first, end = cut
    b = block[dim]
    return (dim, first // b, -(-end // b)), first - first // b * b


def _expand(scale: torch.Tensor, block: tuple[int, int], cut: Cut, shape) -> torch.Tensor:
    """Per-element float32 scales of a slice of ``shape`` from its covering blocks' scales."""
    s = e8m0_to_float(scale).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    _, offset = _blocks(cut, block)
    dim = cut[0] if cut is not None else 0
    return s.narrow(dim, offset, shape[dim]).narrow(1 - dim, 0, shape[1 - dim])


def _aligned(cut: Cut, block: tuple[int, ...], size: int) -> bool:
    """Whether ``cut`` starts on a block boundary and ends on one (or at the tensor's end)."""
    if cut is None:
        return True
    dim, first, end = cut
    return first % block[dim] == 0 and (end % block[dim] == 0 or end == size)


def load_tensor(
    layout, read: Reader, name: str, fmt: str, params, param: str, cut: Cut, want
) -> None:
    """Fill ``params[param]`` (and its ``_scale`` for a stored-precision target) from stored
    tensor ``name`` (of logical shape ``want``), or from the part of it ``cut`` names."""
    target, kind = params[param], target_kind(params, param)
    stored = STORED.get(read.found[name][1], BF16)
    size = want[cut[0]] if cut is not None else 0
    sname = scale_name(name)
    if kind == FP8 and fmt == FP8_ROWS:
        _load_rows(layout, read, name, params, param, cut, want)
        return
    if kind == FP8 and stored == FP8:
        block, scale = layout.fp8_block, params[param + "_scale"]
        fits = tuple(scale.shape) == fp8_scale_shape(tuple(target.shape), block)
        if fits and _aligned(cut, block, size):
            target.copy_(read(name, cut).view(torch.float8_e4m3fn).to(target.device))
            scale.copy_(e8m0_to_float(read(sname, _blocks(cut, block)[0])).to(scale.device))
            return
    if kind == FP4 and stored == FP4 and read.found[sname][1] in ("F8_E8M0", "U8"):
        group, scale = (1, layout.fp4_group), params[param + "_scale"]
        if _aligned(cut, group, size):
            target.copy_(read(name, _packed(cut)).view(torch.uint8).to(target.device))
            scale.copy_(read(sname, _blocks(cut, group)[0]).view(torch.uint8).to(scale.device))
            return
    value = decode(layout, read, name, fmt, cut)
    if kind == FP8:
        _quantize_fp8(layout, name, value, target, params[param + "_scale"])
    elif kind == FP4:
        _quantize_fp4(layout, name, value, target, params[param + "_scale"])
    else:
        target.copy_(value.to(device=target.device, dtype=target.dtype))


def _load_rows(layout, read: Reader, name: str, params, param: str, cut: Cut, want) -> None:
    """An FP8-rows target (``Fp8RowTable``: E4M3 rows beside the uint8 E8M0 scales of the
    groups its columns touch): FP8 rows stored with E8M0 scales are copied byte for byte;
    anything else is decoded over the covering groups' columns and quantized per group, so
    the scales are the unsplit table's."""
    target, scale = params[param], params[param + "_scale"]
    group = (1, layout.fp8_block[1])
    covering, _ = _blocks(cut, group)
    sname = scale_name(name)
    stored = STORED.get(read.found[name][1], BF16)
    if stored == FP8 and read.found.get(sname, (None, None))[1] in ("F8_E8M0", "U8"):
        target.copy_(read(name, cut).view(torch.float8_e4m3fn).to(target.device))
        scale.copy_(read(sname, covering).view(torch.uint8).to(scale.device))
        return
    first = 0
    if cut is not None:
        first = cut[1] - covering[1] * group[1]
        cut = (1, covering[1] * group[1], min(covering[2] * group[1], want[1]))
    q, s = fp8_weight_quant(decode(layout, read, name, FP8_ROWS, cut).float(), group)
    target.copy_(q[:, first : first + target.shape[1]].to(target.device))
    scale.copy_(e8m0_bytes(s).to(scale.device))


def _packed(cut: Cut) -> Cut:
    """A cut of FP4 values as a cut of their bytes (two per byte along K)."""
    if cut is None or cut[0] == 0:
        return cut
    return (cut[0], cut[1] // 2, -(-cut[2] // 2))


def _quantize_fp8(layout, name: str, value: torch.Tensor, weight, scale) -> None:
    """An FP8 target filled from decoded values (``fp8_weight_quant`` in the layout's block)."""
    block = layout.fp8_block
    q, s = fp8_weight_quant(value.float(), block)
    if tuple(s.shape) != tuple(scale.shape):
        raise WeightLoadError(
            f"tensor {name}: the FP8 linear's scales are {list(scale.shape)}, the layout's "
            f"{list(block)} blocks give {list(s.shape)}"
        )
    weight.copy_(q.to(weight.device))
    scale.copy_(s.to(scale.device))


def _quantize_fp4(layout, name: str, value: torch.Tensor, weight, scale) -> None:
    """An FP4 target filled from decoded values, which must be FP4 values (exactly)."""
    value = value.float()
    packed, exponent = fp4_weight_quant(value, layout.fp4_group)
    back = unpack_fp4(packed) * e8m0_to_float(exponent).repeat_interleave(layout.fp4_group, 1)
    if not torch.equal(back, value):
        raise WeightLoadError(
            f"tensor {name} holds values that are not FP4 values, so the FP4 expert it loads "
            "into cannot keep them; use weight_dtype bf16, or a checkpoint whose experts are "
            "stored as FP4"
        )
    weight.copy_(packed.to(weight.device))
    scale.copy_(exponent.to(scale.device))


def decode(layout, read: Reader, name: str, fmt: str, cut: Cut = None) -> torch.Tensor:
    """One published tensor (or the part ``cut`` names) as float (or int64), reading only the
    scale blocks it covers."""
    file, dtype, _ = read.found[name]
    stored = STORED.get(dtype, BF16)
    if stored not in (FP8, FP4):
        return read(name, cut)
    sname = scale_name(name)
    if stored == FP4:
        group = (1, layout.fp4_group)
        raw = read(name, _packed(cut))
        values = unpack_fp4(raw)
        if cut is not None and cut[0] == 1:  # an odd first column starts in a byte's high half
            values = values[:, cut[1] % 2 : cut[1] % 2 + cut[2] - cut[1]]
        return values * _expand(read(sname, _blocks(cut, group)[0]), group, cut, values.shape)
    block = (1, layout.fp8_block[1]) if fmt == FP8_ROWS else layout.fp8_block
    raw = read(name, cut).float()
    return raw * _expand(read(sname, _blocks(cut, block)[0]), block, cut, raw.shape)


def read_f4(file: Path, name: str, cut: Cut = None) -> torch.Tensor:
    """An ``F4`` tensor's bytes as uint8 [..., n/2] (or the part ``cut`` names, in bytes), read
    from the file's header offsets.

    safetensors 0.8 cannot hand an ``F4`` tensor to torch (it sizes ``float4_e2m1fn_x2``, two
    values per element, as one value per element), so the bytes are read directly: an 8-byte
    little-endian header length, the JSON header, then the data the offsets index. A part is
    read through a memory map, so only its bytes are copied.
    """
    with open(file, "rb") as fh:
        header_len = int.from_bytes(fh.read(8), "little")
        entry = json.loads(fh.read(header_len))[name]
    begin, end = entry["data_offsets"]
    shape = list(entry["shape"])
    shape[-1] //= 2
    data = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + header_len + begin, shape=shape)
    if cut is not None:
        dim, first, stop = cut
        data = data[(slice(None),) * dim + (slice(first, stop),)]
    return torch.from_numpy(np.array(data))  # a copy: the map is closed with it
