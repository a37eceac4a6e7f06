"""The Triton kernels behind ``atom.kernels.fp8_gemm`` (imported only where Triton is).

``_fp8_linear_kernel`` computes a [BM, BN] output tile per program. Per K block of BK (= the
weight's block along K, = the activation's quantization block) it takes the input tile as
E4M3 with one UE8M0 scale per row: either quantized in registers from the stored input
(``QUANT_IN_KERNEL``: each row's amax floored at 1e-4, times float32(1/448), the exponent bits
bumped when the mantissa is not zero, exactly as ``fp8_act_quant``), or read from a buffer
``_fp8_act_quant_kernel`` wrote before. It adds dot(q_x, q_w) * s_x * s_w to a float32
accumulator: the tensor cores' FP8 products are exact and their sums within one K block keep
about 14 bits (DeepSeek-V3's report), promoted to float32 per block. With ``SPLIT`` > 1 the K
blocks are split into that many contiguous ranges, each program writes its float32 partial
sum, and the partials are added in split order (no atomics: the same bits every run).

The launch configuration depends only on M's size class and the block, never on the values,
so a row's result does not depend on the other rows of its class.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# float32(1/448), rounded from the double by the compiler as torch rounds it
_INV_FP8_MAX = tl.constexpr(1.0 / 448.0)


@triton.jit
def _ue8m0(amax):
    """(scale, 1 / scale) of ``ue8m0_scale(amax, 448)``, both exact powers of two."""
    bits = (tl.maximum(amax, 1e-4) * _INV_FP8_MAX).to(tl.int32, bitcast=True)
    expo = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (expo << 23).to(tl.float32, bitcast=True), ((254 - expo) << 23).to(
        tl.float32, bitcast=True
    )


@triton.jit
def _fp8_act_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, BK: tl.constexpr):
    """One (row, K block) per program: q = E4M3(x / s), s = ue8m0(amax) -> s_ptr[row, kb]."""
    row = tl.program_id(0).to(tl.int64)
    kb = tl.program_id(1)
    offs = kb * BK + tl.arange(0, BK)
    a = tl.load(x_ptr + row * stride_xm + offs).to(tl.float32)
    sx, inv = _ue8m0(tl.max(tl.abs(a), axis=0))
    q = tl.clamp(a * inv, -448.0, 448.0).to(tl.float8e4nv)
    tl.store(q_ptr + row * K + offs, q)
    tl.store(s_ptr + row * (K // BK) + kb, sx)


@triton.jit
def _fp8_linear_kernel(
    x_ptr,
    xs_ptr,
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
    SPLIT: tl.constexpr,
    QUANT_IN_KERNEL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    offs_n = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    offs_k = tl.arange(0, BK)
    m_ok = offs_m < M
    n_ok = offs_n < N
    n_kb = K // BK
    per = tl.cdiv(n_kb, SPLIT)
    kb0 = split * per
    kb1 = tl.minimum(kb0 + per, n_kb)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + kb0 * BK + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :] * K + kb0 * BK + offs_k[:, None]  # [BK, BN]
    s_ptrs = s_ptr + (offs_n // BO) * n_kb
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kb in range(kb0, kb1):
        if QUANT_IN_KERNEL:
            a = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0).to(tl.float32)
            sx, inv = _ue8m0(tl.max(tl.abs(a), axis=1))
            q = tl.clamp(a * inv[:, None], -448.0, 448.0).to(tl.float8e4nv)
        else:
            q = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            sx = tl.load(xs_ptr + offs_m * n_kb + kb, mask=m_ok, other=0.0)
        b = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        sw = tl.load(s_ptrs + kb, mask=n_ok, other=0.0)
        acc += tl.dot(q, b) * (sx[:, None] * sw[None, :])
        x_ptrs += BK
        w_ptrs += BK
    o_ptrs = o_ptr + split * M * stride_om + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def tile_config(m: int, bk: int) -> dict:
    """The launch configuration for M rows: a function of M's size class and the K block only
    (measured on the H200: benchmarks/results/fp8_gemm_h200.md)."""
    if m <= 16:
        return dict(BM=16, BN=64, num_warps=4, num_stages=4, SPLIT=1, QUANT_IN_KERNEL=True)
    if m <= 64:
        return dict(BM=16, BN=64, num_warps=4, num_stages=4, SPLIT=1, QUANT_IN_KERNEL=True)
    return dict(BM=128, BN=128, num_warps=8, num_stages=3, SPLIT=1, QUANT_IN_KERNEL=True)


def fp8_act_quant_triton(x: torch.Tensor, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit column stride) -> (E4M3 [M, K], float32 scales [M, K/bk]), equal to
    ``fp8_act_quant`` bit for bit."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, k // bk, dtype=torch.float32, device=x.device)
    if m:
        _fp8_act_quant_kernel[(m, k // bk)](x, q, s, k, x.stride(0), BK=bk)
    return q, s


def fp8_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """x [M, K] (row stride free, unit column stride), weight e4m3 [N, K] contiguous, scale
    float32 [ceil(N/bo), K/bk] -> [M, N] in ``out_dtype`` (x's dtype by default)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    dtype = out_dtype or x.dtype
    cfg = {**tile_config(m, block[1]), **(config or {})}
    bm, bn, split, in_kernel = (
        cfg.pop("BM"),
        cfg.pop("BN"),
        cfg.pop("SPLIT"),
        cfg.pop("QUANT_IN_KERNEL"),
    )
    split = max(1, min(split, k // block[1]))
    if in_kernel:
        xq, xs, stride = x, scale, x.stride(0)  # xs unused
    else:
        xq, xs = fp8_act_quant_triton(x, block[1])
        stride = k
    out = torch.empty(
        (split, m, n) if split > 1 else (m, n),
        dtype=torch.float32 if split > 1 else dtype,
        device=x.device,
    )
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    _fp8_linear_kernel[grid](
        xq,
        xs,
        weight,
        scale,
        out,
        m,
        n,
        k,
        stride,
        n,
        BO=block[0],
        BK=block[1],
        BM=bm,
        BN=bn,
        SPLIT=split,
        QUANT_IN_KERNEL=in_kernel,
        **cfg,
    )
    if split > 1:
        total = out[0]
        for i in range(1, split):  # in split order: the same bits every run
            total = total + out[i]
        return total.to(dtype)
    return out
