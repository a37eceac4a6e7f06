"""The Triton kernels behind ``atom.kernels.fp8_gemm`` (imported only where Triton is).

``_fp8_linear_kernel`` computes a [BM, BN] output tile per program. Per K block of BK (= the
weight's block along K, = the activation's quantization block) it takes the input tile as
E4M3 with one UE8M0 scale per row: either quantized in registers from the stored input
(``QUANT_IN_KERNEL``: each row's amax floored at 1e-4, times float32(1/448), the exponent bits
bumped when the mantissa is not zero, exactly as ``fp8_act_quant``), or read from a buffer
``_fp8_act_quant_kernel`` wrote before. It adds dot(q_x, q_w) * s_x * s_w to a float32
accumulator: the tensor cores' FP8 products are exact and their sums within one K block keep
about 14 bits (DeepSeek-V3's report), promoted to float32 per block; ``GROUP`` K blocks are
loaded per loop iteration (more loads in flight, the same sums). With ``SPLIT`` > 1 the K
blocks are split into that many contiguous ranges, each program writes its float32 partial
sum, and one reduction adds them (no atomics: the same bits every run). Above ``DEQUANT_M``
rows ``_fp8_act_quant_kernel`` (``SIM``) and ``_fp8_dequant_kernel`` write both operands out
exactly in the compute dtype for one cuBLAS GEMM; ``METHOD="dq"`` is the kernel of
``_fp8_dq_triton`` (both operands dequantized in registers, bf16 dots). ``tile_config`` says
which path runs.

The launch configuration depends only on M's size class and the weight's shape, never on the
values, so a row's result does not depend on the other rows of its class.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from atom.kernels._fp8_common_triton import _split_range, _ue8m0, reduce_splits, split_buffer
from atom.kernels._fp8_dq_triton import fp8_dq_linear

# K blocks per program of the activation kernels (one row each)
_NB = 16


@triton.jit
def _fp8_act_quant_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_xm, BK: tl.constexpr, NB: tl.constexpr, SIM: tl.constexpr
):
    """One row's NB K blocks per program: q = E4M3(x / s), s = ue8m0(amax) per block, written
    as (q, s), or as q * s in q's dtype with ``SIM`` (exact)."""
    row = tl.program_id(0).to(tl.int64)
    kb = tl.program_id(1) * NB + tl.arange(0, NB)
    ok = kb < K // BK
    offs = kb[:, None] * BK + tl.arange(0, BK)[None, :]
    a = tl.load(x_ptr + row * stride_xm + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    sx, inv = _ue8m0(tl.max(tl.abs(a), axis=1))
    q = tl.clamp(a * inv[:, None], -448.0, 448.0).to(tl.float8e4nv)
    if SIM:
        out = (q.to(tl.float32) * sx[:, None]).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + row * K + offs, out, mask=ok[:, None])
    else:
        tl.store(q_ptr + row * K + offs, q, mask=ok[:, None])
        tl.store(s_ptr + row * (K // BK) + kb, sx, mask=ok)


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
    GROUP: tl.constexpr,
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
    kb0, kb1 = _split_range(n_kb, split, SPLIT)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + kb0 * BK + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :] * K + kb0 * BK + offs_k[:, None]  # [BK, BN]
    s_ptrs = s_ptr + (offs_n // BO) * n_kb
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kb in range(kb0, kb1, GROUP):  # GROUP K blocks an iteration: more loads in flight
        for g in tl.static_range(GROUP):
            if QUANT_IN_KERNEL:
                a = tl.load(x_ptrs + g * BK, mask=m_ok[:, None], other=0.0).to(tl.float32)
                sx, inv = _ue8m0(tl.max(tl.abs(a), axis=1))
                q = tl.clamp(a * inv[:, None], -448.0, 448.0).to(tl.float8e4nv)
            else:
                q = tl.load(x_ptrs + g * BK, mask=m_ok[:, None], other=0.0)
                sx = tl.load(xs_ptr + offs_m * n_kb + kb + g, mask=m_ok, other=0.0)
            b = tl.load(w_ptrs + g * BK, mask=n_ok[None, :], other=0.0)
            sw = tl.load(s_ptrs + kb + g, mask=n_ok, other=0.0)
            acc += tl.dot(q, b) * (sx[:, None] * sw[None, :])
        x_ptrs += GROUP * BK
        w_ptrs += GROUP * BK
    o_ptrs = o_ptr + split * M * stride_om + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# Size classes of M: decode batches (<= 16 rows), small batches (<= 64), the rest. Every class has
# one launch plan per (N, K, block), so a row's bits depend on its class, never on the other rows.
SMALL_M = 64
DEQUANT_M = 64


@functools.lru_cache(maxsize=8)
def _sm_count(device: int) -> int:
    if not torch.cuda.is_available():  # Triton's interpreter (tests)
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def tile_config(m: int, n: int, k: int, bk: int, device: int = 0) -> dict:
    """The launch plan for an [M, K] x [N, K] product: a function of M's size class, the
    weight's shape and its K block only (swept on the H200: benchmarks/results/fp8_gemm_h200.md).

    Up to ``SMALL_M`` rows (decode) the kernel streams the weight: 64-wide N tiles, the input
    quantized in registers, K split until there are two programs per SM so the whole GPU reads
    the weight, and 4 K blocks per loop iteration for 32-wide blocks. Tiles stay at most 32 rows:
    taller ones make Triton use Hopper's wgmma, whose FP8 sums keep fewer bits (measured 1-2e-4
    relative against 1e-7 at 16 rows), and the classes would part by that much. Above, the
    product is compute-bound: ``METHOD="dequant"`` writes both operands out in the input's dtype
    (exact: an E4M3 value times a power of two fits bf16) for one cuBLAS GEMM."""
    if m > DEQUANT_M:
        return dict(METHOD="dequant")
    bm, bn = (16, 64) if m <= 16 else (32, 64)
    tiles = -(-n // bn) * -(-m // bm)
    n_kb = k // bk
    split = 1
    while tiles * split < 2 * _sm_count(device) and n_kb // (split * 2) >= 4:
        split *= 2
    group = 4 if bk <= 32 and m <= 16 else 1
    return dict(
        BM=bm, BN=bn, num_warps=4, num_stages=4, SPLIT=split, GROUP=group, QUANT_IN_KERNEL=True
    )


@triton.jit
def _fp8_dequant_kernel(
    w_ptr,
    s_ptr,
    o_ptr,
    N,
    K,
    BO: tl.constexpr,
    BK: tl.constexpr,
    TN: tl.constexpr,
    NB: tl.constexpr,
):
    """A [TN, NB * BK] tile per program: o = float(w) * its block's scale, in o's dtype
    (exact)."""
    pid_n = tl.program_id(0)
    kb = tl.program_id(1) * NB + tl.arange(0, NB)
    offs_n = (pid_n * TN + tl.arange(0, TN)).to(tl.int64)
    ok2 = (offs_n < N)[:, None] & (kb < K // BK)[None, :]
    ok = ok2[:, :, None] & (tl.arange(0, BK) < BK)[None, None, :]
    offs = offs_n[:, None, None] * K + kb[None, :, None] * BK + tl.arange(0, BK)[None, None, :]
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    s_offs = (offs_n // BO)[:, None] * (K // BK) + kb[None, :]
    sw = tl.load(s_ptr + s_offs, mask=ok2, other=0.0)
    out = (w.to(tl.float32) * sw[:, :, None]).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + offs, out, mask=ok)


def _dequant_linear(x, weight, scale, block, dtype):
    """The compute-bound path: both operands rounded as the FP8 product rounds them, written
    out exactly in the compute dtype (the input's; float32 for a float32 output), one cuBLAS
    GEMM with float32 accumulation."""
    m, k = x.shape
    n = weight.shape[0]
    bo, bk = block
    compute = torch.float32 if dtype == torch.float32 else x.dtype
    xs = torch.empty(m, k, dtype=compute, device=x.device)
    grid = (m, triton.cdiv(k // bk, _NB))
    _fp8_act_quant_kernel[grid](x, xs, xs, k, x.stride(0), BK=bk, NB=_NB, SIM=True)
    wd = torch.empty(n, k, dtype=compute, device=x.device)
    tn, nb = 32, max(1, 256 // bk)
    grid = (triton.cdiv(n, tn), triton.cdiv(k // bk, nb))
    _fp8_dequant_kernel[grid](weight, scale, wd, n, k, BO=bo, BK=bk, TN=tn, NB=nb)
    return torch.nn.functional.linear(xs, wd).to(dtype)


def fp8_act_sim_triton(x: torch.Tensor, bk: int) -> torch.Tensor:
    """x [M, K] -> ``fp8_act_sim(x, bk)`` in x's dtype (q * s, exact) in one kernel, equal to
    it bit for bit on the GPU; a row's values depend on that row only."""
    m, k = x.shape
    if k % bk:
        raise ValueError(f"rounding per {bk} needs K divisible by it; got K={k}")
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(m, k, dtype=x.dtype, device=x.device)
    if m:
        grid = (m, triton.cdiv(k // bk, _NB))
        _fp8_act_quant_kernel[grid](x, out, out, k, x.stride(0), BK=bk, NB=_NB, SIM=True)
    return out


def fp8_act_quant_triton(x: torch.Tensor, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit column stride) -> (E4M3 [M, K], float32 scales [M, K/bk]), equal to
    ``fp8_act_quant`` bit for bit."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, k // bk, dtype=torch.float32, device=x.device)
    if m:
        grid = (m, triton.cdiv(k // bk, _NB))
        _fp8_act_quant_kernel[grid](x, q, s, k, x.stride(0), BK=bk, NB=_NB, SIM=False)
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
    if config is not None and "METHOD" in config:
        cfg = dict(config)  # a whole plan (benchmarks, tests): nothing taken from tile_config
    else:
        cfg = {**tile_config(m, n, k, block[1], x.device.index or 0), **(config or {})}
        if config is not None:
            cfg["METHOD"] = "tiles"
    method = cfg.pop("METHOD", "tiles")
    if method == "dequant":
        return _dequant_linear(x, weight, scale, block, dtype)
    if method == "dq":
        return fp8_dq_linear(x, weight, scale, block, dtype, cfg)
    defaults = dict(BM=16, BN=64, num_warps=4, num_stages=4, SPLIT=1, GROUP=1)
    cfg = {**defaults, "QUANT_IN_KERNEL": True, **cfg}
    bm, bn, split, group, in_kernel = (
        cfg.pop("BM"),
        cfg.pop("BN"),
        cfg.pop("SPLIT"),
        cfg.pop("GROUP"),
        cfg.pop("QUANT_IN_KERNEL"),
    )
    n_kb = k // block[1]
    split = max(1, min(split, n_kb))
    if n_kb % split or (n_kb // split) % group:
        group = 1  # a split's K blocks must fill whole groups (same sums either way)
    if in_kernel:
        xq, xs, stride = x, scale, x.stride(0)  # xs unused
    else:
        xq, xs = fp8_act_quant_triton(x, block[1])
        stride = k
    out = split_buffer(split, m, n, dtype, x.device)
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
        GROUP=group,
        QUANT_IN_KERNEL=in_kernel,
        **cfg,
    )
    return reduce_splits(out, split, dtype)
