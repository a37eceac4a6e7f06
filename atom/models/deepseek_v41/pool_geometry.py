"""The one source of V4.1's byte geometry: PAGE planes, the state slot layout, images.

A PAGE block of ``block_size`` tokens holds, for every compressor owner (kv source) layer, its
compressed-latent rows (``block_size / ratio`` rows, in the *main* plane), and one *index*
plane per owner with its index-key rows. A state slot holds every layer's sliding-window ring,
the owners' compressor rings, the cursor (committed position + the last 3 Engram token ids) and
a header carrying the layout id. An image of a slot fills ``units_per_image`` whole blocks.

Real V4.1-Flash, bf16 KV + fp8 index, block 256: 739,840 B/block; bf16 index: 819,200 B/block;
state 5,276,672 B without drafts, 5,971,968 B with 5 speculative tokens.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch
import xxhash

from atom.model_api import StateSpec
from atom.models.deepseek_v41.config import V41Config

KV_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
INDEX_DTYPES = ("fp8", "bf16", "fp32")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
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


@dataclass(frozen=True)
class V41PoolGeometry:
    block_size: int
    kv_dtype: str
    index_dtype: str
    speculative_tokens: int
    head_dim: int
    index_head_dim: int
    main_planes: tuple[PlaneSpec, ...]  # one region per owner, all inside the main plane
    index_planes: tuple[PlaneSpec, ...]  # one plane per owner
    block_bytes: int
    window_rows: int  # ring rows per layer: sliding_window + speculative_tokens
    compressor_rows: int  # ring rows per owner: max ratio + speculative_tokens
    state_layers: int
    state_fields: tuple[StateField, ...]
    state_bytes: int
    layout_id: str

    @property
    def planes(self) -> tuple[PlaneSpec, ...]:
        """The block's planes as the design counts them: main, then one index plane per owner."""
        main_rows = sum(p.rows for p in self.main_planes)
        row = self.main_planes[0].row_bytes
        main = PlaneSpec("main", -1, main_rows, row, 0, self.kv_dtype)
        return (main, *self.index_planes)

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

    def index_plane(self, owner_layer: int) -> PlaneSpec:
        return next(p for p in self.index_planes if p.owner_layer == owner_layer)

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
            "units_per_image": self.units_per_image,
            "layout_id": self.layout_id,
        }


def _dtype_name(value: str | torch.dtype, allowed: tuple[str, ...], arg: str) -> str:
    name = _DTYPE_NAMES.get(value, value) if isinstance(value, torch.dtype) else value
    if name not in allowed:
        raise GeometryError(f"{arg}={value!r} is not supported; use one of {list(allowed)}")
    return name


def build_v41_pool_geometry(
    config: V41Config,
    *,
    kv_dtype: str | torch.dtype,
    index_dtype: str | torch.dtype,
    block_size: int,
    speculative_tokens: int,
) -> V41PoolGeometry:
    """Compute the PAGE planes and state layout. Every argument that moves a byte is required."""
    kv = _dtype_name(kv_dtype, tuple(KV_DTYPES), "kv_dtype")
    idx = _dtype_name(index_dtype, INDEX_DTYPES, "index_dtype")
    if not isinstance(block_size, int) or block_size <= 0:
        raise GeometryError(f"block_size={block_size!r} must be a positive integer")
    if not isinstance(speculative_tokens, int) or speculative_tokens < 0:
        raise GeometryError(f"speculative_tokens={speculative_tokens!r} must be an integer >= 0")
    kv_size = KV_DTYPES[kv].itemsize
    main_row = config.head_dim * kv_size
    index_row = {
        "fp8": config.index_head_dim + 4,  # fp8 key + fp32 scale
        "bf16": config.index_head_dim * 2,
        "fp32": config.index_head_dim * 4,
    }[idx]

    owners = config.compressor_owners
    mains, offset = [], 0
    for layer in owners:
        ratio = config.compress_ratios[layer]
        if block_size % ratio:
            raise GeometryError(
                f"block_size={block_size} is not a multiple of compress ratio {ratio} "
                f"(layer {layer}); use a multiple of {ratio}"
            )
        rows = block_size // ratio
        mains.append(PlaneSpec(f"kv.{layer}", layer, rows, main_row, offset, kv))
        offset += rows * main_row
    indexes = []
    for layer in owners:
        rows = block_size // config.compress_ratios[layer]
        if idx == "fp8" and rows % 16:
            raise GeometryError(
                f"an fp8 index needs rows per block % 16 == 0; layer {layer} has {rows} rows "
                f"with block_size={block_size}; use index_dtype='bf16' or a larger block"
            )
        indexes.append(PlaneSpec(f"index.{layer}", layer, rows, index_row, offset, idx))
        offset += rows * index_row
    block_bytes = offset
    if block_bytes == 0:
        raise GeometryError("the config has no compressor owner, so a PAGE block holds no bytes")

    state_layers = config.num_hidden_layers + (
        config.num_nextn_predict_layers if speculative_tokens > 0 else 0
    )
    window_rows = config.sliding_window + speculative_tokens
    comp_rows = config.max_ratio + speculative_tokens
    specs = [
        ("window", (state_layers, window_rows, config.head_dim), kv),
        ("compressor_values", (len(owners), comp_rows, config.head_dim), "fp32"),
        ("compressor_scores", (len(owners), comp_rows, config.head_dim), "fp32"),
        ("cursor", (4,), "int64"),  # committed position, last 3 Engram token ids (-1 none)
        ("header", (2,), "int64"),  # layout tag, position (the boundary an image is of)
    ]
    fields, pos = [], 0
    for name, shape, dtype in specs:
        pos = _align(pos, FIELD_ALIGN)
        f = StateField(name, pos, shape, dtype)
        fields.append(f)
        pos += f.nbytes
    state_bytes = _align(pos, STATE_ALIGN)

    identity = {
        "format": "atom.v41.pool/1",
        "config": {k: v for k, v in config.to_dict().items() if k != "initializer_range"},
        "block_size": block_size,
        "kv_dtype": kv,
        "index_dtype": idx,
        "speculative_tokens": speculative_tokens,
        "planes": [asdict(p) for p in mains + indexes],
        "fields": [asdict(f) for f in fields],
    }
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), allow_nan=False)
    layout_id = xxhash.xxh3_128_hexdigest(canonical.encode())
    return V41PoolGeometry(
        block_size=block_size,
        kv_dtype=kv,
        index_dtype=idx,
        speculative_tokens=speculative_tokens,
        head_dim=config.head_dim,
        index_head_dim=config.index_head_dim,
        main_planes=tuple(mains),
        index_planes=tuple(indexes),
        block_bytes=block_bytes,
        window_rows=window_rows,
        compressor_rows=comp_rows,
        state_layers=state_layers,
        state_fields=tuple(fields),
        state_bytes=state_bytes,
        layout_id=layout_id,
    )
