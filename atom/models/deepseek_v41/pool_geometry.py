"""The one source of V4.1's byte geometry: PAGE planes, the state slot layout, images.

A PAGE block of ``block_size`` tokens holds, for every compressor owner (kv source) layer, its
compressed-latent rows (``block_size / ratio`` rows, in the *main* plane), and one *index*
plane per owner with its index-key rows. A state slot holds every layer's sliding-window ring,
the owners' compressor rings, the cursor (committed position + the last 3 Engram token ids) and
a header carrying the layout id; with ``speculative_tokens`` >= 1 also each draft layer's (or
DSpark stage's: its window of target KV) window ring (rows ``num_hidden_layers + i``) and its
cursor (``draft_cursor``), and the target's rewind
history (``history``: the frontier and the last 3 + k Engram ids before it). An image of a slot
fills ``units_per_image`` whole blocks.

Real V4.1-Flash, bf16 KV + fp8 index, block 256: 739,840 B/block; bf16 index: 819,200 B/block;
state 5,276,672 B without drafts, 5,971,968 B with 5 speculative tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atom.models.common.geometry import (  # noqa: F401  (FP8_DTYPE, INDEX_DTYPES: re-exported)
    FP8_DTYPE,
    FP8_MAX,
    INDEX_DTYPES,
    KV_DTYPES,
    GeometryError,
    PlaneSpec,
    PoolGeometryBase,
    StateField,
    check_geometry_args,
    check_index_rows,
    index_row_bytes,
    layout_fields,
    layout_id,
    window_rings,
)
from atom.models.deepseek_v41.config import V41Config


@dataclass(frozen=True)
class V41PoolGeometry(PoolGeometryBase):
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

    def index_plane(self, owner_layer: int) -> PlaneSpec:
        return next(p for p in self.index_planes if p.owner_layer == owner_layer)


def build_v41_pool_geometry(
    config: V41Config,
    *,
    kv_dtype: str | torch.dtype,
    index_dtype: str | torch.dtype,
    block_size: int,
    speculative_tokens: int,
) -> V41PoolGeometry:
    """Compute the PAGE planes and state layout. Every argument that moves a byte is required."""
    kv, idx = check_geometry_args(kv_dtype, index_dtype, block_size, speculative_tokens)
    main_row = config.head_dim * KV_DTYPES[kv].itemsize
    index_row = index_row_bytes(idx, config.index_head_dim)

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
        check_index_rows(idx, layer, rows, block_size)
        indexes.append(PlaneSpec(f"index.{layer}", layer, rows, index_row, offset, idx))
        offset += rows * index_row
    block_bytes = offset
    if block_bytes == 0:
        raise GeometryError("the config has no compressor owner, so a PAGE block holds no bytes")

    state_layers, window_rows = window_rings(config, speculative_tokens)
    comp_rows = config.max_ratio + speculative_tokens
    n_draft = state_layers - config.num_hidden_layers
    fields, state_bytes = layout_fields(
        [
            ("window", (state_layers, window_rows, config.head_dim), kv),
            ("compressor_values", (len(owners), comp_rows, config.head_dim), "fp32"),
            ("compressor_scores", (len(owners), comp_rows, config.head_dim), "fp32"),
            ("cursor", (4,), "int64"),  # committed position, last 3 Engram token ids (-1 none)
            ("header", (2,), "int64"),  # layout tag, position (the boundary an image is of)
        ]
        # each draft layer's position (its window ring is window rows num_hidden_layers + i)
        + ([("draft_cursor", (n_draft,), "int64")] if n_draft else [])
        # target rewind (speculative_tokens k >= 1): [frontier f, the Engram ids at positions
        # f - 3 - k .. f - 1] (``paged.StateSlots``: a span at s needs s >= f - k)
        + ([("history", (4 + speculative_tokens,), "int64")] if speculative_tokens else [])
    )
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
        state_fields=fields,
        state_bytes=state_bytes,
        layout_id=layout_id(
            "atom.v41.pool/1",
            config,
            block_size=block_size,
            kv_dtype=kv,
            index_dtype=idx,
            speculative_tokens=speculative_tokens,
            planes=mains + indexes,
            fields=fields,
        ),
    )
