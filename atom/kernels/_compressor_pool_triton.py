"""The Triton kernel behind ``atom.kernels.compressor_pool`` (imported only where Triton is)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _members(plane, base, mem, cols, ok, own, mine, other):
    """The group's rows of ``plane`` at columns ``cols`` [RP, BD], the token's own row (``own``)
    taken from ``mine`` (registers: the row this program has just written)."""
    got = tl.load(plane + base + mem[:, None] + cols[None, :], mask=ok, other=other)
    return tl.where(own[:, None], mine[None, :], got)


@triton.jit
def _compressor_pool_kernel(
    kv_ptr,
    sc_ptr,
    pk_ptr,
    ps_ptr,
    ok_ptr,
    os_ptr,
    slots_ptr,
    phase_ptr,
    members_ptr,
    prev_ptr,
    own_ptr,
    first_ptr,
    closes_ptr,
    ape_ptr,
    ape_row_ptr,
    out_ptr,
    D,
    kv_stride,
    sc_stride,
    p_s0,
    p_s1,
    o_s0,
    o_s1,
    o_s2,
    ape_stride,
    R: tl.constexpr,
    RP: tl.constexpr,
    BD: tl.constexpr,
    OVERLAP: tl.constexpr,
    APE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BD + tl.arange(0, BD)
    cm = c < D
    slot = tl.load(slots_ptr + b).to(tl.int64)
    ph = tl.load(phase_ptr + b).to(tl.int64)
    j = tl.arange(0, RP)
    jm = j < R
    mem = tl.load(members_ptr + b * R + j, mask=jm, other=0).to(tl.int64)
    own = (mem == ph) & jm
    ok = jm[:, None] & cm[None, :]
    base = slot * p_s0
    rows = mem * p_s1
    cur = c + D if OVERLAP else c  # the columns pooled from the members
    kv_own = tl.load(kv_ptr + b * kv_stride + cur, mask=cm, other=0.0)
    sc_own = tl.load(sc_ptr + b * sc_stride + cur, mask=cm, other=0.0)
    if APE:
        ape_at = ape_ptr + tl.load(ape_row_ptr + b).to(tl.int64) * ape_stride
        sc_own = sc_own + tl.load(ape_at + cur, mask=cm, other=0.0)
    tl.store(pk_ptr + base + ph * p_s1 + cur, kv_own, mask=cm)
    tl.store(ps_ptr + base + ph * p_s1 + cur, sc_own, mask=cm)
    kvc = _members(pk_ptr, base, rows, cur, ok, own, kv_own, 0.0)
    scc = _members(ps_ptr, base, rows, cur, ok, own, sc_own, float("-inf"))
    m = tl.max(scc, 0)
    if OVERLAP:
        kv_first = tl.load(kv_ptr + b * kv_stride + c, mask=cm, other=0.0)
        sc_first = tl.load(sc_ptr + b * sc_stride + c, mask=cm, other=0.0)
        if APE:
            sc_first = sc_first + tl.load(ape_at + c, mask=cm, other=0.0)
        tl.store(pk_ptr + base + ph * p_s1 + c, kv_first, mask=cm)
        tl.store(ps_ptr + base + ph * p_s1 + c, sc_first, mask=cm)
        first = tl.load(first_ptr + b) != 0
        held = slot * o_s0 + tl.load(prev_ptr + b).to(tl.int64) * o_s1 + j[:, None] * o_s2
        okv = tl.load(ok_ptr + held + c[None, :], mask=ok, other=0.0)
        osc = tl.load(os_ptr + held + c[None, :], mask=ok, other=float("-inf"))
        okv = tl.where(first, 0.0, okv)
        osc = tl.where(first, float("-inf"), osc)
        if tl.load(closes_ptr + b) != 0:  # the group completes: its first halves are kept
            into = slot * o_s0 + tl.load(own_ptr + b).to(tl.int64) * o_s1 + j[:, None] * o_s2
            kvh = _members(pk_ptr, base, rows, c, ok, own, kv_first, 0.0)
            sch = _members(ps_ptr, base, rows, c, ok, own, sc_first, 0.0)
            tl.store(ok_ptr + into + c[None, :], kvh, mask=ok)
            tl.store(os_ptr + into + c[None, :], sch, mask=ok)
        m = tl.maximum(m, tl.max(osc, 0))
        eo = tl.exp(osc - m[None, :])
        ec = tl.exp(scc - m[None, :])
        s = tl.sum(eo, 0) + tl.sum(ec, 0)
        pooled = tl.sum(okv * (eo / s[None, :]), 0) + tl.sum(kvc * (ec / s[None, :]), 0)
    else:
        ec = tl.exp(scc - m[None, :])
        s = tl.sum(ec, 0)
        pooled = tl.sum(kvc * (ec / s[None, :]), 0)
    tl.store(out_ptr + b * D + c, pooled, mask=cm)


def compressor_pool_triton(
    kv_raw,
    score_raw,
    partial,
    slots,
    phase,
    members,
    overlap,
    prev_entry,
    own_entry,
    first,
    closes,
    ape=None,
    ape_row=None,
) -> torch.Tensor:
    """``compressor_pool_torch`` in one kernel (``compressor_pool``'s conditions hold)."""
    b, w = kv_raw.shape
    r = members.shape[1]
    d = w // 2 if overlap is not None else w
    kv_raw = kv_raw if kv_raw.stride(1) == 1 else kv_raw.contiguous()
    score_raw = score_raw if score_raw.stride(1) == 1 else score_raw.contiguous()
    members = members.contiguous()
    out = torch.empty(b, d, dtype=torch.float32, device=kv_raw.device)
    pk, ps = partial
    ok, os_ = overlap if overlap is not None else (pk, ps)
    o_strides = ok.stride()[:3] if overlap is not None else (0, 0, 0)
    flags = (first, closes, prev_entry, own_entry) if overlap is not None else (slots,) * 4
    bd = min(128, triton.next_power_of_2(d))
    _compressor_pool_kernel[(b, triton.cdiv(d, bd))](
        kv_raw,
        score_raw,
        pk,
        ps,
        ok,
        os_,
        slots,
        phase,
        members,
        flags[2],
        flags[3],
        flags[0],
        flags[1],
        ape if ape is not None else kv_raw,
        ape_row if ape_row is not None else slots,
        out,
        d,
        kv_raw.stride(0),
        score_raw.stride(0),
        pk.stride(0),
        pk.stride(1),
        *o_strides,
        ape.stride(0) if ape is not None else 0,
        R=r,
        RP=triton.next_power_of_2(r),
        BD=bd,
        OVERLAP=overlap is not None,
        APE=ape is not None,
    )
    return out
