"""The Triton kernel behind ``atom.kernels.index_scores`` (imported only where Triton is)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# R and Q vary with the batch: specializing on them would recompile mid-serving
@triton.jit(do_not_specialize=["R", "Q", "HI"])
def _index_scores_kernel(
    q_ptr,
    sq_t,
    sq_h,
    w_ptr,
    sw_t,
    k_ptr,
    sk_s,
    sk_r,
    tk_ptr,
    vis_ptr,
    o_ptr,
    so_t,
    R,
    Q,
    HI,
    D: tl.constexpr,
    BT: tl.constexpr,
    BR: tl.constexpr,
    PREC: tl.constexpr,
):
    tile = tl.program_id(0).to(tl.int64)
    sub = tl.program_id(1)
    rb = tl.program_id(2)
    i = sub * BT + tl.arange(0, BT)  # rows of the tile
    live = i < Q
    t = tile * Q + i
    r = rb * BR + tl.arange(0, BR)
    vis = tl.load(vis_ptr + t, mask=live, other=0)
    acc = tl.zeros([BT, BR], tl.float32)
    if rb * BR < tl.max(vis, 0):  # a block of rows no query here sees stays -inf
        d = tl.arange(0, D)
        seq = tl.load(tk_ptr + tile).to(tl.int64)
        k = tl.load(
            k_ptr + seq * sk_s + r[:, None] * sk_r + d[None, :], mask=(r < R)[:, None], other=0.0
        )
        for h in range(HI):
            q = tl.load(
                q_ptr + t[:, None] * sq_t + h * sq_h + d[None, :], mask=live[:, None], other=0.0
            )
            wh = tl.load(w_ptr + t * sw_t + h, mask=live, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)
            acc += wh[:, None] * tl.maximum(s, 0.0)
    acc = tl.where(r[None, :] < vis[:, None], acc, float("-inf"))
    tl.store(o_ptr + t[:, None] * so_t + r[None, :], acc, mask=live[:, None] & (r < R)[None, :])


# R and Q vary with the batch: specializing on them would recompile mid-serving
@triton.jit(do_not_specialize=["R", "Q", "HI"])
def _index_scores_by_query_kernel(
    q_ptr,
    sq_t,
    sq_h,
    w_ptr,
    sw_t,
    k_ptr,
    sk_s,
    sk_r,
    tk_ptr,
    vis_ptr,
    o_ptr,
    so_t,
    R,
    Q,
    HI,
    D: tl.constexpr,
    HB: tl.constexpr,
    BT: tl.constexpr,
    BR: tl.constexpr,
    PREC: tl.constexpr,
):
    """The batch-invariant mode's scores: one query at a time, its heads the rows of one
    product with a block of keys ([HB, D] x [D, BR]), the weighted ReLUs then summed over the
    heads by a second product ([16, HB] x [HB, BR], the head weights in row 0). Every query
    runs the same two products of the same shapes, whichever program and tile it is in, so a
    decode row and a prefill query get the same bits; and a program runs its heads in one
    product rather than a loop of HI (a decode step's scores were latency-bound on that loop).
    A program holds a block of BR keys and loops over BT queries of one tile."""
    tile = tl.program_id(0).to(tl.int64)
    sub = tl.program_id(1)
    rb = tl.program_id(2)
    r = rb * BR + tl.arange(0, BR)
    d = tl.arange(0, D)
    h = tl.arange(0, HB)
    pick = tl.arange(0, 16)
    seq = tl.load(tk_ptr + tile).to(tl.int64)
    k = tl.load(
        k_ptr + seq * sk_s + r[:, None] * sk_r + d[None, :], mask=(r < R)[:, None], other=0.0
    )
    kt = tl.trans(k)
    for j in range(BT):
        i = sub * BT + j
        if i < Q:
            t = tile * Q + i
            vis = tl.load(vis_ptr + t)
            row = tl.full([BR], float("-inf"), tl.float32)
            if rb * BR < vis:
                q = tl.load(
                    q_ptr + t * sq_t + h[:, None] * sq_h + d[None, :],
                    mask=(h < HI)[:, None],
                    other=0.0,
                )
                s = tl.dot(q, kt, input_precision=PREC)  # [HB, BR]
                wv = tl.load(w_ptr + t * sw_t + h, mask=h < HI, other=0.0)
                w16 = tl.where(pick[:, None] == 0, wv[None, :], 0.0)  # [16, HB]
                both = tl.dot(w16, tl.maximum(s, 0.0), input_precision=PREC)  # [16, BR]
                total = tl.sum(tl.where(pick[:, None] == 0, both, 0.0), 0)  # its row 0
                row = tl.where(r < vis, total, float("-inf"))
            tl.store(o_ptr + t * so_t + r, row, mask=r < R)


def index_scores_config(per_tile: int) -> dict:
    """Launch parameters for tiles of ``per_tile`` queries (the batch-invariant mode's kernel
    takes its queries one at a time, BT of them per program)."""
    from atom.kernels import invariant_mode

    if invariant_mode.enabled():
        return dict(BT=16, BR=64, num_warps=4, num_stages=1)
    bt = min(64, max(16, triton.next_power_of_2(per_tile)))
    return dict(BT=bt, BR=64, num_warps=4, num_stages=2)


def index_scores_triton(qi, w, keys, tile_keys, visible, precision, config=None):
    """``config``: launch parameters over ``index_scores_config``'s (benchmarks sweep them)."""
    p, hi, d = qi.shape
    r = keys.shape[1]
    out = torch.empty(p, r, dtype=torch.float32, device=qi.device)
    nt = tile_keys.shape[0]
    if p == 0 or r == 0:
        return out.fill_(float("-inf"))
    per = p // nt
    qi, w, keys = qi.contiguous(), w.contiguous(), keys.contiguous()
    from atom.kernels import invariant_mode

    by_query = invariant_mode.enabled()
    cfg = index_scores_config(per) | (config or {})
    grid = (nt, triton.cdiv(per, cfg["BT"]), triton.cdiv(r, cfg["BR"]))
    if by_query:
        cfg["HB"] = max(16, triton.next_power_of_2(hi))
    kernel = _index_scores_by_query_kernel if by_query else _index_scores_kernel
    kernel[grid](
        qi,
        qi.stride(0),
        qi.stride(1),
        w,
        w.stride(0),
        keys,
        keys.stride(0),
        keys.stride(1),
        tile_keys.contiguous(),
        visible.to(torch.int32).contiguous(),
        out,
        out.stride(0),
        r,
        per,
        hi,
        D=d,
        PREC=precision,
        **cfg,
    )
    return out
