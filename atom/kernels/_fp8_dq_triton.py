"""The FP8 linear with both operands dequantized in registers (``METHOD="dq"`` of
``fp8_linear_triton``; imported only where Triton is).

Per loop iteration a program loads KT values along K (several of the weight's K blocks): the
input tile [BM, KT] is rounded per block of BK exactly as ``fp8_act_quant`` rounds it and
multiplied back by its UE8M0 scale, the E4M3 weight tile [BN, KT] is multiplied by its blocks'
scales, and both go to bf16, which holds each such value exactly (an E4M3 value times a power of
two). One bf16 tensor-core dot over KT then adds their exact products into a float32
accumulator. So the kernel reads the weight as FP8 (half the bytes of bf16) in long contiguous
rows whatever the block (32-wide blocks included), needs no per-block promotion, and sums in
float32 as the torch expression does: no FP8 MMA, whose sums keep fewer bits on Hopper. With
``SPLIT`` > 1 the K tiles are split over programs and their float32 partials added in a fixed
order by the caller, as in ``_fp8_linear_kernel``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels import interpreting
from atom.kernels._fp8_common_triton import _split_range, _ue8m0, reduce_splits, split_buffer


@triton.jit
def _fp8_dq_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    o_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    BO: tl.constexpr,
    BK: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    KT: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT: tl.constexpr,
):
    NB: tl.constexpr = KT // BK
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    offs_n = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    offs_k = tl.arange(0, KT)
    m_ok = offs_m < M
    n_ok = offs_n < N
    kt0, kt1 = _split_range(K // KT, split, SPLIT)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + kt0 * KT + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * K + kt0 * KT + offs_k[None, :]  # [BN, KT], K contiguous
    s_ptrs = s_ptr + (offs_n // BO)[:, None] * (K // BK) + kt0 * NB + tl.arange(0, NB)[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for _ in range(kt0, kt1):
        a = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0).to(tl.float32)
        a3 = tl.reshape(a, [BM, NB, BK])
        sx, inv = _ue8m0(tl.max(tl.abs(a3), axis=2))
        q = tl.clamp(a3 * inv[:, :, None], -448.0, 448.0).to(tl.float8e4nv).to(tl.float32)
        xs = tl.reshape(q * sx[:, :, None], [BM, KT]).to(DOT)
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0).to(tl.float32)
        sw = tl.load(s_ptrs, mask=n_ok[:, None], other=0.0)
        wd = tl.reshape(tl.reshape(w, [BN, NB, BK]) * sw[:, :, None], [BN, KT]).to(DOT)
        acc += tl.dot(xs, tl.trans(wd))
        x_ptrs += KT
        w_ptrs += KT
        s_ptrs += NB
    o_ptrs = o_ptr + split * M * stride_om + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def k_tile(k: int, bk: int, want: int) -> int:
    """The largest K tile <= ``want`` (at least one block) that is a multiple of ``bk`` and
    divides K: every tile then holds whole blocks and the loop has no tail."""
    best = bk
    for kt in range(bk, max(want, bk) + 1, bk):
        if k % kt == 0 and (kt & (kt - 1)) == 0:
            best = kt
    return best


def fp8_dq_linear(x, weight, scale, block, dtype, cfg: dict) -> torch.Tensor:
    """x [M, K] (unit column stride) times the E4M3 weight [N, K] with float32 scales
    [ceil(N/bo), K/bk] -> [M, N] in ``dtype``; ``cfg``: BM, BN, KT (wanted), SPLIT and the
    launch options (num_warps, num_stages)."""
    m, k = x.shape
    n = weight.shape[0]
    bo, bk = block
    cfg = dict(cfg)
    bm, bn = cfg.pop("BM"), cfg.pop("BN")
    kt = k_tile(k, bk, cfg.pop("KT", 256))
    split = max(1, min(cfg.pop("SPLIT", 1), k // kt))
    cfg.pop("GROUP", None)
    cfg.pop("QUANT_IN_KERNEL", None)
    out = split_buffer(split, m, n, dtype, x.device)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    _fp8_dq_kernel[grid](
        x,
        weight,
        scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        n,
        BO=bo,
        BK=bk,
        BM=bm,
        BN=bn,
        KT=kt,
        SPLIT=split,
        DOT=tl.float32 if interpreting() else tl.bfloat16,
        **cfg,
    )
    return reduce_splits(out, split, dtype)
