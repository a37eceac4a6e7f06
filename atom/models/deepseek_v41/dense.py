"""A batched, differentiable forward for training: every compressed layer attends *all*
visible compressed rows (top-k as large as the context), and each index-source layer's indexer
is fitted to the attention it would select for.

With ``index_topk`` and the candidate budget at least the number of compressed rows this is the
same function as ``reference_forward`` (a test checks it), batched over sequences of one length
and with gradients. The indexer's loss is DeepSeek's dense warm-up: the KL divergence from the
(detached) head-summed attention over compressed rows to the softmax of the index scores, so a
model trained dense can run with a small top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom.models.common.mhc import identity_pre
from atom.models.common.storage import index_roundtrip
from atom.models.deepseek_v41.attention import NEG_INF, CSA2Attention
from atom.models.deepseek_v41.config import LayerMode
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM


def _rows(attn: CSA2Attention, u: torch.Tensor, index_dtype: str):
    """Compressed rows of a FULL layer for a batch: (main [B, G, hd], keys [B, G, D])."""
    b, s, _ = u.shape
    r = attn.ratio
    values, scores = attn.compressor.raw(u.reshape(b * s, -1))
    g = s // r
    v = values.view(b, s, -1)[:, : g * r].reshape(b * g, r, -1)
    sc = scores.view(b, s, -1)[:, : g * r].reshape(b * g, r, -1) if scores is not None else None
    pos = torch.arange(g, device=u.device).repeat(b) * r
    main, keys = attn.compressed_rows(attn.compressor.pool(v, sc), attn.rope.cos_sin(pos))
    keys = index_roundtrip(keys, index_dtype)
    return main.view(b, g, -1), keys.view(b, g, -1)


def _attention(attn, u, rows, index_dtype, aux):
    b, s, d = u.shape
    dev = u.device
    pos = torch.arange(s, device=dev)
    flat_pos = pos.repeat(b)
    cs = attn.rope.cos_sin(flat_pos)
    q, qlat = attn.queries(u.reshape(b * s, d), cs)
    win = attn.window_kv(u.reshape(b * s, d), cs).view(b, s, -1)
    q = q.view(b, s, attn.heads, -1)
    diff = pos[:, None] - pos[None, :]
    win_mask = (diff >= 0) & (diff < attn.window)
    logits = [torch.einsum("bshd,btd->bsht", q, win).float() * attn.scale]
    logits[0] = logits[0].masked_fill(~win_mask[None, :, None, :], NEG_INF)
    comp = None
    if attn.ratio > 0:
        if attn.mode is LayerMode.FULL:
            rows[attn.layer] = _rows(attn, u, index_dtype)
        main, keys = rows[attn.kv_owner]
        g = main.shape[1]
        visible = (pos + 1) // attn.ratio
        cmask = torch.arange(g, device=dev)[None, :] < visible[:, None]
        sc = torch.einsum("bshd,bgd->bshg", q, main).float() * attn.scale
        logits.append(sc.masked_fill(~cmask[None, :, None, :], NEG_INF))
        comp = main
    sink = attn.attn_sink.view(1, 1, -1, 1).expand(b, s, -1, 1)
    probs = torch.softmax(torch.cat(logits + [sink], dim=-1), dim=-1)
    nw = s
    out = torch.einsum("bsht,btd->bshd", probs[..., :nw].to(q.dtype), win)
    if comp is not None:
        pc = probs[..., nw:-1]
        out = out + torch.einsum("bshg,bgd->bshd", pc.to(q.dtype), comp)
        if attn.indexer is not None and g > 0:
            qi, w = attn.index_query(qlat, u.reshape(b * s, d), cs)
            qi, w = qi.view(b, s, *qi.shape[1:]), w.view(b, s, -1)
            dots = torch.relu(torch.einsum("bshd,bgd->bshg", qi, keys.float()))
            ix = torch.einsum("bsh,bshg->bsg", w, dots)  # Indexer.scores, batched
            target = pc.detach().sum(2)  # heads summed: [B, S, G]
            has = cmask.any(-1)
            target = target / target.sum(-1, keepdim=True).clamp(min=1e-9)
            logp = F.log_softmax(ix.masked_fill(~cmask[None], NEG_INF), dim=-1)
            kl = (target * (target.clamp(min=1e-9).log() - logp)).masked_fill(~cmask[None], 0)
            aux.append(kl.sum(-1)[:, has].mean())
    return attn.output(out.reshape(b * s, attn.heads, -1), cs).view(b, s, d)


def dense_forward(
    model: DeepseekV41ForCausalLM, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, S] -> (logits [B, S, V] float32, indexer KL loss (scalar))."""
    b, s = ids.shape
    dev = ids.device
    hist = torch.full((b, 3), -1, dtype=torch.int64, device=dev)
    grams = torch.cat([hist, ids], dim=1).unfold(1, 4, 1).reshape(b * s, 4)
    engram_rows = model.engram_rows(grams)
    x = model._embed(ids.reshape(-1))
    pre = identity_pre(x)
    rows: dict = {}
    aux: list[torch.Tensor] = []
    for layer in model.model.layers:
        attn = layer.self_attn

        def attend(u, a=attn):
            return _attention(a, u.view(b, s, -1), rows, model.index_dtype, aux).reshape(b * s, -1)

        x, pre = layer.block(x, pre, engram_rows, attend)
    logits = model._head(x, pre).view(b, s, -1)
    kl = torch.stack(aux).mean() if aux else logits.new_zeros(())
    return logits, kl
