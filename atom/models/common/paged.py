"""Views of the ONE PAGE pool a paged forward reads and writes, for both families: each
compressor owner's main rows and its index rows (payload, and fp32 scale for an fp8 index),
located by a sequence's block table. The geometry (``main_planes``, ``index_planes``,
``head_dim``, ``index_head_dim``) is the family's; the views are the same.
"""

from __future__ import annotations

from typing import Any

import torch

from atom.kernels.page_write import write_rows_where
from atom.models.common.geometry import FP8_DTYPE, KV_DTYPES


class StateMismatchError(RuntimeError):
    """A forward was asked to start where its state slot is not."""


def _as_words(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` [..., n] viewed as int64 words along its last dim, or None where it cannot be."""
    es = t.element_size()
    if es >= 8 or t.stride(-1) != 1 or (t.shape[-1] * es) % 8:
        return None
    if (t.storage_offset() * es) % 8 or any((st * es) % 8 for st in t.stride()[:-1]):
        return None
    try:
        return t.view(torch.int64)
    except RuntimeError:
        return None


class PagedKV:
    """The model's views of one PAGE pool tensor ``[num_blocks, ...]`` (blocks first).

    Build it from the registered pool tensor (views made before registration go stale).
    """

    def __init__(self, geometry: Any, pool: torch.Tensor):
        self.geometry, self.pool = geometry, pool
        # a block past the engine's (a runtime's reserved one) that batched writes of rows
        # completing nothing may land in; None: none (set by the runtime that reserved it)
        self.spare_block: int | None = None
        nb = pool.shape[0]
        self.num_blocks = nb
        self.bytes = pool.view(torch.uint8).view(nb, -1)
        if self.bytes.shape[1] != geometry.block_bytes:
            raise ValueError(
                f"pool block holds {self.bytes.shape[1]} B, geometry needs {geometry.block_bytes}"
            )
        kvdt = KV_DTYPES[geometry.kv_dtype]
        self.main: dict[int, torch.Tensor] = {}
        self.index: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for p in geometry.main_planes:
            raw = self.bytes[:, p.offset : p.offset + p.nbytes]
            self.main[p.owner_layer] = raw.view(kvdt).view(nb, p.rows, geometry.head_dim)
        d = geometry.index_head_dim
        for p in geometry.index_planes:
            raw = self.bytes[:, p.offset : p.offset + p.nbytes]
            if p.dtype == "fp8":
                rows = raw.view(nb, p.rows, d + 4)
                self.index[p.owner_layer] = (
                    rows[..., :d].view(FP8_DTYPE),
                    rows[..., d:].view(torch.float32),
                )
            else:
                self.index[p.owner_layer] = (
                    raw.view(KV_DTYPES[p.dtype]).view(nb, p.rows, d),
                    None,
                )

    def _locate(self, owner: int, table: torch.Tensor, rows: torch.Tensor):
        per_block = self.main[owner].shape[1]
        return table[torch.div(rows, per_block, rounding_mode="floor")], rows % per_block

    def write_rows(
        self,
        owner: int,
        table: torch.Tensor,
        rows: torch.Tensor,
        main: torch.Tensor,
        payload: torch.Tensor,
        scale: torch.Tensor | None,
    ) -> None:
        """Store compressed rows ``rows`` (int64 ids) of ``owner`` into their blocks."""
        blocks, offs = self._locate(owner, table, rows)
        self.main[owner][blocks, offs] = main.to(self.main[owner].dtype)
        pay_view, scale_view = self.index[owner]
        pay_view[blocks, offs] = payload
        if scale_view is not None:
            scale_view[blocks, offs] = scale

    def write_rows_of(
        self,
        owner: int,
        tables: torch.Tensor,
        seq: torch.Tensor,
        rows: torch.Tensor,
        main: torch.Tensor,
        payload: torch.Tensor,
        scale: torch.Tensor | None,
    ) -> None:
        """``write_rows`` for rows of several sequences: row ``rows[g]`` of sequence ``seq[g]``
        (its table is ``tables[seq[g]]``)."""
        per_block = self.main[owner].shape[1]
        blocks = tables[seq, torch.div(rows, per_block, rounding_mode="floor")]
        offs = rows % per_block
        self.main[owner][blocks, offs] = main.to(self.main[owner].dtype)
        pay_view, scale_view = self.index[owner]
        pay_view[blocks, offs] = payload
        if scale_view is not None:
            scale_view[blocks, offs] = scale

    def read_rows(self, owner: int, table: torch.Tensor, count: int):
        """Rows [0, count) of ``owner``: (main [count, hd] storage dtype, payload, scale)."""
        per_block = self.main[owner].shape[1]
        blocks = table[: -(-count // per_block)]
        main = self.main[owner][blocks].flatten(0, 1)[:count]
        pay_view, scale_view = self.index[owner]
        payload = pay_view[blocks].flatten(0, 1)[:count]
        scale = scale_view[blocks].flatten(0, 1)[:count] if scale_view is not None else None
        return main, payload, scale

    # ---- batched accessors (one row or one row set per sequence; tables [B, blocks] padded) --

    def _locate_each(self, owner: int, tables: torch.Tensor, ids: torch.Tensor):
        """Rows ``ids`` [B, K] of each sequence (its table row) -> (blocks, offsets) [B, K]."""
        per_block = self.main[owner].shape[1]
        return tables.gather(1, torch.div(ids, per_block, rounding_mode="floor")), ids % per_block

    def gather_rows(self, owner: int, tables: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Main rows ``ids`` [B, K] of each sequence's blocks -> [B, K, hd] storage dtype.
        Copied as 8-byte words where the rows allow (the same bytes; the element-wise index
        kernel's time goes by elements: 4x fewer for bf16 rows)."""
        plane = self.main[owner]
        where = self._locate_each(owner, tables, ids)
        words = _as_words(plane)
        if words is None:
            return plane[where]
        return words[where].view(plane.dtype)

    def row_offsets(self, owner: int, tables: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Element offsets [B, K], from the first element of ``main[owner]``, of main rows
        ``ids`` [B, K] of each sequence's blocks (where ``sink_attention`` reads them)."""
        plane = self.main[owner]
        blocks, offs = self._locate_each(owner, tables, ids)
        return blocks * plane.stride(0) + offs * plane.stride(1)

    def read_index_rows(self, owner: int, tables: torch.Tensor, count: int):
        """Index rows [0, count) of every sequence: (payload [B, count, D], scale or None).
        Rows past a sequence's own count hold whatever its (or padding) blocks hold."""
        per_block = self.main[owner].shape[1]
        blocks = tables[:, : -(-count // per_block)]
        pay_view, scale_view = self.index[owner]
        payload = pay_view[blocks].flatten(1, 2)[:, :count]
        scale = scale_view[blocks].flatten(1, 2)[:, :count] if scale_view is not None else None
        return payload, scale

    def write_rows_or_dump(
        self,
        owner: int,
        tables: torch.Tensor,
        rows: torch.Tensor,
        where: torch.Tensor,
        dump_block: int,
        main: torch.Tensor,
        payload: torch.Tensor,
        scale: torch.Tensor | None,
    ) -> None:
        """Row ``rows[b]`` of sequence b gets (main, payload, scale)[b] where ``where[b]``; the
        other entries are written into ``dump_block`` (a block no sequence reads), so rows of
        one sequence that share a location write it once (no host sync to pick the writers)."""
        blocks, offs = (t[:, 0] for t in self._locate_each(owner, tables, rows[:, None]))
        blocks = torch.where(where, blocks, torch.full_like(blocks, dump_block))
        self.main[owner][blocks, offs] = main.to(self.main[owner].dtype)
        pay_view, scale_view = self.index[owner]
        pay_view[blocks, offs] = payload
        if scale_view is not None:
            scale_view[blocks, offs] = scale

    def write_rows_where(
        self,
        owner: int,
        tables: torch.Tensor,
        rows: torch.Tensor,
        where: torch.Tensor,
        main: torch.Tensor,
        payload: torch.Tensor,
        scale: torch.Tensor | None,
    ) -> None:
        """Row ``rows[b]`` of sequence b gets (main, payload, scale)[b] where ``where[b]``; the
        other sequences' rows keep their bytes (no host sync to pick the writers; one kernel
        where ``atom.kernels.page_write`` runs)."""
        pay_view, scale_view = self.index[owner]
        planes = [self.main[owner], pay_view]
        new = [main.to(self.main[owner].dtype), payload]
        if scale_view is not None:
            planes.append(scale_view)
            new.append(scale)
        write_rows_where(planes, new, tables, rows, where, self.main[owner].shape[1])
