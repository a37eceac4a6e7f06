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


def index_scores_config(per_tile: int) -> dict:
    """Launch parameters for tiles of ``per_tile`` queries. In the batch-invariant mode the
    tile's query block is 16 rows whatever the tile: a decode row (a tile of its own) and a
    query of a prefill tile then take each score's products over D in the same block shape."""
    from atom.kernels import invariant_mode

    if invariant_mode.enabled():
        return dict(BT=16, BR=64, num_warps=4, num_stages=2)
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
    cfg = index_scores_config(per) | (config or {})
    grid = (nt, triton.cdiv(per, cfg["BT"]), triton.cdiv(r, cfg["BR"]))
    _index_scores_kernel[grid](
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
