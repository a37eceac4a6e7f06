"""What a model publishes to the engine and the tier (atom.tier), and what they call on it.

The engine and the tier never ask which model they run. They ask for a StateSpec: how many bytes
a PAGE block holds, how many bytes a request's state slot holds, how many whole PAGE blocks
("units") a checkpoint image of that state takes, and a layout id that changes whenever any of
those bytes would be laid out differently. A model without per-request state publishes
``state_bytes == 0`` and ``units_per_image == 0``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class StateSpec:
    block_size: int  # tokens per PAGE block
    block_bytes: int  # bytes per PAGE block (all planes)
    state_bytes: int  # bytes per state slot (== image bytes)
    layout_id: str  # hex digest of every field that places a byte
    header_offset: int  # byte offset of the slot header: int64 [layout tag, position]
    speculative_tokens: int = 0  # draft rows the state was laid out for (0: no drafts)

    @property
    def units_per_image(self) -> int:
        """Whole PAGE blocks one checkpoint image occupies."""
        return -(-self.state_bytes // self.block_bytes)

    @property
    def layout_tag(self) -> int:
        """The layout id as a non-negative int64, as written into each slot's header."""
        return int(self.layout_id[:16], 16) & 0x7FFF_FFFF_FFFF_FFFF

    @property
    def pool_dtype(self) -> torch.dtype:
        """Element type to allocate and register the pool with.

        The LMCache server copies int32 and bf16 tensors about 10x faster than uint8, so the
        widest type that divides a block's bytes per token is used; bytes are read through
        ``.view(torch.uint8)`` regardless.
        """
        per_token = self.block_bytes // self.block_size
        if per_token % 4 == 0:
            return torch.int32
        if per_token % 2 == 0:
            return torch.bfloat16
        return torch.uint8

    def pool_shape(self, num_blocks: int) -> tuple[int, int, int]:
        elem = torch.empty((), dtype=self.pool_dtype).element_size()
        return (num_blocks, self.block_size, self.block_bytes // self.block_size // elem)


@dataclass(frozen=True)
class Span:
    """One sequence's part of a paged forward: tokens [start, end) in state ``slot``, whose PAGE
    blocks are ``block_table`` (int64 pool block ids covering at least ceil(end / block)).

    A span past 0 of one token, or of at most 1 + speculative_tokens (a verify span: the last
    committed token and its drafts), is a decode step's: the model computes it as decode rows.
    ``prefill`` marks tokens the engine computes as a prompt (a prompt chunk, a preempted
    request's recompute): prefill rows whatever the span's length. Decode rows and prefill rows
    may differ in the last bits, so a prompt's bits would otherwise depend on where its chunks
    end: a 2-token tail chunk ran as verify rows with drafts only (its first token changed on an
    H100), a 1-token tail chunk as a decode row under one chunk budget and not another."""

    start: int
    end: int
    slot: int
    block_table: torch.Tensor
    prefill: bool = False

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


class ImageLayoutError(ValueError):
    """A checkpoint image whose layout is not this engine's."""


class ModelRuntime(Protocol):
    """The engine's whole view of a model: a spec, a pool binding, a forward, image copies.

    ``bind`` is called once, with the pool tensor as registered (with the tier, when one is
    attached) and the state-slot bytes; every view the model uses derives from those tensors.

    Optional members (a runtime without one behaves as its default; the engine reads them only
    through ``RuntimeCapabilities.of``, once, never by probing at its call sites):
    ``reserved_blocks`` / ``reserved_slots`` (int, 0: pool blocks and state slots the runtime
    keeps for itself, e.g. CUDA-graph padding), ``host_block_tables`` (bool, False: block tables
    are passed on the host), ``rewinds_on_rejection`` (bool, False: its state can re-run
    positions whose drafts were rejected), ``graph_stats()`` (CUDA graphs captured, replayed,
    failed), ``enable_decode_graphs(max_num_seqs, max_model_len)``, ``close()`` (other ranks
    to stop), ``rank_channels()`` (a tensor-parallel runtime: how the tier reaches its ranks).
    """

    spec: StateSpec
    vocab_size: int
    device: torch.device

    def bind(self, pool: torch.Tensor, slot_bytes: torch.Tensor) -> None: ...

    def forward(self, token_ids: torch.Tensor, spans: list[Span]) -> torch.Tensor:
        """Logits (float32) of each span's last token; refuses a span not at its slot's cursor."""
        ...

    def store_image(self, slot: int, units: torch.Tensor) -> None:
        """Copy the slot's bytes into the image units (pool block ids), byte-exact."""
        ...

    def restore_image(self, units: torch.Tensor, slot: int) -> int:
        """Copy an image into the slot; returns the position it resumes at. Raises
        ImageLayoutError for an image of another layout (the slot is left untouched)."""
        ...


@dataclass(frozen=True)
class RuntimeCapabilities:
    """The optional members of a ``ModelRuntime`` (its docstring says what each means), read
    once: the engine, the runner and the builder ask this value, not the runtime."""

    reserved_blocks: int = 0
    reserved_slots: int = 0
    host_block_tables: bool = False
    rewinds_on_rejection: bool = False
    graph_stats: Callable[[], dict] | None = None
    enable_decode_graphs: Callable[[int, int], None] | None = None
    close: Callable[[], None] | None = None
    rank_channels: Callable[[], Any] | None = None

    @classmethod
    def of(cls, runtime: object) -> RuntimeCapabilities:
        """The capabilities ``runtime`` declares (a member it lacks takes its default)."""
        declared = getattr(runtime, "capabilities", None)
        if isinstance(declared, RuntimeCapabilities):
            return declared
        return cls(**{f.name: getattr(runtime, f.name, f.default) for f in fields(cls)})


def shifted_spans(spans: list[Span], shift: torch.Tensor | None) -> list[Span]:
    """``spans`` moved by ``shift`` (int64 [len(spans)], one-row spans only; a host read), as
    ``DraftRuntime.draft_forward``'s ``shift`` asks of an eager draft forward."""
    if shift is None:
        return spans
    if any(sp.num_tokens != 1 for sp in spans):
        raise ValueError("a shifted draft forward takes one-row spans only")
    moved = shift.tolist()
    return [Span(sp.start + d, sp.end + d, sp.slot, sp.block_table) for sp, d in zip(spans, moved)]


@runtime_checkable
class DraftRuntime(Protocol):
    """A ModelRuntime whose model has its own draft layers (e.g. DeepSeek-V4's MTP block):
    what a speculative-decoding engine calls to propose tokens. ``draft_layers(runtime)`` says
    how many a runtime has (0 for one without this capability).

    Contract:

    * **residual**: per token, the streams the model hands its LM head, before the head reads
      them (float, ``[N, *residual_shape]``, the model's dtype). The engine treats it as opaque
      rows, one per token, and only passes rows back; it never interprets them.
    * ``forward_with_residual`` is ``forward`` (same spans, same state updates, same logits)
      that also returns every token's residual row ``[N, ...]``.
    * ``draft_forward(token_ids, residual, spans, layer=i)`` runs draft layer ``i`` at the
      positions p of the spans: ``token_ids[j]`` is the token at p + 1 and ``residual[j]`` the
      residual at p, from ``forward_with_residual`` or, when chaining, the residual a previous
      ``draft_forward`` returned for p - 1. It returns float32 logits for the token at p + 2 of
      each span's last position (every position with ``all_logits``) and its own residual rows
      ``[N, ...]`` (the next chained step's input).
    * Device-side chaining (``Drafter.propose_device``; a runtime without these keywords gets
      ``all_logits`` and host reads instead): ``logit_rows``
      (int64 [len(spans)] on the device, flat row indices) returns those rows' logits instead
      of each span's last; ``shift`` (int64 [len(spans)] on the device, one-row spans only)
      runs span i at ``start + shift[i]``. Neither needs a host read where the forward runs
      in a graph; an eager forward reads ``shift`` (``shifted_spans``). After a shifted
      forward the host mirror of those cursors may hold the unshifted ends: the caller, once
      it knows the shifts, settles them with ``settle_draft_cursors([(slot, layer,
      position)])`` (a host-only update) before the next draft forward of those slots.
    * Each draft layer keeps its own state per slot (a window of earlier draft positions and
      a cursor), written by ``draft_forward`` only; it never touches PAGE blocks or the target
      layers' state. A span at 0 always runs; a span at s > 0 needs the draft state at a
      position in [s, s + speculative_tokens]: the engine may re-run positions whose drafts
      were rejected (at most ``speculative_tokens`` back), never skip one. Anything else
      raises ``ValueError`` (StateMismatchError) before any write.
    * The draft state exists only when the runtime was built with ``speculative_tokens >= 1``
      (the geometry sizes it then, and it travels in checkpoint images); ``draft_forward``
      raises otherwise.
    """

    num_draft_layers: int

    def forward_with_residual(
        self, token_ids: torch.Tensor, spans: list[Span], all_logits: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def draft_forward(
        self,
        token_ids: torch.Tensor,
        residual: torch.Tensor,
        spans: list[Span],
        *,
        layer: int = 0,
        all_logits: bool = False,
        logit_rows: torch.Tensor | None = None,
        shift: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def settle_draft_cursors(self, cursors: list[tuple[int, int, int]]) -> None: ...


@runtime_checkable
class BlockDraftRuntime(Protocol):
    """A ModelRuntime whose model drafts a block of tokens in one pass from the target's own
    hidden states (DeepSeek-V4.1's DSpark): what a speculative-decoding engine calls to
    propose tokens. ``block_draft_size(runtime)`` says how many one draft proposes (0 for a
    runtime without this capability).

    Contract:

    * ``forward_with_residual`` as in ``DraftRuntime``; the residual rows are what the drafter
      reads of each token (opaque to the engine).
    * ``fill_draft_windows(residual, spans)``: after a forward, the spans' *committed*
      positions [start, end) (one sequence each) and their residual rows, in span order. The
      drafter's state is a function of committed positions only, so a span at s > 0 must start
      where the previous fill of its slot ended (``ValueError`` / StateMismatchError
      otherwise, before any write); a span at 0 starts afresh. Writes only the drafter's state
      in each slot (it travels in checkpoint images, ``speculative_tokens >= 1``).
    * ``draft_blocks(tokens, positions, slots)``: for each sequence whose slot holds committed
      positions 0 .. p (filled through p) and whose target produced ``tokens[j]`` at p + 1,
      the ``draft_block_size`` greedy drafts for p + 2 .. (a list per sequence). Writes nothing.
    """

    draft_block_size: int

    def forward_with_residual(
        self, token_ids: torch.Tensor, spans: list[Span], all_logits: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def fill_draft_windows(self, residual: torch.Tensor, spans: list[Span]) -> None: ...

    def draft_blocks(
        self, tokens: list[int], positions: list[int], slots: list[int]
    ) -> list[list[int]]: ...


def block_draft_size(runtime: object) -> int:
    """Tokens one block draft of the runtime proposes (``BlockDraftRuntime``), 0 without."""
    if not isinstance(runtime, BlockDraftRuntime):
        return 0
    return int(getattr(runtime, "draft_block_size", 0))


def draft_layers(runtime: object) -> int:
    """How many draft layers a runtime offers (``DraftRuntime``), 0 without the capability."""
    return int(getattr(runtime, "num_draft_layers", 0)) if isinstance(runtime, DraftRuntime) else 0


def pool_bytes(pool: torch.Tensor) -> torch.Tensor:
    """The pool as bytes [num_blocks, block_bytes] (a view of the same storage)."""
    return pool.view(torch.uint8).view(pool.shape[0], -1)


def store_image(
    spec: StateSpec, pool: torch.Tensor, slot_bytes: torch.Tensor, slot: int, units: torch.Tensor
) -> None:
    """Copy slot ``slot`` into the first ``state_bytes`` of units (whole blocks, in order)."""
    _check_units(spec, units)
    blocks, flat, bb = pool_bytes(pool), slot_bytes[slot], spec.block_bytes
    full, rem = divmod(spec.state_bytes, bb)
    if full:
        blocks[units[:full]] = flat[: full * bb].view(full, bb)
    if rem:
        blocks[units[full], :rem] = flat[full * bb :]


def image_header(spec: StateSpec, pool: torch.Tensor, units) -> tuple[int, int]:
    """(layout tag, boundary position) an image in ``units`` carries in its header."""
    unit, off = divmod(spec.header_offset, spec.block_bytes)
    raw = pool_bytes(pool)[int(units[unit]), off : off + 16]
    tag, position = raw.cpu().view(torch.int64).tolist()
    return tag, position


def restore_image(
    spec: StateSpec, pool: torch.Tensor, slot_bytes: torch.Tensor, units: torch.Tensor, slot: int
) -> None:
    """Copy an image back into a slot, byte-exact; refuse an image of another layout."""
    _check_units(spec, units)
    tag, _ = image_header(spec, pool, units)
    if tag != spec.layout_tag:
        raise ImageLayoutError(
            f"checkpoint image has layout tag {tag:#x}, this engine's layout is "
            f"{spec.layout_tag:#x} ({spec.layout_id}); it was written by another model or "
            "geometry and cannot be restored"
        )
    blocks, flat, bb = pool_bytes(pool), slot_bytes[slot], spec.block_bytes
    full, rem = divmod(spec.state_bytes, bb)
    if full:
        flat[: full * bb].view(full, bb).copy_(blocks[units[:full]])
    if rem:
        flat[full * bb :].copy_(blocks[units[full], :rem])


def _check_units(spec: StateSpec, units: torch.Tensor) -> None:
    if units.numel() != spec.units_per_image:
        raise ValueError(f"an image takes {spec.units_per_image} units, got {units.numel()}")
