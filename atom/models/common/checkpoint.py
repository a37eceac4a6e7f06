"""Load a checkpoint in DeepSeek's published layout: DeepSeek's tensor names, FP8 / FP4 weights
with E8M0 scales, several shards. Both families' published loaders are this one, given their
``Layout`` (which rows a model has, and the block sizes its FP8 and FP4 weights use).

A ``Layout`` row is ``(published name, parameter name, published format)``, with ``{L}`` a
layer, ``{M}`` a draft block and ``{E}`` a routed expert. The loader decides each tensor's
decoding from its stored dtype (so a bf16 re-export loads too), but refuses a stored format the
row does not allow. A quantized tensor ``X.weight`` has its scale in ``X.scale`` (for a tensor
named ``X`` without ``.weight``, in ``X.scale`` too), possibly in another shard.

Formats:

* ``fp8``: ``float8_e4m3fn`` [out, in] with one scale per ``fp8_block`` block (V4 128 x 128,
  V4.1 32 x 32), scale ``[ceil(out/bo), ceil(in/bi)]``;
* ``fp8_rows``: the same with blocks of one row (a table whose rows are read one at a time, such
  as V4.1's Engram embedding), scale ``[rows, ceil(dim/bi)]``;
* ``fp4``: two E2M1 codes per byte, element 2j in the low nibble, [out, in/2] (stored as
  ``float4_e2m1fn_x2``, int8 or uint8), one scale per ``fp4_group`` inputs ``[out, in/group]``;
* ``bf16``, ``f32``, ``i64``: taken as stored (cast to the parameter's dtype).

Scales are E8M0 exponent bytes (``float8_e8m0fnu`` or uint8) or float multipliers.

The whole check runs before anything is copied: a refused checkpoint leaves the model as it was.
Values are dequantized at load to the parameter's dtype, except into a stored-precision target,
whose scale is beside its weight as ``X.weight_scale``:

* an FP8 target (an ``Fp8Linear``'s ``float8_e4m3fn`` weight): an FP8 tensor stored in the
  layout's block goes there byte for byte with its scale; any other stored format is decoded
  and quantized (``fp8_weight_quant``);
* an FP4 target (an ``Fp4Linear``'s uint8 codes, uint8 E8M0 scales): an FP4 tensor with E8M0
  scales goes there byte for byte; any other is decoded and quantized (``fp4_weight_quant``),
  and refused (``WeightLoadError``, once the tensors before it are copied) unless that gives
  its values back exactly.

Tensor parallelism (``shards``): a target that holds slice ``index`` of ``parts`` of a stored
tensor along ``dim`` has only that slice read, and of its scale only the blocks (FP8) or groups
(FP4, along K) the slice covers. A slice that starts and ends on block boundaries is copied byte
for byte as above; one that cuts a block (a dense target only: ``tensor_parallel.check_split``
refuses such splits of stored-precision targets) is dequantized from the covering blocks.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from atom.models.common.formats import (
    FP4_GROUP,
    e8m0_to_float,
    fp4_shapes,
    fp4_weight_quant,
    fp8_scale_shape,
    fp8_weight_quant,
    unpack_fp4,
)
from atom.models.common.fp8_rows import e8m0_bytes
from atom.models.common.weights import WeightLoadError

BF16, F32, FP8, FP8_ROWS, FP4, I64 = "bf16", "f32", "fp8", "fp8_rows", "fp4", "i64"

_ALLOWED = {  # stored formats each published format may arrive in (re-exports dequantize)
    BF16: {BF16, F32},
    F32: {F32, BF16},
    FP8: {FP8, BF16, F32},
    FP8_ROWS: {FP8, BF16, F32},
    FP4: {FP4, FP8, BF16, F32},
    I64: {I64},
}
_STORED = {
    "F8_E4M3": FP8,
    "F4": FP4,
    "I8": FP4,
    "U8": FP4,
    "I64": I64,
    "I32": I64,
    "F32": F32,
}


@dataclass(frozen=True)
class Layout:
    """One family's published checkpoint layout.

    ``rows``: (published name, parameter name, published format). ``unread``: for a stored
    tensor no row expects, the reason it is left unread (a draft stage the model does not
    build, a vision tower), or None when it is unexpected (refused).
    """

    rows: tuple[tuple[str, str, str], ...]
    fp8_block: tuple[int, int]
    fp4_group: int = FP4_GROUP
    unread: Callable[[str], str | None] = lambda name: None


def expected_names(
    layout: Layout, params: Mapping[str, torch.Tensor], counts: Mapping[str, int]
) -> dict[str, tuple[str, str]]:
    """published name -> (parameter name, published format) for every row the model has.

    ``counts``: how many of each placeholder the model builds (``{"L": layers, "M": draft
    blocks, "E": routed experts}``). A row whose parameter the model lacks (a window layer's
    compressor) is not expected; a parameter no row names is an error in the table.
    """
    out: dict[str, tuple[str, str]] = {}
    for ckpt, param, fmt in layout.rows:
        keys = [k for k in "LME" if "{" + k + "}" in ckpt]
        combos: list[dict[str, int]] = [{}]
        for k in keys:
            combos = [dict(c, **{k: i}) for c in combos for i in range(counts.get(k, 0))]
        for c in combos:
            name = param.format(**{k: c[k] for k in keys}) if keys else param
            if name in params:
                out[ckpt.format(**{k: c[k] for k in keys}) if keys else ckpt] = (name, fmt)
    mapped = {p for p, _ in out.values()}
    # an FP8 linear kept as stored (``Fp8Linear``) has its scale beside its weight: loaded with it
    unmapped = {
        p
        for p in set(params) - mapped
        if not (p.endswith(".weight_scale") and p.removesuffix("_scale") in mapped)
    }
    if unmapped:
        raise WeightLoadError(f"no published name for parameters {sorted(unmapped)[:5]}")
    return out


def scale_name(name: str) -> str:
    """Where a quantized tensor's scale is stored: ``X.weight`` -> ``X.scale``."""
    return name.removesuffix(".weight") + ".scale"


def _shapes(layout: Layout, fmt: str, stored: str, dtype: str, want: tuple[int, ...]):
    """(stored shape, scale shape or None) a tensor of logical shape ``want`` has. safetensors
    counts ``F4`` in 4-bit elements (the logical shape), int8 / uint8 bytes in bytes."""
    if stored == FP4 and dtype == "F4":
        return want, fp4_shapes(want, layout.fp4_group)[1]
    if stored == FP8:
        block = (1, layout.fp8_block[1]) if fmt == FP8_ROWS else layout.fp8_block
        return want, fp8_scale_shape(want, block)
    if stored == FP4:
        return fp4_shapes(want, layout.fp4_group)
    return want, None


def _check(layout, name, fmt, stored, dtype, shape, want, scale) -> str | None:
    """A problem with one tensor (None when it fits)."""
    if stored not in _ALLOWED[fmt]:
        return f"tensor {name} is stored as {stored}; the published format is {fmt}"
    if stored in (FP8, FP4) and scale is None:
        return f"tensor {name} is {stored} but its scale {scale_name(name)} is missing"
    want_shape, want_scale = _shapes(layout, fmt, stored, dtype, want)
    if shape != want_shape or (want_scale is not None and scale != want_scale):
        kind = "packed shape" if stored == FP4 and dtype != "F4" else "shape"
        got = f"{kind} {list(shape)}" + (f" (scale {list(scale)})" if scale else "")
        need = f"{list(want_shape)}" + (f" (scale {list(want_scale)})" if want_scale else "")
        logical = f" for {list(want)}" if want_shape != want else ""
        return f"tensor {name} has {got}, the model expects {need}{logical}"
    return None


def _files(path: Path) -> list[Path]:
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {path}")
    return files


@torch.no_grad()
def load_published(
    params: Mapping[str, torch.Tensor],
    path: str | Path,
    layout: Layout,
    expected: Mapping[str, tuple[str, str]],
    *,
    shards: Mapping[str, tuple[int, int, int]] | None = None,
) -> dict[str, str]:
    """Copy every expected tensor from the safetensors at ``path`` (a file or a directory)
    into ``params``, decoded; returns the stored tensors left unread, with the reason
    (``layout.unread``), for the caller to log.

    Refuses, before copying anything, a missing tensor, an unexpected one (``layout.unread``
    aside), a quantized tensor without its scale, and a tensor or scale of the wrong shape,
    naming each. ``shards`` (tensor parallelism): parameter name -> (dim, index, parts) for a
    parameter that holds slice ``index`` of ``parts`` of the stored tensor along ``dim``.
    """
    path, shards = Path(path), shards or {}
    found: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    twice: list[str] = []
    for f in _files(path):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                sl = sf.get_slice(name)
                if name in found:
                    twice.append(
                        f"tensor {name} is stored twice, in {found[name][0].name} and {f.name}"
                    )
                found[name] = (f, sl.get_dtype(), tuple(sl.get_shape()))

    def whole(param: str) -> tuple[int, ...]:
        shape = list(_logical_shape(params, param))
        if param in shards:
            dim, _, parts = shards[param]
            shape[dim] *= parts
        return tuple(shape)

    problems, scales = list(twice), set()
    for name, (param, fmt) in sorted(expected.items()):
        if name not in found:
            problems.append(f"missing tensor {name} ({fmt}, {list(whole(param))})")
            continue
        stored = _STORED.get(found[name][1], BF16)
        sname = scale_name(name)
        scale = found[sname][2] if sname in found and sname != name else None
        if stored in (FP8, FP4) and scale is not None:
            scales.add(sname)
        dtype, shape = found[name][1], found[name][2]
        problem = _check(layout, name, fmt, stored, dtype, shape, whole(param), scale)
        if problem:
            problems.append(problem)
    unread: dict[str, str] = {}
    for name in sorted(set(found) - set(expected) - scales):
        reason = layout.unread(name)
        if reason is not None:
            unread[name] = reason
            continue
        f, dtype, shape = found[name]
        problems.append(f"unexpected tensor {name} ({dtype} {list(shape)}) in {f.name}")
    if problems:
        shown = "; ".join(problems[:20])
        more = f" (and {len(problems) - 20} more)" if len(problems) > 20 else ""
        raise WeightLoadError(f"checkpoint {path} does not fit the model: {shown}{more}")
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(found[name][0], []).append(name)
    with ExitStack() as stack:
        files = {f: stack.enter_context(safe_open(str(f), framework="pt")) for f in _files(path)}
        read = _Reader(files, found)
        for names in by_file.values():
            for name in names:
                param, fmt = expected[name]
                cut, want = None, whole(param)
                if param in shards:
                    dim, index, parts = shards[param]
                    n = want[dim] // parts
                    cut = (dim, index * n, (index + 1) * n)
                _load(layout, read, name, fmt, params, param, cut, want)
    return unread


#: (dim, first, end) of a tensor's logical elements a target holds; None: all of it
Cut = tuple[int, int, int] | None


def _target_kind(params: Mapping[str, torch.Tensor], param: str) -> str:
    """FP8 (an ``Fp8Linear``'s weight), FP4 (an ``Fp4Linear``'s codes: uint8 beside uint8
    scales) or BF16 (any dense tensor, whatever its dtype)."""
    target, scale = params[param], params.get(param + "_scale")
    if target.dtype == torch.float8_e4m3fn:
        return FP8
    if target.dtype == torch.uint8 and scale is not None and scale.dtype == torch.uint8:
        return FP4
    return BF16


def _logical_shape(params: Mapping[str, torch.Tensor], param: str) -> tuple[int, ...]:
    """The shape of the values a target holds (an FP4 target packs two per byte)."""
    shape = tuple(params[param].shape)
    if _target_kind(params, param) == FP4:
        return shape[:-1] + (shape[-1] * 2,)
    return shape


class _Reader:
    """Stored tensors, whole or a slice along one dimension, from whichever open file holds
    them (a quantized tensor's scale may be in another shard). ``__call__(name, cut)``: ``cut``
    is (dim, first, end) in stored elements (an FP4 tensor's bytes: two values each)."""

    def __init__(self, files: dict, found: dict):
        self.files, self.found = files, found

    def __call__(self, name: str, cut: Cut = None) -> torch.Tensor:
        file, dtype, _ = self.found[name]
        if dtype == "F4":
            return _read_f4(file, name, cut)
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


def _load(layout, read: _Reader, name: str, fmt: str, params, param: str, cut: Cut, want) -> None:
    """Fill ``params[param]`` (and its ``_scale`` for a stored-precision target) from stored
    tensor ``name`` (of logical shape ``want``), or from the part of it ``cut`` names."""
    target, kind = params[param], _target_kind(params, param)
    stored = _STORED.get(read.found[name][1], BF16)
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
    value = _decode(layout, read, name, fmt, cut)
    if kind == FP8:
        _quantize_fp8(layout, name, value, target, params[param + "_scale"])
    elif kind == FP4:
        _quantize_fp4(layout, name, value, target, params[param + "_scale"])
    else:
        target.copy_(value.to(device=target.device, dtype=target.dtype))


def _load_rows(layout, read: _Reader, name: str, params, param: str, cut: Cut, want) -> None:
    """An FP8-rows target (``Fp8RowTable``: E4M3 rows beside the uint8 E8M0 scales of the
    groups its columns touch): FP8 rows stored with E8M0 scales are copied byte for byte;
    anything else is decoded over the covering groups' columns and quantized per group, so
    the scales are the unsplit table's."""
    target, scale = params[param], params[param + "_scale"]
    group = (1, layout.fp8_block[1])
    covering, _ = _blocks(cut, group)
    sname = scale_name(name)
    stored = _STORED.get(read.found[name][1], BF16)
    if stored == FP8 and read.found.get(sname, (None, None))[1] in ("F8_E8M0", "U8"):
        target.copy_(read(name, cut).view(torch.float8_e4m3fn).to(target.device))
        scale.copy_(read(sname, covering).view(torch.uint8).to(scale.device))
        return
    first = 0
    if cut is not None:
        first = cut[1] - covering[1] * group[1]
        cut = (1, covering[1] * group[1], min(covering[2] * group[1], want[1]))
    q, s = fp8_weight_quant(_decode(layout, read, name, FP8_ROWS, cut).float(), group)
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


def _decode(layout, read: _Reader, name: str, fmt: str, cut: Cut = None) -> torch.Tensor:
    """One published tensor (or the part ``cut`` names) as float (or int64), reading only the
    scale blocks it covers."""
    file, dtype, _ = read.found[name]
    stored = _STORED.get(dtype, BF16)
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


def _read_f4(file: Path, name: str, cut: Cut = None) -> torch.Tensor:
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
