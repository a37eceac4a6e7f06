"""A V4 decode step's compressor update in one kernel: the token's raw projections into the
sequence's partial group, the group pooled as it stands, the overlap fields refreshed where the
group completes.

Per compressor and decode step the torch expression (``compressor_pool_torch``) writes the
token's (kv, score) into its partial row, gathers the group's r rows, reads the predecessor's
halves from the overlap fields (zeros / -inf for group 0), selects what the completing rows
write back, concatenates, and pools with a softmax over the group's entries: about seventeen
kernels, two or three compressors a layer. The kernel does it in one launch, one program per
(sequence, block of columns): the partial rows it reads are its own sequence's, and its own
token's row comes from registers. The pooled values equal the torch expression's to float32
rounding (the softmax's sums add in the kernel's order); the rows and fields it writes are the
same bytes. Off in the batch-invariant mode, where a decode-pooled group must equal a
prefill-pooled one bit for bit (both take the torch expression there).
"""

from __future__ import annotations

import torch

from atom.kernels import invariant, use_triton


def compressor_pool_torch(
    kv_raw: torch.Tensor,
    score_raw: torch.Tensor,
    partial: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    phase: torch.Tensor,
    members: torch.Tensor,
    overlap: tuple[torch.Tensor, torch.Tensor] | None = None,
    prev_entry: torch.Tensor | None = None,
    own_entry: torch.Tensor | None = None,
    first: torch.Tensor | None = None,
    closes: torch.Tensor | None = None,
    ape: torch.Tensor | None = None,
    ape_row: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per sequence (B rows; distinct slots). kv_raw, score_raw float32 [B, W] (the
    token's projections; with ``ape`` [ratio, W] float32 its row ``ape_row`` [B] is added to
    the score first); ``partial`` (kv, score) [slots, rows, W];
    ``phase`` [B] the token's partial row, ``members`` [B, r] its group's. Without ``overlap``
    W = d and the pool is over the r members. With it W = 2d: ``overlap`` (kv, score)
    [slots, entries, r, d]; the pool is over the predecessor's first halves (entry
    ``prev_entry``; zeros / -inf where ``first``) and the members' second halves; where
    ``closes``, the members' first halves go to entry ``own_entry``. Writes ``partial`` (and
    ``overlap``); returns pooled float32 [B, d]."""
    if ape is not None:
        score_raw = score_raw + ape[ape_row]
    partial[0][slots, phase] = kv_raw
    partial[1][slots, phase] = score_raw
    kvg, scg = partial[0][slots[:, None], members], partial[1][slots[:, None], members]
    if overlap is not None:
        d = kvg.shape[-1] // 2
        held, into = (slots, prev_entry), (slots, own_entry)
        f = first[:, None, None]
        prev = (overlap[0][held].masked_fill_(f, 0.0), overlap[1][held].masked_fill_(f, -torch.inf))
        c = closes[:, None, None]
        overlap[0][into] = torch.where(c, kvg[:, :, :d], overlap[0][into])
        overlap[1][into] = torch.where(c, scg[:, :, :d], overlap[1][into])
        kvg = torch.cat([prev[0], kvg[..., d:]], dim=1)
        scg = torch.cat([prev[1], scg[..., d:]], dim=1)
    return invariant.sum(kvg * invariant.softmax(scg, dim=1), 1)


def compressor_pool(
    kv_raw: torch.Tensor,
    score_raw: torch.Tensor,
    partial: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    phase: torch.Tensor,
    members: torch.Tensor,
    overlap: tuple[torch.Tensor, torch.Tensor] | None = None,
    prev_entry: torch.Tensor | None = None,
    own_entry: torch.Tensor | None = None,
    first: torch.Tensor | None = None,
    closes: torch.Tensor | None = None,
    ape: torch.Tensor | None = None,
    ape_row: torch.Tensor | None = None,
) -> torch.Tensor:
    """``compressor_pool_torch`` as one Triton kernel where it can run (kernel
    ``compressor_pool``; not in the batch-invariant mode; not under autograd; float32 planes
    with unit column stride, both planes of a pair alike)."""
    args = (kv_raw, score_raw, partial, slots, phase, members)
    rest = (overlap, prev_entry, own_entry, first, closes, ape, ape_row)
    planes = list(partial) + (list(overlap) if overlap is not None else [])
    planes += [ape] if ape is not None else []
    usable = (
        kv_raw.shape[0] > 0
        and not (torch.is_grad_enabled() and (kv_raw.requires_grad or score_raw.requires_grad))
        and all(p.dtype == torch.float32 and p.stride(-1) == 1 for p in planes)
        and partial[0].stride() == partial[1].stride()
        and (overlap is None or overlap[0].stride() == overlap[1].stride())
        and use_triton(kv_raw, "compressor_pool")
    )
    if not usable:
        return compressor_pool_torch(*args, *rest)
    from atom.kernels._compressor_pool_triton import compressor_pool_triton

    return compressor_pool_triton(*args, *rest)
