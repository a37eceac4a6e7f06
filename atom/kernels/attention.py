"""CSA2 attention of query rows over their window keys and their selected compressed rows, with
one learned sink per head in the softmax denominator, in one kernel.

The torch expression (``CSA2Attention.attend_tiles``) gathers every query's selected rows out
of PAGE into a [T, K, hd] tensor, materializes float32 scores [T, H, window + K + 1], softmaxes
them and multiplies again: for a prefill chunk of 4096 tokens that is ~2 GB gathered and a few
GB of scores per layer, and a third of the forward's device time. The kernel reads each
selected row where it lies in PAGE (by element offset), keeps a running max and denominator
(the sink starts them) and accumulates the output in float32: one pass, nothing materialized.

The paged prefill runs it (``paged_attention``). For a decode batch there is
``sink_attention_decode``: with its few rows, programs that each walk all of a row's keys left
the GPU idle (116 us a layer at batch 16 on the H200, against 54 us for torch), so each row's
keys are split across programs whose partial sums one more kernel combines (38-45 us for 16
rows at 4 or 8 splits, benchmarks/kernel_sweep.py). The paged decode runs it unless
``triton_off`` names ``decode_attention``.

Arithmetic: scores are rounded to the compute dtype before scaling, as torch's product is;
probabilities are cast to the compute dtype for the second product, but unnormalized (relative
to the running max), and the window and compressed parts are summed in float32 before one final
rounding (torch rounds each). So in bf16 the kernel and the torch expression (and the reference
forward, which uses it) differ by roundings, and a small random model amplifies them: on the
H200 the tiny test model's bf16 logits were 0.06-0.19 (relative) from their float32 truth either
way, the kernel's 0.133 on average against torch's 0.149 (tests/gpu/test_prefill_batch_cuda.py
compares both with that truth). On float32 inputs the products are IEEE float32 (no TF32) and
the paths agree to 1e-4.
"""

from __future__ import annotations

import torch

from atom.kernels import use_triton
from atom.kernels.ring_window import RingWindow, gather_offsets  # noqa: F401  (re-exported)


def sink_attention_usable(q: torch.Tensor, name: str = "sink_attention") -> bool:
    """Whether ``sink_attention`` runs the kernel for queries like ``q`` (CUDA, Triton, no
    gradient, a head dim the kernel tiles); ``name``: the switch (``ATOM_TRITON_OFF``) of the
    caller's use, "sink_attention" (prefill) or "decode_attention" (``sink_attention_decode``)."""
    if torch.is_grad_enabled() and q.requires_grad:
        return False
    d = q.shape[-1]
    # in the batch-invariant mode the one-pass kernel runs (its launch then fixed,
    # ``sink_attention_config``); the decode kernel splits a row's keys by the batch's longest
    # row, so it stays off there
    row_local = name == "sink_attention"
    return use_triton(q, name, row_local=row_local) and d >= 16 and d & (d - 1) == 0


def sink_attention_torch(q, win_k, win_mask, comp, valid, sink, scale):
    """The expression the kernel computes, float32 but for the scores (rounded to q's dtype
    before scaling): q [T, H, D]; win_k [tiles, L, D], query row t reads tile t // (T // tiles)
    with win_mask [T, L]; comp [T, K, D] or None with valid [T, K]; sink [H] float32 ->
    [T, H, D] in q's dtype."""
    t, h, _ = q.shape
    qf, rounded = q.float(), (lambda x: x.to(q.dtype).float())
    per = t // win_k.shape[0]
    keys = win_k.float().repeat_interleave(per, 0)
    s = rounded(torch.einsum("thd,tnd->thn", qf, keys)) * scale
    parts, vals = [s.masked_fill(~win_mask.reshape(t, 1, -1), float("-inf"))], [keys]
    if comp is not None:
        sc = rounded(torch.einsum("thd,tkd->thk", qf, comp.float())) * scale
        parts.append(sc.masked_fill(~valid[:, None, :], float("-inf")))
        vals.append(comp.float())
    parts.append(sink.float().view(1, h, 1).expand(t, h, 1))
    probs = torch.softmax(torch.cat(parts, -1), -1)[..., :-1]
    return torch.einsum("thn,tnd->thd", probs, torch.cat(vals, 1)).to(q.dtype)


def sink_attention(q, win_k, win_mask, plane, offsets, valid, sink, scale: float):
    """Attention of query rows q [T, H, D] over
      * window keys win_k [tiles, L, D]: row t reads tile t // (T // tiles), where
        win_mask [T, L] (or [tiles, T // tiles, L]) is true;
      * compressed rows of ``plane`` (a tensor whose rows of D are contiguous) at element
        offsets [T, K] int64 from plane's first element, where valid [T, K]; ``plane`` None:
        none;
    keys are values (MQA); sink [H] float32 joins each head's denominator. Returns [T, H, D] in
    q's dtype. Only where ``sink_attention_usable(q)``."""
    from atom.kernels._attention_triton import sink_attention_triton

    return sink_attention_triton(q, win_k, win_mask, plane, offsets, valid, sink, scale)


DECODE_SPLITS = 8


def sink_attention_decode(q, win_k, win_mask, plane, offsets, valid, sink, scale: float):
    """``sink_attention`` for rows that each have their own window keys (win_k [T, L, D] or a
    ``RingWindow``, a decode batch): every row's keys are cut into ``DECODE_SPLITS`` chunks run
    by separate programs and combined after, so a batch of a few rows still fills the GPU.
    Only where ``sink_attention_usable(q, "decode_attention")``."""
    from atom.kernels._attention_triton import sink_attention_split_triton

    return sink_attention_split_triton(
        q, win_k, win_mask, plane, offsets, valid, sink, scale, DECODE_SPLITS
    )
