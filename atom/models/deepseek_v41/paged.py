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

from atom.models.common.geometry import KV_DTYPES
from atom.models.common.paged import PagedKV, StateMismatchError
from atom.models.deepseek_v41.pool_geometry import V41PoolGeometry

__all__ = ["PagedKV", "StateMismatchError", "StateSlots"]


class StateSlots:
    """Typed views of the state-slot bytes ``[num_slots, state_bytes]`` (uint8).

    A host mirror of every slot's (position, layout tag) lets a forward check its spans without
    reading the device: read once here (binding is not a forward), then kept by whoever writes a
    slot through this object (``reset``, ``advance``, ``refresh`` after an image restore). With
    ``verify`` (``ATOM_VERIFY_CURSORS=1``; on by default for CPU slots, where reading them is
    not a device synchronization) each check also compares the mirror with the device cursor:
    a debugging check that reads and raises, and changes nothing that is computed.
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
