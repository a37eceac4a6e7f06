"""Pool-geometry pieces every family lays out the same way: dtype names, PAGE planes, state
fields and their alignment, the argument checks, the layout id, and what a geometry answers.

A family's geometry module decides which planes and fields exist (its model's facts); the
byte rules for placing them, and what goes into the layout id, are here, once.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import torch
import xxhash

from atom.model_api import StateSpec

KV_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
INDEX_DTYPES = ("fp8", "bf16", "fp32")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# the dtypes a model may compute in
COMPUTE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FIELD_ALIGN = 64
STATE_ALIGN = 1024
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


class GeometryError(ValueError):
    """Arguments that cannot form a pool geometry; the message names the value and the fix."""


@dataclass(frozen=True)
class PlaneSpec:
    """One plane of a PAGE block: ``rows`` rows of ``row_bytes`` at ``offset`` in the block."""

    name: str
    owner_layer: int
    rows: int
    row_bytes: int
    offset: int
    dtype: str  # kv dtype name for main planes; "fp8" (+fp32 scale) / "bf16" / "fp32" for index

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


@dataclass(frozen=True)
class StateField:
    """One field of the state slot: ``shape`` elements of ``dtype`` at byte ``offset``."""

    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * _dtype_of(self.dtype).itemsize


def _dtype_of(name: str) -> torch.dtype:
    return {**KV_DTYPES, "int64": torch.int64, "fp8": FP8_DTYPE}[name]


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def layout_fields(
    specs: list[tuple[str, tuple[int, ...], str]],
) -> tuple[tuple[StateField, ...], int]:
    """(fields, total bytes): each (name, shape, dtype) at the next ``FIELD_ALIGN`` offset, the
    total rounded up to ``STATE_ALIGN``."""
    fields, pos = [], 0
    for name, shape, dtype in specs:
        pos = _align(pos, FIELD_ALIGN)
        f = StateField(name, pos, shape, dtype)
        fields.append(f)
        pos += f.nbytes
    return tuple(fields), _align(pos, STATE_ALIGN)


def _dtype_name(value: str | torch.dtype, allowed: tuple[str, ...], arg: str) -> str:
    name = _DTYPE_NAMES.get(value, value) if isinstance(value, torch.dtype) else value
    if name not in allowed:
        raise GeometryError(f"{arg}={value!r} is not supported; use one of {list(allowed)}")
    return name


def check_geometry_args(
    kv_dtype: str | torch.dtype,
    index_dtype: str | torch.dtype,
    block_size: int,
    speculative_tokens: int,
) -> tuple[str, str]:
    """(kv dtype name, index dtype name); raises ``GeometryError`` for a value no layout takes."""
    kv = _dtype_name(kv_dtype, tuple(KV_DTYPES), "kv_dtype")
    idx = _dtype_name(index_dtype, INDEX_DTYPES, "index_dtype")
    if not isinstance(block_size, int) or block_size <= 0:
        raise GeometryError(f"block_size={block_size!r} must be a positive integer")
    if not isinstance(speculative_tokens, int) or speculative_tokens < 0:
        raise GeometryError(f"speculative_tokens={speculative_tokens!r} must be an integer >= 0")
    return kv, idx


def index_row_bytes(index_dtype: str, index_head_dim: int) -> int:
    """Bytes of one index-key row: fp8 keys carry an fp32 scale."""
    row = {"fp8": index_head_dim + 4, "bf16": index_head_dim * 2, "fp32": index_head_dim * 4}
    return row[index_dtype]


def check_index_rows(index_dtype: str, layer: int, rows: int, block_size: int) -> None:
    if index_dtype == "fp8" and rows % 16:
        raise GeometryError(
            f"an fp8 index needs rows per block % 16 == 0; layer {layer} has {rows} rows "
            f"with block_size={block_size}; use index_dtype='bf16' or a larger block"
        )


def window_rings(config: Any, speculative_tokens: int) -> tuple[int, int]:
    """(layers with a sliding-window ring, rows per ring): the draft layers (MTP-style layers,
    or DSpark stages: a config has one kind) hold one only when speculating, and each ring
    keeps ``speculative_tokens`` rows beyond the window."""
    drafters = config.num_nextn_predict_layers + getattr(config, "dspark_stages", 0)
    draft = drafters if speculative_tokens > 0 else 0
    return config.num_hidden_layers + draft, config.sliding_window + speculative_tokens


def layout_id(
    format: str,
    config: Any,
    *,
    block_size: int,
    kv_dtype: str,
    index_dtype: str,
    speculative_tokens: int,
    planes: list[PlaneSpec],
    fields: tuple[StateField, ...],
) -> str:
    """The hash of everything that places a byte: the format tag, the config (less
    ``initializer_range``, which only seeds random weights), the arguments, every plane and
    field. The tier's namespace derives from it, so what goes in here decides which stored
    images a model may load."""
    identity = {
        "format": format,
        "config": {k: v for k, v in config.to_dict().items() if k != "initializer_range"},
        "block_size": block_size,
        "kv_dtype": kv_dtype,
        "index_dtype": index_dtype,
        "speculative_tokens": speculative_tokens,
        "planes": [asdict(p) for p in planes],
        "fields": [asdict(f) for f in fields],
    }
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return xxhash.xxh3_128_hexdigest(canonical.encode())


class PoolGeometryBase:
    """What a family's frozen geometry dataclass answers from its fields ``block_size``,
    ``block_bytes``, ``state_bytes``, ``state_fields``, ``speculative_tokens``, ``layout_id``
    and its ``planes`` (the PAGE block's planes as the family counts them)."""

    block_size: int
    block_bytes: int
    state_bytes: int
    state_fields: tuple[StateField, ...]
    speculative_tokens: int
    layout_id: str

    @property
    def planes(self) -> tuple[PlaneSpec, ...]:
        raise NotImplementedError

    def _state_detail(self) -> dict:
        """What ``describe`` lists after ``state_bytes`` beyond it (nothing unless overridden)."""
        return {}

    @property
    def image_bytes(self) -> int:
        return self.state_bytes

    @property
    def units_per_image(self) -> int:
        return -(-self.state_bytes // self.block_bytes)

    def field(self, name: str) -> StateField:
        for f in self.state_fields:
            if f.name == name:
                return f
        raise KeyError(name)

    def state_spec(self) -> StateSpec:
        return StateSpec(
            block_size=self.block_size,
            block_bytes=self.block_bytes,
            state_bytes=self.state_bytes,
            layout_id=self.layout_id,
            header_offset=self.field("header").offset,
            speculative_tokens=self.speculative_tokens,
        )

    def describe(self) -> dict:
        return {
            "block_size": self.block_size,
            "block_bytes": self.block_bytes,
            "planes": [(p.name, p.rows, p.row_bytes) for p in self.planes],
            "state_bytes": self.state_bytes,
            **self._state_detail(),
            "units_per_image": self.units_per_image,
            "layout_id": self.layout_id,
        }
