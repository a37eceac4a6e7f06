"""Batch tensors, state-slot copies and the forward of one step.

Order within a step: restores (image -> slot), the forward, image stores (slot -> image). A
store therefore captures the state exactly at the boundary its forward ended on, before any
later step mutates the slot; a restore lands before the forward that reads it. With speculative
decoding the step makes the stores itself (``store_images``), after the accept walk and the
draft layers, and only for spans whose end was committed.

Slot ownership is tracked here: a span may continue a slot only if the same sequence owned it
last; a new owner must start at 0 (the model resets the slot) or restore an image, whatever the
slot's cursor happens to say.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection

import torch

from atom.engine.sequence import ScheduledSpan
from atom.model_api import ModelRuntime, RuntimeCapabilities, Span


class SlotOwnershipError(RuntimeError):
    pass


class ModelRunner:
    def __init__(self, runtime: ModelRuntime, num_blocks: int, num_slots: int):
        self.runtime, self.spec = runtime, runtime.spec
        device = runtime.device
        # a runtime may reserve blocks and slots past the engine's (its decode graphs' padding
        # rows use them); the engine never schedules them
        caps = RuntimeCapabilities.of(runtime)
        extra_blocks, extra_slots = caps.reserved_blocks, caps.reserved_slots
        self.host_block_tables = caps.host_block_tables
        self.pool = torch.zeros(
            self.spec.pool_shape(num_blocks + extra_blocks),
            dtype=self.spec.pool_dtype,
            device=device,
        )
        self.slot_bytes = torch.zeros(
            num_slots + extra_slots, self.spec.state_bytes, dtype=torch.uint8, device=device
        )
        self.slot_owner: list[int | None] = [None] * num_slots
        self.device = device
        self._bound = False

    def bind(self) -> None:
        """Derive the model's views from the pool (call after any tier registration)."""
        self.runtime.bind(self.pool, self.slot_bytes)
        self._bound = True

    def _units(self, blocks: list[int]) -> torch.Tensor:
        return torch.tensor(blocks, dtype=torch.int64, device=self.device)

    def execute(
        self,
        spans: list[ScheduledSpan],
        full_logits: Collection[int] = (),
        *,
        residual: bool = False,
        images: bool = True,
    ) -> torch.Tensor:
        """Run one step; returns float32 logits [len(spans), V] (each span's last token).

        ``full_logits``: indices of spans that need the logits of every token (prompt
        logprobs, verify spans); those spans run in a forward of their own, so the others do
        not pay for them (unless, with ``residual``, every other span is one token: then one
        forward runs all), and ``self.span_logits[i]`` holds span i's [end - start, V] after
        the call (and may for other spans too). ``residual`` (a ``DraftRuntime``):
        ``self.span_residual[i]`` holds span i's residual rows [end - start, ...] after the
        call. ``images=False`` leaves the spans' image stores to the caller
        (``store_images``), who decides which are valid. When one forward ran every span with
        every token's logits, ``self.step_logits`` holds them all [N, V] (rows in span order)
        and, with ``residual``, ``self.step_residual`` their residual rows; else both are
        None."""
        assert self._bound, "bind() the runner before running it"
        self.span_logits: dict[int, torch.Tensor] = {}
        self.span_residual: dict[int, torch.Tensor] = {}
        self.step_logits = self.step_residual = None
        for sp in spans:
            seq, slot = sp.seq, sp.seq.slot
            if sp.restore is not None:
                at = self.runtime.restore_image(self._units(sp.restore.units), slot)
                if at != sp.start:
                    raise SlotOwnershipError(f"restored image is at {at}, span starts {sp.start}")
                self.slot_owner[slot] = seq.seq_id
            elif sp.start == 0:
                self.slot_owner[slot] = seq.seq_id  # the model resets the slot
            elif self.slot_owner[slot] != seq.seq_id:
                raise SlotOwnershipError(
                    f"{seq.request_id} continues at {sp.start} in slot {slot}, owned by "
                    f"sequence {self.slot_owner[slot]}; a new owner must restore or start at 0"
                )
        full = sorted(set(full_logits))
        if (
            full
            and residual
            and all(spans[i].end - spans[i].start == 1 for i in range(len(spans)) if i not in full)
        ):
            # a speculative step's decode spans (verify spans and single tokens): one forward
            # (one verify graph), since a single token's only logits are its last
            full = list(range(len(spans)))
        if not full:
            logits = self._forward(spans, range(len(spans)), False, residual)
        else:
            rows: dict[int, torch.Tensor] = {}
            rest = [i for i in range(len(spans)) if i not in full]
            if rest:
                part = self._forward([spans[i] for i in rest], rest, False, residual)
                rows.update(zip(rest, part))
            every, lo = self._forward([spans[i] for i in full], full, True, residual), 0
            if not rest:
                self.step_logits = every
            for i in full:
                n = spans[i].end - spans[i].start
                self.span_logits[i] = every[lo : lo + n]
                rows[i] = every[lo + n - 1]
                lo += n
            logits = torch.stack([rows[i] for i in range(len(spans))])
        if self.step_logits is None:  # (the residual of one of two forwards, or of last rows)
            self.step_residual = None
        if images:
            self.store_images(spans)
        return logits

    def store_images(self, spans: list[ScheduledSpan]) -> None:
        """Copy each span's slot into its PENDING image (the state at the span's end)."""
        for sp in spans:
            if sp.image is not None:
                self.runtime.store_image(sp.seq.slot, self._units(sp.image.units))

    def _forward(
        self, spans: list[ScheduledSpan], index, all_logits: bool, residual: bool
    ) -> torch.Tensor:
        """One forward over ``spans`` (span indices ``index`` of the step); with ``residual``
        each span's residual rows go to ``span_residual``."""
        ids = torch.tensor([t for sp in spans for t in sp.token_ids()], dtype=torch.int64)
        # a runtime that uploads its forward's indices in one copy takes host block tables
        # (a device table per span would be one host-to-device copy, and sync, each)
        host = self.host_block_tables
        model_spans = [
            Span(
                sp.start,
                sp.end,
                sp.seq.slot,
                (
                    torch.tensor(sp.seq.block_table, dtype=torch.int64)
                    if host
                    else self._units(sp.seq.block_table)
                ),
                prefill=not sp.decodes,
            )
            for sp in spans
        ]
        if residual:
            logits, res = self.runtime.forward_with_residual(ids, model_spans, all_logits)
            self.step_residual, lo = res, 0
            for i, sp in zip(index, spans):
                self.span_residual[i] = res[lo : lo + sp.end - sp.start]
                lo += sp.end - sp.start
            return logits
        if not all_logits:
            return self.runtime.forward(ids, model_spans)
        forward = self.runtime.forward
        if "all_logits" in inspect.signature(forward).parameters:
            return forward(ids, model_spans, all_logits=True)
        # the runtimes' forward has no all_logits yet: their model's paged forward does
        rt = self.runtime
        return rt.model.forward_paged(ids, model_spans, rt.kv, rt.slots, all_logits=True)
