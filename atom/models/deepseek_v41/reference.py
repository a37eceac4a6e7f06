"""The oracle: one sequence from token 0, no pages, no chunks, no slots, no caches.

Every compressed row and index key is computed from the whole sequence at once; every query
attends its window and its selection directly from those full arrays. Storage rounding is
applied at the same points as the paged path (``kv_roundtrip`` / ``index_roundtrip``), so the
two agree up to floating-point reduction order. Queries are processed in independent tiles only
to bound memory; no tile reads anything another tile produced.
"""

from __future__ import annotations

import torch

from atom.models.common.mhc import identity_pre
from atom.models.common.storage import index_roundtrip
from atom.models.deepseek_v41.attention import (
    CSA2Attention,
    gather_selected,
    layer_selection,
    visible_rows,
    window_mask,
)
from atom.models.deepseek_v41.config import LayerMode
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM

QUERY_TILE = 128


def _attention(
    attn: CSA2Attention,
    u: torch.Tensor,
    pos: torch.Tensor,
    rows: dict[int, tuple[torch.Tensor, torch.Tensor]],
    selections: dict[int, list],
    index_dtype: str,
) -> torch.Tensor:
    cs = attn.rope.cos_sin(pos)
    q, qlat = attn.queries(u, cs)
    win = attn.window_kv(u, cs)
    n, r = u.shape[0], attn.ratio
    if attn.mode is LayerMode.FULL:
        values, scores = attn.compressor.raw(u)
        g = n // r
        v = values[: g * r].view(g, r, values.shape[-1])
        sc = scores[: g * r].view(g, r, scores.shape[-1]) if scores is not None else None
        j = torch.arange(g, device=u.device)
        main, keys = attn.compressed_rows(attn.compressor.pool(v, sc), attn.rope.cos_sin(j * r))
        rows[attn.layer] = (main, index_roundtrip(keys, index_dtype))
    out = torch.empty_like(q)
    candidates = selections.setdefault("candidates", [])
    for tile, t0 in enumerate(range(0, n, QUERY_TILE)):
        t1 = min(n, t0 + QUERY_TILE)
        qp = pos[t0:t1]
        k0 = max(0, t0 - attn.window + 1)
        mask = window_mask(qp, pos[k0:t1], attn.window)
        comp = valid = None
        if r > 0:
            main, keys = rows[attn.kv_owner]
            visible = t1 // r
            if attn.mode in (LayerMode.FULL, LayerMode.REINDEX):
                sel, cand = layer_selection(
                    attn,
                    qlat[t0:t1],
                    u[t0:t1],
                    (cs[0][t0:t1], cs[1][t0:t1]),
                    keys[:visible],
                    visible_rows(qp, r),
                    candidates[tile] if attn.mode is LayerMode.REINDEX else None,
                )
                selections.setdefault(attn.layer, []).append(sel)
                if cand is not None:
                    candidates.append(cand)
            sel = selections[attn.sel_owner][tile]
            comp, valid = gather_selected(main[:visible], sel), sel[1]
        out[t0:t1] = attn.attend(q[t0:t1], win[k0:t1], mask, comp, valid)
    return attn.output(out, cs)


@torch.no_grad()
def reference_forward(model: DeepseekV41ForCausalLM, token_ids) -> torch.Tensor:
    """Logits (float32) [S, V] of every position of one sequence computed from scratch."""
    return reference_with_hidden(model, token_ids)[0]


@torch.no_grad()
def reference_with_hidden(
    model: DeepseekV41ForCausalLM, token_ids
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits [S, V] float32, DSpark's target hidden [S, targets * d] or None without DSpark
    stages): the mean over the streams of each ``dspark_target_layer_ids`` layer's input
    (after its Engram), concatenated in layer order (``dspark`` module doc)."""
    targets = model.config.dspark_target_layer_ids if len(model.dspark) else []
    hidden: list[torch.Tensor] = []
    dev = model.device
    ids = torch.as_tensor(token_ids, dtype=torch.int64, device=dev)
    pos = torch.arange(ids.numel(), device=dev)
    grams = torch.cat([torch.full((3,), -1, dtype=torch.int64, device=dev), ids]).unfold(0, 4, 1)
    engram_rows = model.engram_rows(grams)
    rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    selections: dict = {}
    x = model._embed(ids)
    pre = identity_pre(x)
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        x, pre = layer.block(
            x,
            pre,
            engram_rows,
            lambda u, a=attn: _attention(a, u, pos, rows, selections, model.index_dtype),
            (lambda h: hidden.append(h.mean(dim=1))) if i in targets else None,
        )
    return model._head(x, pre), (torch.cat(hidden, dim=-1) if hidden else None)


@torch.no_grad()
def reference_generate(model: DeepseekV41ForCausalLM, prompt, max_tokens: int) -> list[int]:
    """Greedy continuation by full recompute at every step (the oracle for generation)."""
    ids = list(prompt)
    out = []
    for _ in range(max_tokens):
        tok = int(reference_forward(model, ids)[-1].argmax())
        out.append(tok)
        ids.append(tok)
    return out
