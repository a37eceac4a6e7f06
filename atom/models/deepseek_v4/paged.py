"""What V4's paged forward reads and writes: state slots, live scratch, views of the PAGE pool.

Interval facts (per sequence, after a forward of [start, end)):
  PAGE rows of a compressed layer with ratio r valid for groups [0, end // r);
      a CSA layer's index plane likewise
  window ring of each layer holds positions [end - window_rows, end), row = pos % window_rows
  CSA overlap fields (slot) hold the first halves of group end // 4 - 1 (if it exists), in
      entry (end // 4 - 1) % entries (and the groups before it in the other entries)
  scratch partial rows hold raw projections of positions [end // r * r, end), row = pos %
      (r + k): empty at every multiple of r, which is every block boundary, where images are
      taken (with speculative_tokens k, a forward may start at most k positions before end:
      the rings keep what it needs, see the geometry's module doc)
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
        # the furthest position each slot's state was written to (past the cursor after
        # rejected drafts): a forward may start at most ``speculative_tokens`` before it
        self.host_frontier: list[int] = list(self.host_position)
        # the draft layers' cursors, mirrored as the target's is (``advance_draft``)
        n_draft = 0 if self.draft_cursor is None else self.draft_cursor.shape[1]
        self.host_draft: list[list[int]] = (
            self.draft_cursor.tolist() if n_draft else [[] for _ in range(self.num_slots)]
        )

    @classmethod
    def allocate(cls, geometry: V4PoolGeometry, num_slots: int, device) -> V4StateSlots:
        data = torch.zeros(num_slots, geometry.state_bytes, dtype=torch.uint8, device=device)
        return cls(geometry, data)

    def compressor_fields(self, layer: int, ratio: int, index: bool = False):
        """One compressor's state in every slot: (overlap (kv, score) [slots, entries, r, d] or
        None at ratio != 4, partial rings (kv, score) [slots, r + k, width]; see the geometry's
        module doc)."""
        rows = self.geometry.partial_rows(ratio)
        if ratio == 4:
            i, pre = self.csa_index[layer], "index" if index else "csa"
            overlap = tuple(self.fields[f"{pre}_overlap_{n}"][:, i] for n in ("kv", "score"))
            if self.geometry.speculative_tokens == 0:  # one entry, stored without its axis
                overlap = tuple(o[:, None] for o in overlap)
            partial = tuple(self.live[f"{pre}_partial_{n}"][:, i] for n in ("kv", "score"))
            return overlap, partial
        i = self.hca_index[layer]
        partial = tuple(self.live[f"hca_partial_{n}"][:, i, :rows] for n in ("kv", "score"))
        return None, partial

    def reset(self, slot: int) -> None:
        """Empty state for a sequence starting at position 0."""
        self.data[slot].zero_()
        self.header[slot, 0] = self.tag
        self.host_position[slot], self.host_tag[slot] = 0, self.tag
        self.host_frontier[slot] = 0
        self.host_draft[slot] = [0] * len(self.host_draft[slot])

    def reset_many(self, slots: list[int], index: torch.Tensor) -> None:
        """``reset`` of several slots, ``index``: the same slots as a device int64 tensor (no
        host-to-device copy per slot)."""
        if not slots:
            return
        self.data.index_fill_(0, index, 0)
        self.header[:, 0].index_fill_(0, index, self.tag)
        for s in slots:
            self.host_position[s], self.host_tag[s] = 0, self.tag
            self.host_frontier[s] = 0
            self.host_draft[s] = [0] * len(self.host_draft[s])

    def advance(self, slot: int, position: int) -> None:
        """Record in the mirror that a forward left ``slot`` at ``position``."""
        self.host_position[slot], self.host_tag[slot] = position, self.tag
        self.host_frontier[slot] = max(self.host_frontier[slot], position)

    def advance_draft(self, slot: int, layer: int, position: int) -> None:
        """Record in the mirror that a draft forward of ``layer`` left ``slot`` at
        ``position``."""
        self.host_draft[slot][layer] = position

    def check_start(self, slot: int, start: int) -> None:
        """Refuse a forward of ``slot`` from ``start`` that its state cannot run: at the
        cursor, or behind it with the frontier at most ``speculative_tokens`` past ``start``
        (re-running positions of rejected drafts; the rings keep that much)."""
        at, front = self.host_position[slot], self.host_frontier[slot]
        k = self.geometry.speculative_tokens
        if start == at or (start < at and front - start <= k):
            return
        raise StateMismatchError(
            f"slot {slot}: state is at {at}, forward starts at {start}"
            + (f" (written to {front}; a forward may start at most {k} before that)" if k else "")
        )

    def refresh(self, slot: int) -> None:
        """Re-read ``slot``'s mirror from its bytes (one device read)."""
        at, tag = torch.stack([self.cursor[slot, 0], self.header[slot, 0]]).tolist()
        self.host_position[slot], self.host_tag[slot] = at, tag
        self.host_frontier[slot] = at
        if self.draft_cursor is not None:
            self.host_draft[slot] = self.draft_cursor[slot].tolist()

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
