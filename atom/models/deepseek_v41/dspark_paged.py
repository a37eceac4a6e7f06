"""DSpark in the engine's state: each stage's window of target KV in the request's slot, and
block drafts read from it (``atom.model_api.BlockDraftRuntime``).

A stage's window (``dspark`` module doc) holds ``kv_norm(wkv(main_x(q)))`` rotated at q for
the last ``sliding_window`` *target* positions q: a function of committed positions only
(their target hidden), never of a proposal. So the state has one rule: after the target has
committed positions [s, e) of a sequence, ``fill_target_windows`` writes them (the ring of
stage i is the slot's window layer ``num_hidden_layers + i``, row ``q % ring rows``) and moves
the stage cursors (``draft_cursor``) from s to e; a draft from the last committed position p
needs the cursors at p + 1. A rejected draft leaves nothing to rewind, and a checkpoint image
taken after the fill holds the window at its boundary, as a recompute would build it.

``draft_blocks`` runs the stages over one block per sequence, ``[t(p+1), noise, ...]`` at
positions p+1 .. p+B, each block attending its own window and its own keys (``attend_tiles``:
one tile per sequence). It writes nothing. Its drafts equal ``dspark.draft_block``'s (the
reference, from whole arrays) for the same target hidden.
"""

from __future__ import annotations

import torch

from atom.model_api import Span
from atom.models.common.mhc import collapse, identity_pre
from atom.models.deepseek_v41.paged import StateMismatchError, StateSlots
from atom.models.deepseek_v41.pool_geometry import GeometryError


def _check_state(model, slots: StateSlots) -> None:
    if not len(model.dspark):
        raise ValueError("the model has no DSpark stages (dspark_stages=0)")
    last = model.dspark[-1].self_attn.layer
    if slots.draft_cursor is None or slots.geometry.state_layers <= last:
        raise GeometryError(
            "the state has no window for the DSpark stages: build the runtime with "
            "speculative_tokens >= 1"
        )


def _check_slot(slots: StateSlots, slot: int) -> None:
    if not 0 <= slot < slots.num_slots:
        raise ValueError(f"slot {slot} out of range [0, {slots.num_slots})")


@torch.no_grad()
def fill_target_windows(model, hidden: torch.Tensor, spans: list[Span], slots: StateSlots) -> None:
    """Write the committed positions [start, end) of each span (one sequence each) into every
    stage's window of its slot: ``hidden`` [N, targets * d] is their target hidden
    (``forward_with_residual``), in span order. A span at 0 starts the window afresh; a span at
    s > 0 needs the stage cursors at s (else StateMismatchError, before any write)."""
    _check_state(model, slots)
    c = model.config
    width = c.hidden_size * len(c.dspark_target_layer_ids)
    n = sum(sp.num_tokens for sp in spans)
    if tuple(hidden.shape) != (n, width):
        raise ValueError(
            f"hidden must be [{n}, {width}] (the spans' tokens), got {list(hidden.shape)}"
        )
    rows = slots.window.shape[2]
    seen: set[int] = set()
    keep, pos, slot_of = [], [], []
    lo = 0
    for sp in spans:
        _check_slot(slots, sp.slot)
        if sp.end <= sp.start:
            raise ValueError(f"empty span [{sp.start}, {sp.end}) for slot {sp.slot}")
        if sp.slot in seen:
            raise ValueError(f"slot {sp.slot} appears twice in one fill")
        seen.add(sp.slot)
        at = slots.draft_position(sp.slot, 0)
        if sp.start > 0 and at != sp.start:
            raise StateMismatchError(
                f"slot {sp.slot}: the DSpark window holds target positions up to {at}, a fill "
                f"of [{sp.start}, {sp.end}) needs them up to {sp.start}"
            )
        first = max(sp.start, sp.end - rows)  # earlier rows would be overwritten in this fill
        keep.extend(range(lo + first - sp.start, lo + sp.num_tokens))
        pos.extend(range(first, sp.end))
        slot_of.extend([sp.slot] * (sp.end - first))
        lo += sp.num_tokens
    dev = model.device
    host = torch.tensor([keep, pos, slot_of], dtype=torch.int64)
    keep_d, pos_d, slot_d = host.to(dev).unbind(0)
    main_x = model.dspark[0].main_x(hidden.to(dev).index_select(0, keep_d))
    for st in model.dspark:
        kv = st.target_kv(main_x, pos_d)
        slots.window[slot_d, st.self_attn.layer, pos_d % rows] = kv.to(slots.window.dtype)
    ids = torch.tensor([sp.slot for sp in spans], dtype=torch.int64, device=dev)
    ends = torch.tensor([sp.end for sp in spans], dtype=torch.int64, device=dev)
    slots.draft_cursor[ids] = ends[:, None].expand(-1, slots.draft_cursor.shape[1])
    for sp in spans:
        for i in range(len(model.dspark)):
            slots.advance_draft(sp.slot, i, sp.end)


@torch.no_grad()
def draft_blocks(
    model, tokens: list[int], positions: list[int], slot_ids: list[int], slots: StateSlots
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One DSpark draft per sequence, greedy: sequence j's target has committed positions
    0 .. ``positions[j]`` (its stage windows filled through it) and produced ``tokens[j]``, the
    token at p + 1. Returns (drafted ids [n, B] int64 for p+2 .. p+B+1, logits [n, B, V]
    float32, confidence [n, B] float32), on the model's device. Writes nothing."""
    _check_state(model, slots)
    if not len(tokens) == len(positions) == len(slot_ids) or not tokens:
        raise ValueError("tokens, positions and slot_ids must be equally long, not empty")
    for slot, p in zip(slot_ids, positions):
        _check_slot(slots, slot)
        if slots.draft_position(slot, 0) != p + 1:
            raise StateMismatchError(
                f"slot {slot}: the DSpark window holds target positions up to "
                f"{slots.draft_position(slot, 0)}, a draft after position {p} needs {p + 1}"
            )
    c = model.config
    n, b, win, rows = len(tokens), c.dspark_block_size, c.sliding_window, slots.window.shape[2]
    dev = model.device
    p = torch.tensor(positions, dtype=torch.int64)
    ids = torch.full((n, b), c.dspark_noise_token_id, dtype=torch.int64)
    ids[:, 0] = torch.tensor(tokens, dtype=torch.int64)
    block_pos = p[:, None] + 1 + torch.arange(b)
    ring_pos = p[:, None] - win + 1 + torch.arange(win)  # oldest first
    host = torch.cat([ids, block_pos, ring_pos, torch.tensor(slot_ids)[:, None]], 1).to(dev)
    ids, block_pos, ring_pos, slot_d = host.split([b, b, win, 1], 1)
    valid = torch.cat([ring_pos >= 0, torch.ones(n, b, dtype=torch.bool, device=dev)], 1)
    mask = valid[:, None, :].expand(n, b, win + b).contiguous()
    x = model._embed(ids.flatten())
    pre = identity_pre(x)
    for st in model.dspark:
        ring = slots.window[slot_d, st.self_attn.layer, ring_pos.clamp(min=0) % rows]
        x, pre = st.block(
            x, pre, None, lambda u, s=st, r=ring: _attend(s, u, r, mask, block_pos.flatten())
        )
    last = model.dspark[-1]
    h = collapse(x, pre)
    logits = model.lm_head.float_logits(last.norm(h)).view(n, b, -1)
    out = [ids[:, 0]]
    embeds = []
    for i in range(b):
        bias, e = last.markov(out[i])
        logits[:, i] += bias
        embeds.append(e)
        out.append(logits[:, i].argmax(-1))
    embed = torch.stack(embeds, 1).reshape(n * b, -1)
    conf = last.confidence(torch.cat([h, embed], dim=-1).float()).view(n, b)
    return torch.stack(out[1:], 1), logits, conf


def _attend(stage, u: torch.Tensor, ring: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor):
    """DSpark attention of n blocks of B queries (u [n * B, d] at ``pos``): block j over its
    window ``ring[j]`` [W, hd] and its own B keys, all visible to all (``mask`` [n, B, W + B]
    hides window rows before position 0)."""
    attn = stage.self_attn
    n, b = mask.shape[0], mask.shape[1]
    cs = attn.rope.cos_sin(pos)
    q, _ = attn.queries(u, cs)
    own = attn.window_kv(u, cs)
    keys = torch.cat([ring.to(own.dtype), own.view(n, b, -1)], 1)
    out = attn.attend_tiles(q.view(n, b, *q.shape[1:]), keys, mask, None, None)
    return attn.output(out, cs)
