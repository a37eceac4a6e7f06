"""Rows of a decode batch written into the PAGE pool where they complete a group: one kernel
for what the torch expression does in about twelve.

A decode step writes, for each compressor owner, one compressed row per sequence into its
block of the pool: the main row, the index payload and (fp8 index) its scale, each into its
own plane. Only the sequences whose group completes at this token write; the others keep the
bytes they have, and no host sync may pick them. The torch expression (``write_rows_where_torch``)
locates the rows (a gather and two index ops), then for each plane reads the old bytes, selects,
and scatters back: twelve kernels per owner and step. The kernel moves the same bytes in one
launch: one program per row, the location computed in the program, the store masked by the
row's flag. Bytes, not values: every plane and row is moved as uint8, so the result is the
torch expression's byte for byte whatever the dtypes (tests/kernels/test_page_write.py).
"""

from __future__ import annotations

import torch

from atom.kernels import use_triton


def write_rows_where_torch(
    planes: list[torch.Tensor],
    rows: list[torch.Tensor],
    tables: torch.Tensor,
    ids: torch.Tensor,
    where: torch.Tensor,
    per_block: int,
) -> None:
    """For each batch row b with ``where[b]``: row ``ids[b]`` of sequence b (its block
    ``tables[b, ids[b] // per_block]``, offset ``ids[b] % per_block``) of every plane
    ``planes[t]`` [blocks, per_block, ...] gets ``rows[t][b]``; the other rows keep their
    bytes. ``rows[t]`` [B, ...] has the plane's dtype and row shape."""
    blocks = tables.gather(1, torch.div(ids, per_block, rounding_mode="floor")[:, None])[:, 0]
    offs = ids % per_block
    for view, new in zip(planes, rows):
        if view.element_size() == 1:  # torch.where has no fp8 kernels: select the bytes
            view, new = view.view(torch.uint8), new.view(torch.uint8)
        keep = where.view(-1, *([1] * (new.dim() - 1)))
        view[blocks, offs] = torch.where(keep, new, view[blocks, offs])


def _bytes(t: torch.Tensor, lead: int) -> torch.Tensor | None:
    """``t`` viewed as uint8 [*t.shape[:lead], row bytes] (its rows' bytes contiguous), or None."""
    try:
        return t.view(torch.uint8).view(*t.shape[:lead], -1)
    except RuntimeError:
        return None


def write_rows_where(
    planes: list[torch.Tensor],
    rows: list[torch.Tensor],
    tables: torch.Tensor,
    ids: torch.Tensor,
    where: torch.Tensor,
    per_block: int,
) -> None:
    """``write_rows_where_torch`` as one Triton kernel where it can run (kernel ``page_write``;
    up to three planes; every plane's and row's bytes viewable as uint8 rows): the same
    bytes."""
    usable = 0 < len(planes) <= 3 and use_triton(planes[0], "page_write", row_local=True)
    dst = [_bytes(p, 2) for p in planes] if usable else []
    src = [_bytes(r.reshape(r.shape[0], -1), 1) for r in rows] if usable else []
    if not usable or any(t is None for t in dst + src) or ids.shape[0] == 0:
        return write_rows_where_torch(planes, rows, tables, ids, where, per_block)
    if any(d.shape[2] != s.shape[1] or s.shape[0] != ids.shape[0] for d, s in zip(dst, src)):
        raise ValueError(
            f"page rows of {[d.shape[2] for d in dst]} B each, got {[s.shape[1] for s in src]}"
        )
    from atom.kernels._page_write_triton import write_rows_where_triton

    write_rows_where_triton(dst, src, tables, ids, where, per_block)
