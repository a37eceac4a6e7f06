"""V4.1's draft layers (``num_nextn_predict_layers`` of them): multi-token prediction.

Draft layer ``i`` is a decoder layer at index ``L + i`` (``L = num_hidden_layers``), named in
checkpoints as DeepSeek-V3 names its MTP layers: extra decoder layers ``model.layers.{L + i}.*``
(``weights`` maps the model's ``mtp.{i}.*`` parameters to those names). Its attention is
window-only (``compress_ratios[L + i]`` is 0: the sliding window of the V4.1 attention, RoPE
``rope_theta`` without YaRN, no compressor, no indexer), its MoE is an ordinary V4.1 MoE, it has
no Engram; around it (DeepSeek-V3's MTP module, on mHC streams):

    e   = enorm(embed(ids))                                   # [N, d], the main embedding
    x   = eh_proj([e, hnorm(residual_b)]) for each stream b   # [N, hc, d]
    x'  = layer(x)                                            # the streams out
    out = lm_head(shared_head.norm(head_hc(x')))              # float32 logits

The layer's attention collapses its input streams with the one-hot ``identity_pre`` (as the
main model's first layer and the published DSpark stages do); its FFN with its attention
mixer's ``pre``; ``head_hc`` (an mHC head mixer, ``atom.models.common.mhc``) reads x'.

``enorm``, ``hnorm``, ``eh_proj`` (one projection [d, 2d] of the concatenation, embedding half
first), ``head_hc`` (the layer's own mHC head reader, named like the main ``model.head_hc``) and
``shared_head.norm`` are the layer's own; the embedding and ``shared_head.head`` are the main
model's ``model.embed_tokens`` / ``lm_head`` (shared: the checkpoint holds no per-layer copy, and
one that does is refused as unexpected tensors).

Alignment (``atom.model_api.DraftRuntime``): the draft at position p takes the token at p + 1
and the residual at p (the target's last-layer streams, or the previous draft call's ``x'``
when chaining) and predicts the token at p + 2; its attention runs at p over its own window
ring of earlier draft positions (state window rows ``L + i``, cursor ``draft_cursor[i]``).
"""

from __future__ import annotations

import torch

from atom.model_api import Span
from atom.models.common.layers import RMSNorm, linear
from atom.models.common.mhc import collapse, identity_pre
from atom.models.deepseek_v41.attention import CSA2Attention, window_mask
from atom.models.deepseek_v41.block import DecoderLayer, hc_mixer
from atom.models.deepseek_v41.config import V41Config
from atom.models.deepseek_v41.paged import StateMismatchError, StateSlots
from atom.models.deepseek_v41.pool_geometry import GeometryError


class SharedHead(torch.nn.Module):
    """``shared_head``: its own norm; the head itself is the model's ``lm_head``."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.norm = RMSNorm(dim, eps, dtype)


class DraftLayer(DecoderLayer):
    """A decoder layer at index ``num_hidden_layers + i`` plus the MTP extras (module doc)."""

    def __init__(self, config: V41Config, layer: int, dtype: torch.dtype, kv_dtype: str):
        super().__init__(config, layer, dtype, kv_dtype)
        d, eps = config.hidden_size, config.rms_norm_eps
        self.layer, self.index = layer, layer - config.num_hidden_layers
        self.enorm = RMSNorm(d, eps, dtype)
        self.hnorm = RMSNorm(d, eps, dtype)
        self.eh_proj = linear(2 * d, d, dtype)
        self.head_hc = hc_mixer(config, head=True)
        self.shared_head = SharedHead(d, eps, dtype)

    def draft_input(self, embedded: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """embedded [N, d], residual [N, hc, d] -> the layer's input streams [N, hc, d]."""
        dtype = self.eh_proj.weight.dtype
        h = self.hnorm(residual.to(dtype))
        e = self.enorm(embedded.to(dtype))[:, None, :].expand_as(h)
        return self.eh_proj(torch.cat([e, h], dim=-1))

    def draft(self, embedded: torch.Tensor, residual: torch.Tensor, attend) -> torch.Tensor:
        """The layer's output streams [N, hc, d]; ``attend(normed input) -> output``."""
        x = self.draft_input(embedded, residual)
        return self.block(x, identity_pre(x), None, attend)[0]

    def logits(self, x: torch.Tensor, lm_head: torch.nn.Linear) -> torch.Tensor:
        """Streams [N, hc, d] -> float32 logits [N, V] through the shared head."""
        pre, _, _ = self.head_hc.mixes(x)
        return lm_head(self.shared_head.norm(collapse(x, pre))).float()


def _check_inputs(model, token_ids: torch.Tensor, residual: torch.Tensor, n: int) -> None:
    c = model.config
    if token_ids.numel() != n:
        raise ValueError("token_ids must hold exactly the spans' tokens, in span order")
    if tuple(residual.shape) != (token_ids.numel(), c.hc_mult, c.hidden_size):
        raise ValueError(
            f"residual must be [{token_ids.numel()}, {c.hc_mult}, {c.hidden_size}], "
            f"got {list(residual.shape)}"
        )


def check_draft_spans(model, spans: list[Span], slots: StateSlots, layer: int) -> None:
    """Refuse draft spans the draft layer's state cannot continue (before any write): a span at
    s > 0 needs the layer's window of [s - window, s), so its cursor must be in
    [s, s + speculative_tokens] (it may rewind over rejected drafts, no further)."""
    if not 0 <= layer < len(model.mtp):
        raise ValueError(f"draft layer {layer} out of range [0, {len(model.mtp)})")
    geo = slots.geometry
    if slots.draft_cursor is None or geo.state_layers <= model.mtp[layer].layer:
        raise GeometryError(
            "the state has no window ring for the draft layers: build the runtime with "
            "speculative_tokens >= 1"
        )
    seen = set()
    for sp in spans:
        if sp.end <= sp.start:
            raise ValueError(f"empty span [{sp.start}, {sp.end}) for slot {sp.slot}")
        if sp.slot in seen:
            raise ValueError(f"slot {sp.slot} appears twice in one forward")
        seen.add(sp.slot)
        if not 0 <= sp.slot < slots.num_slots:
            raise ValueError(f"slot {sp.slot} out of range [0, {slots.num_slots})")
    resumed = [sp for sp in spans if sp.start > 0]
    if not resumed:
        return
    k = geo.speculative_tokens
    if slots.verify:
        _verify_draft_mirror(resumed, slots, layer)
    for sp in resumed:
        at, tag = slots.draft_position(sp.slot, layer), slots.host_tag[sp.slot]
        if tag != slots.tag:
            raise StateMismatchError(
                f"slot {sp.slot} holds no state of this layout (tag {tag:#x}), "
                f"draft forward starts at {sp.start}"
            )
        if not sp.start <= at <= sp.start + k:
            raise StateMismatchError(
                f"slot {sp.slot}: draft layer {layer} is at {at}, a draft forward at "
                f"{sp.start} needs it in [{sp.start}, {sp.start + k}] (speculative_tokens={k})"
            )


def _verify_draft_mirror(spans: list[Span], slots: StateSlots, layer: int) -> None:
    """Debug/test mode: the host mirror of the draft cursors equals the device (a device read)."""
    ids = [sp.slot for sp in spans]
    states = torch.stack([slots.draft_cursor[ids, layer], slots.header[ids, 0]], 1).tolist()
    for slot, (at, tag) in zip(ids, states):
        mirror = (slots.draft_position(slot, layer), slots.host_tag[slot])
        if mirror != (at, tag):
            raise RuntimeError(
                f"slot {slot}: host mirror says draft layer {layer} at {mirror[0]} tag "
                f"{mirror[1]:#x}, the device says {at} tag {tag:#x}"
            )


def draft_window_attention(
    attn: CSA2Attention, u: torch.Tensor, batch, slots: StateSlots
) -> torch.Tensor:
    """``_paged_window_attention`` in fixed shapes over a ``DecodeBatch`` whose rows are the
    flat batch (a draft graph, ``span_graphs``): the row at p attends p - window + 1 .. p (its
    own span's earlier positions from the batch, the others from the ring) and writes its KV to
    the ring. The same keys as the loop, in another order."""
    cs = attn.rope.cos_sin(batch.pos)
    q, _ = attn.queries(u, cs)
    win = attn.window_kv(u, cs)
    ring_rows, valid, own_row = batch.window_index(attn.window, slots.window.shape[2])
    ring = slots.window[batch.slots[:, None], attn.layer, ring_rows].to(win.dtype)
    keys = torch.cat([batch.earlier(win, ring, attn.window - 1), win[:, None]], 1)
    out = attn.attend(q, keys, valid, None, None)
    slots.window[batch.slots, attn.layer, own_row] = win.to(slots.window.dtype)
    return attn.output(out, cs)


def _paged_window_attention(
    attn: CSA2Attention, u: torch.Tensor, spans: list[Span], slots: StateSlots
) -> torch.Tensor:
    """Window-only attention of one draft layer over the spans (one sequence each): keys are
    the ring rows of [max(0, s - window + 1), s) and the span's own KV; afterwards the span's
    last ring-rows KV rows are written to the ring (row = pos % ring rows)."""
    dev, rows = u.device, slots.window.shape[2]
    positions = torch.cat([torch.arange(sp.start, sp.end, device=dev) for sp in spans])
    cs = attn.rope.cos_sin(positions)
    q, _ = attn.queries(u, cs)
    win = attn.window_kv(u, cs)
    out = torch.empty_like(q)
    lo = 0
    for sp in spans:
        hi = lo + sp.num_tokens
        pos = positions[lo:hi]
        before = torch.arange(max(0, sp.start - attn.window + 1), sp.start, device=dev)
        ring = slots.window[sp.slot, attn.layer, before % rows].to(win.dtype)
        keys = torch.cat([ring, win[lo:hi]])
        mask = window_mask(pos, torch.cat([before, pos]), attn.window)
        out[lo:hi] = attn.attend(q[lo:hi], keys, mask, None, None)
        keep = min(sp.num_tokens, rows)
        written = torch.arange(sp.end - keep, sp.end, device=dev)
        slots.window[sp.slot, attn.layer, written % rows] = win[hi - keep : hi].to(
            slots.window.dtype
        )
        lo = hi
    return attn.output(out, cs)


@torch.no_grad()
def forward_draft_paged(
    model,
    token_ids: torch.Tensor,
    residual: torch.Tensor,
    spans: list[Span],
    slots: StateSlots,
    *,
    layer: int = 0,
    all_logits: bool = False,
    logit_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft layer over spans (contract: ``atom.model_api.DraftRuntime``).

    token_ids int64 [N] (for each position p of the spans, the token at p + 1), residual
    [N, hc, d] (the streams at p). Returns (float32 logits [len(spans), V] of each span's last
    position (of the rows ``logit_rows`` int64 [len(spans)] names instead, when given), or
    [N, V] with ``all_logits``, predicting the token at p + 2; the layer's output streams
    [N, hc, d]). Writes only the layer's window ring and its cursor in each slot."""
    _check_inputs(model, token_ids, residual, sum(sp.num_tokens for sp in spans))
    check_draft_spans(model, spans, slots, layer)
    ids = token_ids.to(model.device)
    block = model.mtp[layer]
    x = block.draft(
        model.model.embed_tokens(ids),
        residual.to(model.device),
        lambda u: _paged_window_attention(block.self_attn, u, spans, slots),
    )
    for sp in spans:
        slots.draft_cursor[sp.slot, layer] = sp.end
        slots.advance_draft(sp.slot, layer, sp.end)
    if all_logits:
        return block.logits(x, model.lm_head), x
    if logit_rows is None:
        last, lo = [], 0
        for sp in spans:
            lo += sp.num_tokens
            last.append(lo - 1)
        logit_rows = torch.tensor(last)
    return block.logits(x[logit_rows.to(x.device)], model.lm_head), x


@torch.no_grad()
def reference_draft_forward(
    model, next_ids, residual: torch.Tensor, layer: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle of one draft layer over one whole sequence from position 0: no ring, no
    cursor, every query attending its window over the whole sequence's KV at once.

    next_ids [S] (the token at p + 1 for each position p), residual [S, hc, d] (the streams at
    p) -> (float32 logits [S, V] predicting the token at p + 2, output streams [S, hc, d])."""
    dev = model.device
    ids = torch.as_tensor(next_ids, dtype=torch.int64, device=dev)
    _check_inputs(model, ids, residual, ids.numel())
    pos = torch.arange(ids.numel(), device=dev)
    block = model.mtp[layer]
    attn = block.self_attn

    def attend(u: torch.Tensor) -> torch.Tensor:
        cs = attn.rope.cos_sin(pos)
        q, _ = attn.queries(u, cs)
        win = attn.window_kv(u, cs)
        out = attn.attend(q, win, window_mask(pos, pos, attn.window), None, None)
        return attn.output(out, cs)

    x = block.draft(model.model.embed_tokens(ids), residual.to(dev), attend)
    return block.logits(x, model.lm_head), x
