"""A lookup table kept at stored precision: FP8 E4M3 rows with one E8M0 scale per ``group``
values of a row, as DeepSeek-V4.1 ships its Engram tables (``fp8_rows`` in the published
layout; ``atom.models.common.checkpoint``).

``Fp8RowTable`` looks rows up as ``nn.Embedding`` does and returns them dequantized, exactly
the rows of the dequantized table: an E4M3 value times a power of two is a bf16 (and float32)
value, so nothing rounds. It holds a quarter of the float32 table's bytes and half of bf16's
(plus one byte per ``group`` values), which for the published tables (hundreds of millions of
rows per engram layer) is the difference between fitting a GPU and not.

Tensor parallelism splits the table by columns (``atom.models.common.tensor_parallel``): a rank
holds columns [first, first + n) of every row, as ``weight``, and the scale groups that cover
them, as ``weight_scale``; ``col0`` = first % group places its first column in its first group.
So a split need not keep whole groups: where one is cut, both ranks hold its scale.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from atom.models.common.formats import e8m0_to_float, fp8_weight_quant

log = logging.getLogger("atom.models")

GROUP = 32  # values per scale along a row (the published Engram table's)


def covering_groups(col0: int, n: int, group: int = GROUP) -> int:
    """How many scale groups columns [col0, col0 + n) of a group-aligned row touch."""
    return -(-(col0 + n) // group)


def e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 exponent bytes of float32 powers of two (normal ones: 2^-126 .. 2^127)."""
    return ((scale.float().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


class Fp8RowTable(nn.Module):
    """nn.Embedding's lookup over FP8 rows with E8M0 scales per ``group`` (module doc).

    ``weight`` [rows, n] ``float8_e4m3fn``, ``weight_scale`` [rows, covering groups] uint8
    E8M0 bytes; ``forward(ids)`` -> [*ids.shape, n] in ``dtype``."""

    def __init__(
        self,
        rows: int,
        dim: int,
        *,
        group: int = GROUP,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if dim % group:
            raise ValueError(f"a row of {dim} values does not split into groups of {group}")
        self.group, self.dtype, self.col0 = group, dtype, 0
        kw = dict(device=device)
        self.register_buffer("weight", torch.empty(rows, dim, dtype=torch.float8_e4m3fn, **kw))
        self.register_buffer(
            "weight_scale", torch.empty(rows, dim // group, dtype=torch.uint8, **kw)
        )

    @property
    def num_embeddings(self) -> int:
        return self.weight.shape[0]

    @property
    def embedding_dim(self) -> int:
        return self.weight.shape[1]

    @classmethod
    @torch.no_grad()
    def from_dense(cls, table: torch.Tensor, group: int = GROUP) -> Fp8RowTable:
        """A dense [rows, dim] table quantized per (1, group): E8M0 scale of each group's
        amax (``fp8_weight_quant``), values rounded to E4M3; quantizing a dequantized table
        again gives its values back (a group at the format's top may come back at twice the
        scale and half the codes: the same values, other bytes)."""
        rows, dim = table.shape
        out = cls(rows, dim, group=group, dtype=table.dtype, device=table.device)
        q, scale = fp8_weight_quant(table, (1, group))
        out.weight.copy_(q)
        out.weight_scale.copy_(e8m0_bytes(scale))
        return out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # gathered as bytes: index ops take uint8 on every device
        codes = self.weight.view(torch.uint8)[ids].view(torch.float8_e4m3fn)
        scales = e8m0_to_float(self.weight_scale[ids])
        n = self.weight.shape[1]
        which = torch.arange(self.col0, self.col0 + n, device=ids.device) // self.group
        return (codes.float() * scales[..., which]).to(self.dtype)

    def dense(self) -> torch.Tensor:
        """The table dequantized, [rows, n] in ``dtype`` (exact)."""
        return self(torch.arange(self.num_embeddings, device=self.weight.device))

    def tp_narrowed(self, attr: str, dim: int, rank: int, world: int) -> None:
        """``tensor_parallel.shard_model`` narrowed ``attr`` along ``dim`` to rank ``rank`` of
        ``world``'s slice: with the weight's columns, keep the scale groups covering them
        (``weight`` holds n = dim / world columns starting at rank * n)."""
        if attr != "weight" or dim != 1:
            raise ValueError(f"an Fp8RowTable splits its weight by columns, not {attr} dim {dim}")
        n = self.weight.shape[1]
        first = rank * n
        g0, self.col0 = divmod(first, self.group)
        count = covering_groups(self.col0, n, self.group)
        self.weight_scale = self.weight_scale.narrow(1, g0, count).clone()


def table_names(model: nn.Module, rows: Iterable[tuple[str, str, str]]) -> list[str]:
    """The ``nn.Embedding`` modules of ``model`` a published layout stores as FP8 rows
    (``rows``: (published name, parameter name, format), ``{L}`` placeholders)."""
    import re

    pats = [
        re.compile(re.escape(p.removesuffix(".weight")).replace(re.escape("{L}"), r"\d+") + "$")
        for _, p, fmt in rows
        if fmt == "fp8_rows" and p.endswith(".weight")
    ]
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Embedding) and any(p.match(name) for p in pats)
    ]


@torch.no_grad()
def quantize_tables(model: nn.Module, names: Iterable[str], *, empty: bool = False) -> int:
    """Replace each named ``nn.Embedding`` by its ``Fp8RowTable`` (quantized from its values,
    or, with ``empty``, for a loader to fill); returns how many. A table whose width is not a
    whole number of groups (a column split that cut one, after loading) stays dense, logged."""
    from atom.models.common.fp8_linear import replace_module

    count = 0
    for name in names:
        table = model.get_submodule(name)
        rows, dim = table.weight.shape
        if dim % GROUP:
            log.info("%s: %d columns are not whole groups of %d; kept dense", name, dim, GROUP)
            continue
        dtype, device = table.weight.dtype, table.weight.device
        new = (
            Fp8RowTable(rows, dim, dtype=dtype, device=device)
            if empty
            else Fp8RowTable.from_dense(table.weight)
        )
        replace_module(model, name, new)
        count += 1
    return count


@torch.no_grad()
def dequantize_tables(model: nn.Module) -> int:
    """Replace every ``Fp8RowTable`` by an ``nn.Embedding`` of its dequantized rows."""
    from atom.models.common.fp8_linear import replace_module

    names = [n for n, m in model.named_modules() if isinstance(m, Fp8RowTable)]
    for name in names:
        table = model.get_submodule(name)
        dense = table.dense()
        new = nn.Embedding(*dense.shape, dtype=dense.dtype, device=dense.device)
        new.weight.copy_(dense)
        replace_module(model, name, new)
    return len(names)
