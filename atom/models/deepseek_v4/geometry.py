"""The one source of DeepSeek-V4's byte geometry: PAGE planes, the state image, the live state.

A PAGE block of ``block_size`` tokens holds, per compressed layer, its compressed KV rows
(``block_size / ratio`` rows: 64 per 256-token block on a CSA layer, 2 on a ratio-128 HCA
layer), and per CSA layer one index plane with its indexer keys (``block_size / 4`` rows).

A request's state besides PAGE splits in two by what a boundary needs (every image is taken at
a block boundary, a multiple of every ratio):

* the **state slot** (= the checkpoint image, ``state_bytes``): every layer's sliding-window
  ring (with ``speculative_tokens`` >= 1 also each MTP draft layer's, and their cursors); per
  CSA layer the overlap rows of its compressor and of its indexer's compressor (the
  first half of the last complete group's per-token projections and gate scores, which the next
  group's overlapping softmax reads and no PAGE row holds); the cursor and the header.
* the **live scratch** (``scratch_bytes`` per slot, never stored or loaded): the raw
  projections of the current, incomplete group of every compressor. At a multiple of the ratio
  that group is empty, so an image never needs it; a ratio-128 layer's whole state is this
  (a test restores an image into a slot whose scratch holds garbage and gets identical logits).

With ``speculative_tokens`` k >= 1 a forward may start up to k positions behind the cursor
(re-running positions whose drafts were rejected), so nothing those positions wrote may be
needed again: every ring keeps k rows more. The window rings hold window + k rows; a ratio-r
compressor's partial rows are a ring of r + k rows (row = position % (r + k)); and a CSA
layer's overlap fields keep ``overlap_entries`` = 1 + ceil((k + 1) / 4) groups (entry = group
% entries), so the predecessor of the group a rewound forward resumes in survives the groups
the rejected positions completed. With k = 0 the layout is the one without speculation.

Real DeepSeek-V4-Flash, bf16 KV + fp8 index, block 256: 1,594,624 B/block (6,229 B/token);
state image 6,067,200 B (5.79 MiB); live scratch 11,345,920 B per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atom.models.common.geometry import (
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
from atom.models.deepseek_v4.config import CSA_RATIO, V4Config, V4LayerKind


@dataclass(frozen=True)
class V4PoolGeometry(PoolGeometryBase):
    block_size: int
    kv_dtype: str
    index_dtype: str
    speculative_tokens: int
    head_dim: int
    index_head_dim: int
    main_planes: tuple[PlaneSpec, ...]  # one per compressed layer (CSA and HCA)
    index_planes: tuple[PlaneSpec, ...]  # one per CSA layer
    block_bytes: int
    window_rows: int  # ring rows per layer: sliding_window + speculative_tokens
    overlap_entries: int  # groups each CSA overlap field keeps (entry = group % entries)
    state_layers: int
    csa_layers: tuple[int, ...]
    hca_layers: tuple[int, ...]
    state_fields: tuple[StateField, ...]  # the image
    state_bytes: int
    scratch_fields: tuple[StateField, ...]  # live only
    scratch_bytes: int
    layout_id: str

    @property
    def planes(self) -> tuple[PlaneSpec, ...]:
        """Every plane of a block, in block order: one per compressed layer, one per CSA index."""
        return self.main_planes + self.index_planes

    def partial_rows(self, ratio: int) -> int:
        """Rows of a ratio-``ratio`` compressor's partial ring (row = position % rows)."""
        return ratio + self.speculative_tokens

    def main_plane(self, layer: int) -> PlaneSpec:
        return next(p for p in self.main_planes if p.owner_layer == layer)

    def index_plane(self, layer: int) -> PlaneSpec:
        return next(p for p in self.index_planes if p.owner_layer == layer)

    def _state_detail(self) -> dict:
        return {
            "state_fields": {f.name: f.nbytes for f in self.state_fields},
            "scratch_bytes": self.scratch_bytes,
        }


def build_v4_pool_geometry(
    config: V4Config,
    *,
    kv_dtype: str | torch.dtype,
    index_dtype: str | torch.dtype,
    block_size: int,
    speculative_tokens: int,
) -> V4PoolGeometry:
    """PAGE planes, the image layout and the live scratch. Every argument that moves a byte is
    required."""
    kv, idx = check_geometry_args(kv_dtype, index_dtype, block_size, speculative_tokens)
    hd, ihd = config.head_dim, config.index_head_dim
    main_row = hd * KV_DTYPES[kv].itemsize
    index_row = index_row_bytes(idx, ihd)
    compressed = config.compressed_layers
    csa = config.layers_of(V4LayerKind.CSA)
    hca = config.layers_of(V4LayerKind.HCA)
    mains, indexes, offset = [], [], 0
    for layer in compressed:
        ratio = config.compress_ratios[layer]
        if block_size % ratio:
            raise GeometryError(
                f"block_size={block_size} is not a multiple of compress ratio {ratio} "
                f"(layer {layer}); images are taken at block boundaries, where every "
                f"compressor's current group must be empty: use a multiple of {ratio}"
            )
        rows = block_size // ratio
        mains.append(PlaneSpec(f"kv.{layer}", layer, rows, main_row, offset, kv))
        offset += rows * main_row
    for layer in csa:
        rows = block_size // CSA_RATIO
        check_index_rows(idx, layer, rows, block_size)
        indexes.append(PlaneSpec(f"index.{layer}", layer, rows, index_row, offset, idx))
        offset += rows * index_row
    block_bytes = offset
    if block_bytes == 0:
        raise GeometryError("the config has no compressed layer, so a PAGE block holds no bytes")
    if block_bytes % block_size:
        raise GeometryError(
            f"a block of {block_bytes} B does not split into {block_size} equal token rows; "
            "choose a block size that divides it"
        )

    state_layers, window_rows = window_rings(config, speculative_tokens)
    r, nc, k = CSA_RATIO, len(csa), speculative_tokens
    n_draft = state_layers - config.num_hidden_layers
    entries = 1 + -(-(k + 1) // r) if k else 1
    ov = (nc, r) if k == 0 else (nc, entries, r)  # (the layout without speculation unchanged)
    fields, state_bytes = layout_fields(
        [
            ("window", (state_layers, window_rows, hd), kv),
            ("csa_overlap_kv", (*ov, hd), "fp32"),
            ("csa_overlap_score", (*ov, hd), "fp32"),
            ("index_overlap_kv", (*ov, ihd), "fp32"),
            ("index_overlap_score", (*ov, ihd), "fp32"),
            ("cursor", (1,), "int64"),  # committed position
            ("header", (2,), "int64"),  # layout tag, position (the boundary an image is of)
        ]
        # each MTP draft layer's position (its window ring is window rows num_hidden_layers + i)
        + ([("draft_cursor", (n_draft,), "int64")] if n_draft else [])
    )
    hca_rows = max([config.compress_ratios[i] for i in hca] or [1])
    scratch, scratch_bytes = layout_fields(
        [
            ("csa_partial_kv", (nc, r + k, 2 * hd), "fp32"),
            ("csa_partial_score", (nc, r + k, 2 * hd), "fp32"),
            ("index_partial_kv", (nc, r + k, 2 * ihd), "fp32"),
            ("index_partial_score", (nc, r + k, 2 * ihd), "fp32"),
            ("hca_partial_kv", (len(hca), hca_rows + k, hd), "fp32"),
            ("hca_partial_score", (len(hca), hca_rows + k, hd), "fp32"),
        ]
    )

    return V4PoolGeometry(
        block_size=block_size,
        kv_dtype=kv,
        index_dtype=idx,
        speculative_tokens=speculative_tokens,
        head_dim=hd,
        index_head_dim=ihd,
        main_planes=tuple(mains),
        index_planes=tuple(indexes),
        block_bytes=block_bytes,
        window_rows=window_rows,
        overlap_entries=entries,
        state_layers=state_layers,
        csa_layers=csa,
        hca_layers=hca,
        state_fields=fields,
        state_bytes=state_bytes,
        scratch_fields=scratch,
        scratch_bytes=scratch_bytes,
        layout_id=layout_id(
            "atom.v4.pool/1",
            config,
            block_size=block_size,
            kv_dtype=kv,
            index_dtype=idx,
            speculative_tokens=speculative_tokens,
            planes=mains + indexes,
            fields=fields,
        ),
    )
