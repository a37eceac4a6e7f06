"""What V4's paged forward reads and writes: state slots, live scratch, views of the PAGE pool.

Interval facts (per sequence, after a forward of [start, end)):
  PAGE rows of a compressed layer with ratio r valid for groups [0, end // r);
      a CSA layer's index plane likewise
  window ring of each layer holds positions [end - window_rows, end), row = pos % window_rows
  CSA overlap fields (slot) hold the first halves of group end // 4 - 1 (if it exists)
  scratch partial rows hold raw projections of positions [end // r * r, end), row = pos % r:
      empty at every multiple of r, which is every block boundary, where images are taken
  cursor = [end]
A draft forward of MTP layer i over [start, end) writes window rows num_hidden_layers + i
(the same ring rule) and draft_cursor[i] = end, nothing else.
"""

from __future__ import annotations

import torch

from atom.models.common.geometry import FP8_DTYPE, KV_DTYPES
from atom.models.common.paged import PagedKV, StateMismatchError
from atom.models.deepseek_v4.geometry import V4PoolGeometry

__all__ = ["V4PagedKV", "V4StateSlots", "StateMismatchError"]


def _views(fields, data: torch.Tensor) -> dict[str, torch.Tensor]:
    n = data.shape[0]
    out = {}
    for f in fields:
        dtype = {**KV_DTYPES, "int64": torch.int64}[f.dtype]
        out[f.name] = data[:, f.offset : f.offset + f.nbytes].view(dtype).view(n, *f.shape)
    return out


class V4StateSlots:
    """Typed views of the state-slot bytes ``[num_slots, state_bytes]`` (uint8, the images)
    and of this runtime's own live scratch ``[num_slots, scratch_bytes]``."""

    def __init__(self, geometry: V4PoolGeometry, data: torch.Tensor):
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != geometry.state_bytes:
            raise ValueError(
                f"state slots must be uint8 [num_slots, {geometry.state_bytes}], "
                f"got {data.dtype} {list(data.shape)}"
            )
        self.geometry, self.data = geometry, data
        self.num_slots = data.shape[0]
        self.tag = geometry.state_spec().layout_tag
        self.scratch = torch.zeros(
            self.num_slots, geometry.scratch_bytes, dtype=torch.uint8, device=data.device
        )
        self.fields = _views(geometry.state_fields, data)
        self.live = _views(geometry.scratch_fields, self.scratch)
        self.window = self.fields["window"]
        self.cursor = self.fields["cursor"]
        self.header = self.fields["header"]
        self.draft_cursor = self.fields.get("draft_cursor")  # [slots, draft layers] or None
        self.csa_index = {layer: i for i, layer in enumerate(geometry.csa_layers)}
        self.hca_index = {layer: i for i, layer in enumerate(geometry.hca_layers)}
        # the host's mirror of each slot's (cursor, layout tag), so that checking a forward's
        # spans reads no device memory: kept by ``reset`` / ``advance``; ``refresh`` re-reads
        # a slot whose bytes were replaced (an image restore)
        self.host_position: list[int] = self.cursor[:, 0].tolist()
        self.host_tag: list[int] = self.header[:, 0].tolist()

    @classmethod
    def allocate(cls, geometry: V4PoolGeometry, num_slots: int, device) -> V4StateSlots:
        data = torch.zeros(num_slots, geometry.state_bytes, dtype=torch.uint8, device=device)
        return cls(geometry, data)

    def compressor_state(self, slot: int, layer: int, ratio: int, index: bool):
        """(overlap (kv, score) [r, d] views or None, partial (kv, score) [r, width] views)."""
        if ratio == 4:
            i, pre = self.csa_index[layer], "index" if index else "csa"
            overlap = (self.fields[f"{pre}_overlap_kv"][slot, i],)
            overlap += (self.fields[f"{pre}_overlap_score"][slot, i],)
            partial = (self.live[f"{pre}_partial_kv"][slot, i],)
            partial += (self.live[f"{pre}_partial_score"][slot, i],)
            return overlap, partial
        i = self.hca_index[layer]
        kv = self.live["hca_partial_kv"][slot, i, :ratio]
        return None, (kv, self.live["hca_partial_score"][slot, i, :ratio])

    def compressor_fields(self, layer: int, ratio: int, index: bool = False):
        """``compressor_state`` of every slot at once: (overlap (kv, score) [slots, r, d] or
        None, partial (kv, score) [slots, r, width])."""
        if ratio == 4:
            i, pre = self.csa_index[layer], "index" if index else "csa"
            overlap = (self.fields[f"{pre}_overlap_kv"][:, i],)
            overlap += (self.fields[f"{pre}_overlap_score"][:, i],)
            partial = (self.live[f"{pre}_partial_kv"][:, i],)
            partial += (self.live[f"{pre}_partial_score"][:, i],)
            return overlap, partial
        i = self.hca_index[layer]
        kv = self.live["hca_partial_kv"][:, i, :ratio]
        return None, (kv, self.live["hca_partial_score"][:, i, :ratio])

    def reset(self, slot: int) -> None:
        """Empty state for a sequence starting at position 0."""
        self.data[slot].zero_()
        self.header[slot, 0] = self.tag
        self.host_position[slot], self.host_tag[slot] = 0, self.tag

    def reset_many(self, slots: list[int], index: torch.Tensor) -> None:
        """``reset`` of several slots, ``index``: the same slots as a device int64 tensor (no
        host-to-device copy per slot)."""
        if not slots:
            return
        self.data.index_fill_(0, index, 0)
        self.header[:, 0].index_fill_(0, index, self.tag)
        for s in slots:
            self.host_position[s], self.host_tag[s] = 0, self.tag

    def advance(self, slot: int, position: int) -> None:
        """Record in the mirror that a forward left ``slot`` at ``position``."""
        self.host_position[slot], self.host_tag[slot] = position, self.tag

    def refresh(self, slot: int) -> None:
        """Re-read ``slot``'s mirror from its bytes (one device read)."""
        at, tag = torch.stack([self.cursor[slot, 0], self.header[slot, 0]]).tolist()
        self.host_position[slot], self.host_tag[slot] = at, tag

    def position(self, slot: int) -> int:
        return int(self.cursor[slot, 0])


class V4PagedKV(PagedKV):
    """V4.1's PAGE views (main rows per compressed layer, index planes per CSA layer), plus
    access to layers that have main rows but no index plane (HCA)."""

    def write_main(self, layer: int, table: torch.Tensor, rows: torch.Tensor, main: torch.Tensor):
        blocks, offs = self._locate(layer, table, rows)
        self.main[layer][blocks, offs] = main.to(self.main[layer].dtype)

    def write_main_of(
        self, layer: int, tables: torch.Tensor, seq: torch.Tensor, rows: torch.Tensor, main
    ) -> None:
        """Row ``rows[g]`` of sequence ``seq[g]`` (its table is ``tables[seq[g]]``) gets
        ``main[g]``."""
        per_block = self.main[layer].shape[1]
        blocks = tables[seq, torch.div(rows, per_block, rounding_mode="floor")]
        self.main[layer][blocks, rows % per_block] = main.to(self.main[layer].dtype)

    def write_main_where(
        self,
        layer: int,
        tables: torch.Tensor,
        rows: torch.Tensor,
        where: torch.Tensor,
        main: torch.Tensor,
    ) -> None:
        """Row ``rows[b]`` of sequence b gets ``main[b]`` where ``where[b]``; the other
        sequences' rows keep their bytes (no host sync to pick the writers)."""
        blocks, offs = (t[:, 0] for t in self._locate_each(layer, tables, rows[:, None]))
        view, new = self.main[layer], main.to(self.main[layer].dtype)
        if view.dtype == FP8_DTYPE:  # torch.where has no fp8 kernels: select the bytes
            view, new = view.view(torch.uint8), new.view(torch.uint8)
        view[blocks, offs] = torch.where(where[:, None], new, view[blocks, offs])

    def read_main(self, layer: int, table: torch.Tensor, count: int) -> torch.Tensor:
        per_block = self.main[layer].shape[1]
        return self.main[layer][table[: -(-count // per_block)]].flatten(0, 1)[:count]
