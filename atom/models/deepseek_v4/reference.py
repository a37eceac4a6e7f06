"""The oracle: one sequence from token 0, no pages, no chunks, no slots, no caches.

Every compressed row and indexer key is computed from the whole sequence at once (group j from
tokens j*r .. j*r + r - 1, and at ratio 4 the first halves of group j - 1's); every query attends
its window and its rows directly from those full arrays. Storage rounding is applied at the same
points as the paged path, so the two agree up to floating-point reduction order. Queries are
processed in independent tiles only to bound memory. ``reference_draft_forward`` is the same
oracle for one MTP draft layer (``mtp``).
"""

from __future__ import annotations

import torch

from atom.models.common.selection import (
    mask_invisible,
    picked_ids,
    select_topk,
    visible_rows,
    window_mask,
)
from atom.models.common.storage import index_roundtrip
from atom.models.deepseek_v4.attention import V4Attention, V4Compressor, V4Indexer, overlap_prev
from atom.models.deepseek_v4.model import DeepseekV4ForCausalLM

QUERY_TILE = 128


def _pooled(comp: V4Compressor, u: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Every complete group of the sequence, pooled: [n // r, dim] float32."""
    r = comp.ratio
    g = u.shape[0] // r
    if g == 0:
        return u.new_zeros(0, comp.dim, dtype=torch.float32)
    kv, score = comp.raw(u[: g * r], pos[: g * r])
    kv, score = kv.view(g, r, -1), score.view(g, r, -1)
    prev = overlap_prev(kv, score, None, comp.dim) if comp.overlap else (None, None)
    return comp.pool(kv, score, *prev)


def reference_attention(attn: V4Attention, u: torch.Tensor, pos: torch.Tensor, index_dtype: str):
    """One layer's attention over a whole sequence from position 0 (``u`` normed input)."""
    cs = attn.rope.cos_sin(pos)
    q, qr = attn.queries(u, cs)
    win = attn.window_kv(u, cs)
    n, r = u.shape[0], attn.ratio
    if r:
        pooled = _pooled(attn.compressor, u, pos)
        rows_cs = attn.rope.cos_sin(torch.arange(pooled.shape[0], device=u.device) * r)
        main = attn.main_rows(pooled, rows_cs).to(q.dtype)
        if attn.indexer is not None:
            pooled_i = _pooled(attn.indexer.compressor, u, pos)
            keys = attn.indexer.compressor.rows(pooled_i, attn.rope, rows_cs)
            keys = index_roundtrip(keys, index_dtype)
    out = torch.empty_like(q)
    for t0 in range(0, n, QUERY_TILE):
        t1 = min(n, t0 + QUERY_TILE)
        qp = pos[t0:t1]
        k0 = max(0, t0 - attn.window + 1)
        mask = window_mask(qp, pos[k0:t1], attn.window)
        comp = comp_mask = None
        if r:
            visible, seen = t1 // r, visible_rows(qp, r)
            if attn.indexer is not None:
                cs_t = (cs[0][t0:t1], cs[1][t0:t1])
                qi, w = attn.indexer.query(qr[t0:t1], u[t0:t1], attn.rope, cs_t)
                scores = V4Indexer.scores(qi, w, keys[:visible])
                sel = select_topk(mask_invisible(scores, seen), attn.indexer.topk)
                comp, comp_mask = main[:visible][picked_ids(sel)], sel[1]
            else:
                comp = main[:visible]
                comp_mask = torch.arange(visible, device=u.device)[None, :] < seen[:, None]
        out[t0:t1] = attn.attend(q[t0:t1], win[k0:t1], mask, comp, comp_mask)
    return attn.output(out, cs)


@torch.no_grad()
def reference_forward(model: DeepseekV4ForCausalLM, token_ids, return_residual: bool = False):
    """Logits (float32) [S, V] of every position of one sequence computed from scratch; with
    ``return_residual`` also the last layer's streams before ``hc_head`` [S, hc, d] (what the
    MTP draft layer reads)."""
    dev = model.device
    ids = torch.as_tensor(token_ids, dtype=torch.int64, device=dev)
    pos = torch.arange(ids.numel(), device=dev)
    x = model.embed_streams(ids)
    for layer in model.layers:
        attn = layer.attn
        x = layer(x, ids, lambda u, a=attn: reference_attention(a, u, pos, model.index_dtype))
    return (model.logits(x), x) if return_residual else model.logits(x)


@torch.no_grad()
def reference_generate(model: DeepseekV4ForCausalLM, prompt, max_tokens: int) -> list[int]:
    """Greedy continuation by full recompute at every step (the oracle for generation)."""
    ids = list(prompt)
    out = []
    for _ in range(max_tokens):
        tok = int(reference_forward(model, ids)[-1].argmax())
        out.append(tok)
        ids.append(tok)
    return out


@torch.no_grad()
def reference_draft_forward(
    model: DeepseekV4ForCausalLM, next_ids, residual: torch.Tensor, index: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle of one draft layer over one whole sequence from position 0, no caches.

    next_ids [S] (the token at p + 1 for each position p), residual [S, hc, d] (the streams at
    p) -> (float32 logits [S, V] predicting the token at p + 2, output streams [S, hc, d]).
    """
    dev = model.device
    ids = torch.as_tensor(next_ids, dtype=torch.int64, device=dev)
    if residual.shape != (ids.numel(), model.config.hc_mult, model.config.hidden_size):
        raise ValueError(
            f"residual must be [{ids.numel()}, {model.config.hc_mult}, "
            f"{model.config.hidden_size}], got {list(residual.shape)}"
        )
    pos = torch.arange(ids.numel(), device=dev)
    block = model.mtp[index]
    attn = block.attn
    x = block.draft(
        model.embed(ids),
        residual.to(dev),
        ids,
        lambda u: reference_attention(attn, u, pos, model.index_dtype),
    )
    return block.logits(x, model.head), x
