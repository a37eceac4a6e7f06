"""What a paged forward reads and writes: spans, state slots and views of the ONE PAGE pool.

Interval facts (per sequence, after a forward of [start, end)):
  PAGE rows of an owner with ratio r valid for groups [0, end // r)
  window ring of each layer holds positions [end - window_rows, end), row = pos % window_rows
  compressor ring of each owner holds raw projections of [end - compressor_rows, end)
  cursor = [end, ids at end-3, end-2, end-1]  (-1 before the sequence)

Target rewind (``speculative_tokens`` k >= 1): a forward may start at s behind the cursor c, to
re-run positions whose inputs were rejected drafts. The slot keeps a frontier f, the furthest
position any forward has reached since position 0 (f >= c; f = c unless the last forward
ended behind an earlier one), and ``history`` = [f, Engram ids at f - 3 - k .. f - 1]. A span
at s > 0 is accepted iff s <= c and f <= s + k (so with f = c: c in [s, s + k]); then every
row a forward at s reads is exact: rows written for positions in [s, f) (window ring row
p % (window + k), compressor ring row p % (max_ratio + k)) overwrite only positions < f - k - window
resp. < f - k - max_ratio, none of which a span at s >= f - k reads; PAGE rows of groups
completed past s are rewritten by the forward completing them before anything reads them; the
Engram ids at s - 3 .. s - 1 are in ``history`` (positions >= f - 3 - k). After [s, e) the
frontier is max(f, e) and ``history`` is refreshed from the span's ids and its old entries.
With k = 0 there is no ``history``: the frontier is the cursor and a span starts at it.
"""

from __future__ import annotations

import os

import torch

from atom.models.deepseek_v41.pool_geometry import FP8_DTYPE, KV_DTYPES, V41PoolGeometry


class StateMismatchError(RuntimeError):
    """A forward was asked to start where its state slot is not."""


class StateSlots:
    """Typed views of the state-slot bytes ``[num_slots, state_bytes]`` (uint8).

    A host mirror of every slot's (position, layout tag) lets a forward check its spans without
    reading the device: read once here (binding is not a forward), then kept by whoever writes a
    slot through this object (``reset``, ``advance``, ``refresh`` after an image restore). With
    ``verify`` (``ATOM_VERIFY_CURSORS=1``; on by default for CPU slots, where reading them is
    not a device synchronization) each check also compares the mirror with the device cursor.
    """

    def __init__(self, geometry: V41PoolGeometry, data: torch.Tensor):
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != geometry.state_bytes:
            raise ValueError(
                f"state slots must be uint8 [num_slots, {geometry.state_bytes}], "
                f"got {data.dtype} {list(data.shape)}"
            )
        self.geometry, self.data = geometry, data
        self.num_slots = data.shape[0]
        self.tag = geometry.state_spec().layout_tag
        views = {}
        for f in geometry.state_fields:
            dtype = {**KV_DTYPES, "int64": torch.int64}[f.dtype]
            raw = data[:, f.offset : f.offset + f.nbytes]
            views[f.name] = raw.view(dtype).view(self.num_slots, *f.shape)
        self.window = views["window"]
        self.comp_values = views["compressor_values"]
        self.comp_scores = views["compressor_scores"]
        self.cursor = views["cursor"]
        self.header = views["header"]
        # each draft layer's position (None: no draft state, speculative_tokens = 0)
        self.draft_cursor = views.get("draft_cursor")
        # [frontier, Engram ids before it] (None: speculative_tokens = 0, no rewind)
        self.history = views.get("history")
        self.speculative_tokens = geometry.speculative_tokens
        flag = os.environ.get("ATOM_VERIFY_CURSORS")
        self.verify = data.device.type == "cpu" if flag is None else flag == "1"
        self.host_position: list[int] = []
        self.host_tag: list[int] = []
        self.host_frontier: list[int] = []  # used only with ``history``
        self.host_draft: list[list[int]] = []  # each draft layer's cursor (with ``draft_cursor``)
        self.refresh()

    @classmethod
    def allocate(cls, geometry: V41PoolGeometry, num_slots: int, device) -> StateSlots:
        data = torch.zeros(num_slots, geometry.state_bytes, dtype=torch.uint8, device=device)
        return cls(geometry, data)

    def refresh(self, slot: int | None = None) -> None:
        """Re-read the mirror from the device (all slots, or one): after bytes were written
        around this object (an image restored into a slot). Not for use inside a forward."""
        if slot is None:
            at = self.device_states(list(range(self.num_slots)))
            self.host_position = [p for p, _ in at]
            self.host_tag = [t for _, t in at]
            if self.history is not None:
                self.host_frontier = self.history[:, 0].tolist()
            if self.draft_cursor is not None:
                self.host_draft = self.draft_cursor.tolist()
        else:
            [(self.host_position[slot], self.host_tag[slot])] = self.device_states([slot])
            if self.history is not None:
                self.host_frontier[slot] = int(self.history[slot, 0])
            if self.draft_cursor is not None:
                self.host_draft[slot] = self.draft_cursor[slot].tolist()

    @property
    def gram_history(self) -> torch.Tensor:
        """[num_slots, H] the Engram ids a forward reads before its span: the 3 + k ids before
        the frontier (``history``), or with k = 0 the cursor's 3 ids."""
        return self.cursor[:, 1:] if self.history is None else self.history[:, 1:]

    def frontier(self, slot: int) -> int:
        """The furthest position a forward has reached (host mirror; the cursor when k = 0)."""
        return self.host_position[slot] if self.history is None else self.host_frontier[slot]

    def check_start(self, slot: int, start: int) -> None:
        """Refuse a span at ``start`` > 0 the slot cannot run exactly (module doc): the cursor
        c must be in [start, start + k] and the frontier at most start + k."""
        at, k = self.host_position[slot], self.speculative_tokens
        f = self.frontier(slot)
        if not (start <= at and f <= start + k):
            why = f" (needs it in [{start}, {start + k}], frontier {f} at most {start + k})"
            raise StateMismatchError(
                f"slot {slot}: state is at {at}, forward starts at {start}" + (why if k else "")
            )

    def device_states(self, slots: list[int]) -> list[tuple[int, int]]:
        """(cursor position, layout tag) of ``slots`` read from the device (one transfer)."""
        if not slots:
            return []
        at = torch.stack([self.cursor[slots, 0], self.header[slots, 0]], 1).tolist()
        return [(p, t) for p, t in at]

    def reset(self, slot: int) -> None:
        """Empty state for a sequence starting at position 0."""
        self.data[slot].zero_()
        self.cursor[slot, 1:].fill_(-1)
        self.header[slot, 0].fill_(self.tag)
        if self.history is not None:
            self.history[slot, 1:].fill_(-1)
            self.host_frontier[slot] = 0
        if self.draft_cursor is not None:
            self.host_draft[slot] = [0] * self.draft_cursor.shape[1]
        self.host_position[slot], self.host_tag[slot] = 0, self.tag

    def reset_many(self, slots: list[int], index: torch.Tensor) -> None:
        """``reset`` of several slots, ``index``: the same slots as a device int64 tensor."""
        if not slots:
            return
        self.data.index_fill_(0, index, 0)
        self.cursor[:, 1:].index_fill_(0, index, -1)
        self.header[:, 0].index_fill_(0, index, self.tag)
        if self.history is not None:
            self.history[:, 1:].index_fill_(0, index, -1)
        for s in slots:
            self.host_position[s], self.host_tag[s] = 0, self.tag
            if self.history is not None:
                self.host_frontier[s] = 0
            if self.draft_cursor is not None:
                self.host_draft[s] = [0] * self.draft_cursor.shape[1]

    def advance(self, slot: int, position: int) -> None:
        """Record in the mirror that a forward left ``slot`` at ``position`` (the frontier
        becomes the larger of it and ``position``)."""
        self.host_position[slot], self.host_tag[slot] = position, self.tag
        if self.history is not None:
            self.host_frontier[slot] = max(self.host_frontier[slot], position)

    def advance_draft(self, slot: int, layer: int, position: int) -> None:
        """Record in the mirror that draft layer ``layer``'s forward left ``slot`` at
        ``position``."""
        self.host_draft[slot][layer] = position

    def draft_position(self, slot: int, layer: int) -> int:
        """Draft layer ``layer``'s cursor in ``slot`` (host mirror: no device read)."""
        return self.host_draft[slot][layer]

    def position(self, slot: int) -> int:
        """The slot's cursor position (from the host mirror: no device read)."""
        return self.host_position[slot]


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

    def __init__(self, geometry: V41PoolGeometry, pool: torch.Tensor):
        self.geometry, self.pool = geometry, pool
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
        other sequences' rows keep their bytes (no host sync to pick the writers)."""
        blocks, offs = (t[:, 0] for t in self._locate_each(owner, tables, rows[:, None]))
        pay_view, scale_view = self.index[owner]
        targets = [(self.main[owner], main.to(self.main[owner].dtype)), (pay_view, payload)]
        if scale_view is not None:
            targets.append((scale_view, scale))
        for view, new in targets:
            if view.dtype == FP8_DTYPE:  # torch.where has no fp8 kernels: select the bytes
                view, new = view.view(torch.uint8), new.view(torch.uint8)
            keep = where.view(-1, *([1] * (new.dim() - 1)))
            view[blocks, offs] = torch.where(keep, new, view[blocks, offs])
