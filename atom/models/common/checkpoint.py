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

This file checks the checkpoint against the model and drives the load; reading a stored tensor
and filling its target is ``checkpoint_tensors.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from atom.models.common.checkpoint_tensors import (
    BF16,
    F32,
    FP4,
    FP8,
    FP8_ROWS,
    I64,
    STORED,
    Reader,
    load_tensor,
    logical_shape,
    scale_name,
)
from atom.models.common.formats import FP4_GROUP, fp4_shapes, fp8_scale_shape
from atom.models.common.weights import WeightLoadError

_ALLOWED = {  # stored formats each published format may arrive in (re-exports dequantize)
    BF16: {BF16, F32},
    F32: {F32, BF16},
    FP8: {FP8, BF16, F32},
    FP8_ROWS: {FP8, BF16, F32},
    FP4: {FP4, FP8, BF16, F32},
    I64: {I64},
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
        shape = list(logical_shape(params, param))
        if param in shards:
            dim, _, parts = shards[param]
            shape[dim] *= parts
        return tuple(shape)

    problems, scales = list(twice), set()
    for name, (param, fmt) in sorted(expected.items()):
        if name not in found:
            problems.append(f"missing tensor {name} ({fmt}, {list(whole(param))})")
            continue
        stored = STORED.get(found[name][1], BF16)
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
        read = Reader(files, found)
        for names in by_file.values():
            for name in names:
                param, fmt = expected[name]
                cut, want = None, whole(param)
                if param in shards:
                    dim, index, parts = shards[param]
                    n = want[dim] // parts
                    cut = (dim, index * n, (index + 1) * n)
                load_tensor(layout, read, name, fmt, params, param, cut, want)
    return unread
