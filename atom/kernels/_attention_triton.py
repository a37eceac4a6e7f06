"""The Triton kernel behind ``atom.kernels.attention`` (imported only where Triton is)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels.ring_window import RingWindow


@triton.jit
def _visible_span(ok_ptr, n, BN: tl.constexpr):
    """[first, last + 1) of the true flags among ``n`` bytes at ``ok_ptr``, the first rounded
    down to a multiple of BN; (0, 0) where none is."""
    lo = n
    hi = 0
    for n0 in range(0, n, BN):
        i = n0 + tl.arange(0, BN)
        ok = (tl.load(ok_ptr + i, mask=i < n, other=0) != 0) & (i < n)
        lo = tl.minimum(lo, tl.min(tl.where(ok, i, n), 0))
        hi = tl.maximum(hi, tl.max(tl.where(ok, i + 1, 0), 0))
    lo = tl.minimum(lo, hi)
    return lo - lo % BN, hi


@triton.jit
def _online(q, k, v, ok, m, lsum, acc, scale, IEEE: tl.constexpr):
    """One tile of keys into the running max, denominator and sum (``v``: the values, here
    the keys: MQA)."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        # rounded to the inputs' dtype before scaling, as the torch expression's product is:
        # with large scores a softmax over unrounded ones moves far from it (and from the
        # reference forward, which shares that expression)
        s = tl.dot(q, tl.trans(k)).to(q.dtype).to(tl.float32)
    s = tl.where(ok[None, :], s * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    lsum = lsum * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, lsum, acc * alpha[:, None] + pv


# L and K vary with the batch: specializing on them would recompile mid-serving
@triton.jit(do_not_specialize=["L", "K", "Q"])
def _sink_attention_kernel(
    q_ptr,
    sq_t,
    sq_h,
    w_ptr,
    sw_tile,
    sw_l,
    wm_ptr,
    swm_t,
    c_ptr,
    co_ptr,
    sco_t,
    cv_ptr,
    scv_t,
    sink_ptr,
    o_ptr,
    so_t,
    so_h,
    L,
    K,
    H,
    Q,
    scale,
    D: tl.constexpr,
    DV: tl.constexpr,
    BH: tl.constexpr,
    BN: tl.constexpr,
    HAS_COMP: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Row t, heads [BH * p1, ...), output features [DV * p2, ...): every program computes its
    heads' scores over all D features and sums the values' DV features it owns (DV < D: a
    decode batch's few rows spread over more programs; each output feature's products are
    those of DV = D)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    d = tl.arange(0, D)
    dv = tl.program_id(2) * DV + tl.arange(0, DV)
    hmask = h < H
    q = tl.load(q_ptr + t * sq_t + h[:, None] * sq_h + d[None, :], mask=hmask[:, None], other=0.0)
    # the sink starts the running max and adds exp(sink - max) to the denominator
    m = tl.load(sink_ptr + h, mask=hmask, other=0.0).to(tl.float32)
    lsum = tl.full([BH], 1.0, tl.float32)
    acc = tl.zeros([BH, DV], tl.float32)
    tile = t // Q
    # keys outside [first, last] of a row's visible ones are not visited (a prefill tile's
    # window keys span the whole tile, each query sees ~window of them; early positions select
    # few rows); inside, tiles are masked, not skipped: a branch per tile would stop Triton from
    # loading the next tile while this one computes
    lo, hi = _visible_span(wm_ptr + t * swm_t, L, BN)
    for n0 in tl.range(lo, hi, BN):
        n = n0 + tl.arange(0, BN)
        ok = (tl.load(wm_ptr + t * swm_t + n, mask=n < L, other=0) != 0) & (n < L)
        kp = w_ptr + tile * sw_tile + n[:, None] * sw_l
        k = tl.load(kp + d[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
        if DV < D:
            v = tl.load(kp + dv[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
        else:
            v = k
        m, lsum, acc = _online(q, k, v, ok, m, lsum, acc, scale, IEEE)
    if HAS_COMP:
        lo, hi = _visible_span(cv_ptr + t * scv_t, K, BN)
        for n0 in tl.range(lo, hi, BN):
            n = n0 + tl.arange(0, BN)
            ok = (tl.load(cv_ptr + t * scv_t + n, mask=n < K, other=0) != 0) & (n < K)
            off = tl.load(co_ptr + t * sco_t + n, mask=ok, other=0)
            k = tl.load(c_ptr + off[:, None] + d[None, :], mask=ok[:, None], other=0.0)
            k = k.to(q.dtype)
            if DV < D:
                v = tl.load(c_ptr + off[:, None] + dv[None, :], mask=ok[:, None], other=0.0)
                v = v.to(q.dtype)
            else:
                v = k
            m, lsum, acc = _online(q, k, v, ok, m, lsum, acc, scale, IEEE)
    out = acc / lsum[:, None]
    tl.store(
        o_ptr + t * so_t + h[:, None] * so_h + dv[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=hmask[:, None],
    )


# a decode-sized call in the batch-invariant mode: rows below this split their output features
INVARIANT_FEW_ROWS = 256
INVARIANT_DV = 128  # output features per program there


def sink_attention_config(t: int, h: int, wide: bool, d: int | None = None) -> dict:
    """Launch parameters for t query rows of h heads of d features (``wide``: float32). In the
    batch-invariant mode the rows' count chooses nothing of a row's order of additions: the
    tiles (heads and keys per program) are those of a prefill whatever t is; a decode-sized
    call only spreads each row's output features over ``d // INVARIANT_DV`` programs (DV),
    which computes each feature's products as DV = d does."""
    from atom.kernels import invariant_mode

    # heads per program: all 64 where there are enough rows to fill the GPU (a prefill: each
    # query's selected rows are read once, not once per 16 heads), 16 for a decode batch;
    # float32 tiles: half the keys per tile, one stage (shared memory)
    mode = invariant_mode.enabled()
    many = t >= 256 or mode
    bh = 64 if many and h >= 64 and not wide else 16
    dv = d
    if mode and d is not None and t < INVARIANT_FEW_ROWS and d > INVARIANT_DV:
        dv = INVARIANT_DV
    # benchmarks/kernel_sweep.py: 64 keys a tile with 64 heads (3.91 ms against 4.26 at 32 on
    # a 4096-token chunk's shapes on the H200)
    cfg = dict(
        BH=bh,
        BN=16 if wide else 64 if bh == 64 else 32,
        num_warps=8 if bh == 64 else 4,
        num_stages=1 if wide else 2,
    )
    return cfg if dv is None else cfg | {"DV": dv}


def _operand_args(q, win_k, win_mask, plane, offsets, valid) -> list:
    """The attention kernels' first arguments, the same for both: each tensor as the kernels
    read it (unit stride on features, the mask [T, L] contiguous, bool flags as bytes) and
    its strides; without compressed rows the mask stands in for the unused plane, offsets and
    flags."""
    q = q if q.stride(2) == 1 else q.contiguous()
    win_k = win_k if win_k.stride(2) == 1 else win_k.contiguous()
    win_mask = win_mask.reshape(q.shape[0], -1).contiguous()
    if plane is None:
        plane = offsets = valid = win_mask
    else:
        offsets, valid = offsets.contiguous(), valid.contiguous()
    as_bytes = lambda x: x.view(torch.uint8) if x.dtype == torch.bool else x  # noqa: E731
    win_mask, valid = as_bytes(win_mask), as_bytes(valid)
    return [
        *(q, q.stride(0), q.stride(1)),
        *(win_k, win_k.stride(0), win_k.stride(1)),
        *(win_mask, win_mask.stride(0)),
        *(plane, offsets, offsets.stride(0)),
        *(valid, valid.stride(0)),
    ]


def sink_attention_triton(q, win_k, win_mask, plane, offsets, valid, sink, scale, config=None):
    """``config``: launch parameters over ``sink_attention_config``'s (benchmarks sweep them)."""
    t, h, d = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # features at unit stride
    if t == 0:
        return out
    has_comp = plane is not None
    cfg = sink_attention_config(t, h, q.element_size() > 2, d) | (config or {})
    _sink_attention_kernel[(t, triton.cdiv(h, cfg["BH"]), d // cfg["DV"])](
        *_operand_args(q, win_k, win_mask, plane, offsets, valid),
        sink,
        out,
        out.stride(0),
        out.stride(1),
        win_k.shape[1],
        offsets.shape[1] if has_comp else 0,
        h,
        t // win_k.shape[0],
        scale,
        D=d,
        HAS_COMP=has_comp,
        IEEE=q.dtype == torch.float32,
        **cfg,
    )
    return out


@triton.jit(do_not_specialize=["L", "K", "CHUNK"])
def _sink_attention_split_kernel(
    q_ptr,
    sq_t,
    sq_h,
    w_ptr,
    sw_t,
    sw_l,
    wm_ptr,
    swm_t,
    c_ptr,
    co_ptr,
    sco_t,
    cv_ptr,
    scv_t,
    wo_ptr,
    swo_t,
    own_ptr,
    sown_t,
    pm_ptr,
    pl_ptr,
    pa_ptr,
    L,
    K,
    H,
    CHUNK,
    scale,
    D: tl.constexpr,
    S: tl.constexpr,
    BH: tl.constexpr,
    BN: tl.constexpr,
    HAS_COMP: tl.constexpr,
    RING: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Keys [j * CHUNK, (j + 1) * CHUNK) of the row's window keys followed by its compressed
    rows, for split j: the running max, denominator and unnormalized sum, without the sink
    (``_combine_kernel`` adds it once). With ``RING`` the window's first L - 1 keys are read
    at element offsets ``wo`` [T, L - 1] from ``w_ptr`` (a ring plane) and its last is the
    row's ``own`` [T, D] (``RingWindow``); else they are ``w`` [T, L, D]."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    j = tl.program_id(2)
    d = tl.arange(0, D)
    hmask = h < H
    q = tl.load(q_ptr + t * sq_t + h[:, None] * sq_h + d[None, :], mask=hmask[:, None], other=0.0)
    m = tl.full([BH], -1.0e30, tl.float32)  # finite: a split without a visible key adds 0
    lsum = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, D], tl.float32)
    a = j * CHUNK
    if RING:
        own = tl.load(own_ptr + t * sown_t + d).to(q.dtype)
    for n0 in tl.range(tl.minimum(a, L), tl.minimum(a + CHUNK, L), BN):
        n = n0 + tl.arange(0, BN)
        inside = (n < L) & (n < a + CHUNK)
        ok = (tl.load(wm_ptr + t * swm_t + n, mask=inside, other=0) != 0) & inside
        if RING:
            ring = ok & (n < L - 1)
            off = tl.load(wo_ptr + t * swo_t + n, mask=ring, other=0)
            k = tl.load(w_ptr + off[:, None] + d[None, :], mask=ring[:, None], other=0.0)
            k = tl.where((n == L - 1)[:, None], own[None, :], k.to(q.dtype))
        else:
            k = tl.load(
                w_ptr + t * sw_t + n[:, None] * sw_l + d[None, :], mask=ok[:, None], other=0.0
            )
            k = k.to(q.dtype)
        m, lsum, acc = _online(q, k, k, ok, m, lsum, acc, scale, IEEE)
    if HAS_COMP:
        b0 = tl.maximum(a - L, 0)
        for n0 in tl.range(tl.minimum(b0, K), tl.minimum(a + CHUNK - L, K), BN):
            n = n0 + tl.arange(0, BN)
            inside = (n < K) & (n < a + CHUNK - L)
            ok = (tl.load(cv_ptr + t * scv_t + n, mask=inside, other=0) != 0) & inside
            off = tl.load(co_ptr + t * sco_t + n, mask=ok, other=0)
            k = tl.load(c_ptr + off[:, None] + d[None, :], mask=ok[:, None], other=0.0)
            k = k.to(q.dtype)
            m, lsum, acc = _online(q, k, k, ok, m, lsum, acc, scale, IEEE)
    part = (t * S + j) * H + h
    tl.store(pm_ptr + part, m, mask=hmask)
    tl.store(pl_ptr + part, lsum, mask=hmask)
    tl.store(pa_ptr + part[:, None] * D + d[None, :], acc, mask=hmask[:, None])


@triton.jit
def _combine_kernel(
    pm_ptr, pl_ptr, pa_ptr, sink_ptr, o_ptr, so_t, so_h, H, D: tl.constexpr, S: tl.constexpr
):
    """Row t, head h: the splits' sums rescaled to their common max, the sink in the
    denominator once."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    js = tl.arange(0, S)
    part = (t * S + js) * H + h
    m = tl.load(pm_ptr + part)
    sink = tl.load(sink_ptr + h).to(tl.float32)
    top = tl.maximum(tl.max(m, 0), sink)
    f = tl.exp(m - top)
    den = tl.sum(tl.load(pl_ptr + part) * f, 0) + tl.exp(sink - top)
    d = tl.arange(0, D)
    acc = tl.load(pa_ptr + part[:, None] * D + d[None, :])
    out = tl.sum(acc * f[:, None], 0) / den
    tl.store(o_ptr + t * so_t + h * so_h + d, out.to(o_ptr.dtype.element_ty))


def sink_attention_split_triton(q, win_k, win_mask, plane, offsets, valid, sink, scale, splits):
    """``sink_attention`` with each row's keys cut into ``splits`` chunks run by separate
    programs (a decode batch: few rows, each walking every key, leave the GPU idle otherwise),
    then one combine. Here every row has its own window keys (tiles = rows): ``win_k`` [T, L,
    D], or a ``RingWindow`` read where its keys lie."""
    t, h, d = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # features at unit stride
    if t == 0:
        return out
    has_comp = plane is not None
    ring = isinstance(win_k, RingWindow)
    # with a ring window the kernel reads the plane at offsets (its strides go unused)
    args = _operand_args(q, win_k.plane if ring else win_k, win_mask, plane, offsets, valid)
    if ring:
        own = win_k.own if win_k.own.stride(1) == 1 else win_k.own.contiguous()
        wo = win_k.offsets.contiguous()
        window = [wo, wo.stride(0), own, own.stride(0)]
        n_l = wo.shape[1] + 1
    else:
        window = [q, 0, q, 0]  # unused: q stands in
        n_l = win_k.shape[1]
    n_k = offsets.shape[1] if has_comp else 0
    wide = q.element_size() > 2
    bh, bn = 16, 16 if wide else 32
    chunk = triton.cdiv(triton.cdiv(n_l + n_k, splits), bn) * bn
    pm = torch.empty(t, splits, h, dtype=torch.float32, device=q.device)
    pl = torch.empty_like(pm)
    pa = torch.empty(t, splits, h, d, dtype=torch.float32, device=q.device)
    _sink_attention_split_kernel[(t, triton.cdiv(h, bh), splits)](
        *args,
        *window,
        pm,
        pl,
        pa,
        n_l,
        n_k,
        h,
        chunk,
        scale,
        D=d,
        S=splits,
        BH=bh,
        BN=bn,
        HAS_COMP=has_comp,
        RING=ring,
        IEEE=q.dtype == torch.float32,
        num_warps=4,
        num_stages=1 if wide else 2,
    )
    _combine_kernel[(t, h)](pm, pl, pa, sink, out, out.stride(0), out.stride(1), h, D=d, S=splits)
    return out
