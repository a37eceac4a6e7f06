"""The Triton kernel behind ``atom.kernels.fp4_gemm`` (imported only where Triton is): rows
times packed FP4 weights, the weights dequantized in registers, no dequantized copy in memory.

Weights as DeepSeek ships its routed experts: ``packed`` [G, N, K/2] bytes, two E2M1 codes
each (element 2j in the low nibble, 2j+1 in the high), and ``scale`` [G, N, K/32] E8M0 bytes
(2^(b - 127) per 32 inputs). A program computes one [BM, BN] tile of one group's rows: its K
loop loads each weight byte once ([BN, BK/2], contiguous along K) and each scale once
([BN, BK/32]), turns both nibbles into values (code bit 3 the sign, bits 1-2 the exponent, bit 0
the mantissa of 0, 0.5, 1, 1.5, 2, 3, 4, 6), scales them, interleaves them back into K's order
and rounds them to the rows' dtype (exact: an E2M1 value times a power of two fits bf16), then
one dot into a float32 accumulator. A spare tile of the table (no rows) loads nothing. The tile
table is ``group_tiles``' (built on the device, so a grouped call has no host sync and can be
captured in a CUDA graph).

Its launch: in the batch-invariant mode one per dtype (``CONFIG``), whatever the call's row
count, and K not split, so a row's bits depend only on its own row and its group's weight;
otherwise chosen by the call's row count (``BY_ROWS``: decode-sized calls split K across
programs, which the sweep measured up to 2.2x faster there), so a row's bits may then depend on
how many rows its call has, as cuBLAS's do.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from atom.kernels import invariant_mode
from atom.kernels._invariant_gemm_triton import group_tile, group_tiles
from atom.kernels._invariant_reduce_triton import add_partials


class Fp4Config(NamedTuple):
    """A launch of the kernel. ``pairs``: the K loop walks 32-input scale groups and multiplies
    the even and the odd inputs by the low and the high nibbles in two dots (no interleave, one
    scale per column per group); otherwise it interleaves both nibbles back into K's order and
    runs one dot per BK. Both load each weight byte and scale once."""

    bm: int
    bn: int
    bk: int
    warps: int
    stages: int
    pairs: bool = False
    split: int = 1  # programs along K per tile; > 1: float32 partials added in split order


# per input dtype (benchmarks/fp4_gemm_sweep.py measures the alternatives)
CONFIG = {
    torch.bfloat16: Fp4Config(64, 64, 64, 4, 3),
    torch.float16: Fp4Config(64, 64, 64, 4, 3),
    torch.float32: Fp4Config(32, 32, 32, 4, 2),
}
GROUP = 32  # inputs per E8M0 scale

# outside the batch-invariant mode: (most rows, launch) per input dtype, the first whose bound
# holds a call's row count R; past the last bound, ``CONFIG``'s. Measured on v41-bench-fp8's
# experts (H200, benchmarks/results/fp4_gemm_sweep_rows_h200.md and fp4_gemm_sweep_h200.md;
# each figure the sum over the bench's 30 expert products): at R = 16 / 64 (8 / 32 tokens of
# top-2) the first launch took 2.01 / 2.67 ms against CONFIG's 4.49 / 4.44; at R = 256 the
# second 3.83 ms against 5.54; at R = 8192 CONFIG's 50.9 ms against the second's 57.0
BY_ROWS = {
    torch.bfloat16: (
        (64, Fp4Config(16, 64, 256, 4, 3, True, 8)),
        (256, Fp4Config(64, 64, 64, 4, 3, False, 4)),
    ),
}


@triton.jit
def _fp4_values(codes):
    """E2M1 codes (int32, 0..15) -> float32 values."""
    mag = codes & 7
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    val = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * tl.exp2((e - 1).to(tl.float32)))
    return tl.where((codes & 8) != 0, -val, val)


@triton.jit
def _fp4_scaled_down(codes):
    """E2M1 codes (int32, 0..15) -> their values times 2^-14, as float32, in integer steps:
    the code's sign, exponent and mantissa bits placed in a float16's (sign, the exponent
    field's two low bits, the mantissa's top bit) give exactly that, subnormals included."""
    bits = ((codes & 8) << 12) | ((codes & 7) << 9)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _pairs_k_loop(
    acc,
    a_rows,
    p_rows,
    s_rows,
    m_ok,
    n_ok,
    k_lo,
    k_end,
    K,
    IEEE: tl.constexpr,
    BK: tl.constexpr,
):
    """``acc`` + the tile's rows times its weight columns, one 32-input scale group at a
    time: bytes [16, BN] (codes 2j and 2j + 1 of the group in byte j), a scale per column."""
    rj = tl.arange(0, 16)
    for k0 in range(k_lo, k_end, BK):
        for h in tl.static_range(BK // 32):
            kg = k0 + h * 32
            even = kg + 2 * rj
            a_ok = m_ok[:, None] & (even < K)[None, :]
            a_lo = tl.load(a_rows + even[None, :], mask=a_ok, other=0.0)
            a_hi = tl.load(a_rows + (even + 1)[None, :], mask=a_ok, other=0.0)
            kb = kg // 2 + rj
            w_ok = (kb < K // 2)[:, None] & n_ok[None, :]
            byte = tl.load(p_rows + kb[:, None], mask=w_ok, other=0)
            byte = byte.to(tl.int32)
            sb = tl.load(s_rows + kg // 32, mask=n_ok & (kg < K), other=127).to(tl.float32)
            step = tl.exp2(sb - 127.0)[None, :]
            # undo the 2^-14 first: one factor 2^(b - 113) would overflow for b > 240
            w_lo = (_fp4_scaled_down(byte & 15) * 16384.0 * step).to(a_lo.dtype)
            w_hi = (_fp4_scaled_down(byte >> 4) * 16384.0 * step).to(a_lo.dtype)
            if IEEE:
                acc = tl.dot(a_lo, w_lo, acc, input_precision="ieee")
                acc = tl.dot(a_hi, w_hi, acc, input_precision="ieee")
            else:
                acc = tl.dot(a_lo, w_lo, acc)
                acc = tl.dot(a_hi, w_hi, acc)
    return acc


@triton.jit
def _interleaved_k_loop(
    acc,
    a_rows,
    p_rows,
    s_rows,
    m_ok,
    n_ok,
    k_lo,
    k_end,
    K,
    IEEE: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """``acc`` + the tile's rows times its weight columns, BK inputs at a time: bytes
    [BN, BK/2] (contiguous along K), scales [BN, BK/32], both nibbles interleaved back into
    K's order, one dot."""
    rk = tl.arange(0, BK)
    rb = tl.arange(0, BK // 2)
    rs = tl.arange(0, BK // 32)
    for k0 in range(k_lo, k_end, BK):
        k = k0 + rk
        a = tl.load(a_rows + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
        kb = k0 // 2 + rb
        byte = tl.load(p_rows + kb[None, :], mask=n_ok[:, None] & (kb < K // 2)[None, :], other=0)
        byte = byte.to(tl.int32)
        ks = k0 // 32 + rs
        sb = tl.load(s_rows + ks[None, :], mask=n_ok[:, None] & (ks < K // 32)[None, :], other=127)
        step = tl.exp2(sb.to(tl.float32) - 127.0)  # [BN, BK / 32]
        lo = tl.reshape(_fp4_values(byte & 15), [BN, BK // 32, 16]) * step[:, :, None]
        hi = tl.reshape(_fp4_values(byte >> 4), [BN, BK // 32, 16]) * step[:, :, None]
        # element 2j is byte j's low nibble, 2j + 1 its high one: [BN, BK] in K's order
        w = tl.interleave(tl.reshape(lo, [BN, BK // 2]), tl.reshape(hi, [BN, BK // 2]))
        w = tl.trans(w.to(a.dtype))
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def _fp4_gemm_kernel(
    a_ptr,
    p_ptr,
    s_ptr,
    c_ptr,
    tile_group_ptr,
    tile_row_ptr,
    ends_ptr,
    N,
    K,
    stride_am,
    stride_pg,
    stride_pn,
    stride_sg,
    stride_sn,
    stride_cm,
    stride_cs,
    IEEE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PAIRS: tl.constexpr,
    SPLIT: tl.constexpr,
):
    g, row0, end = group_tile(tile_group_ptr, tile_row_ptr, ends_ptr, tl.program_id(0))
    pid_n = tl.program_id(1)
    rm = row0 + tl.arange(0, BM)
    rn = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    m_ok = rm < end
    n_ok = rn < N
    a_rows = a_ptr + rm[:, None] * stride_am
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    # split s of SPLIT sums K blocks [s * per, (s + 1) * per) (whole BK blocks, so no block
    # straddles two splits); a spare tile (no rows) reads no weight
    per = tl.cdiv(tl.cdiv(K, BK), SPLIT) * BK
    k_lo = tl.program_id(2) * per
    k_end = tl.where(row0 < end, tl.minimum(K, k_lo + per), 0)
    if PAIRS:
        p_cols = p_ptr + g * stride_pg + rn[None, :] * stride_pn
        s_cols = s_ptr + g * stride_sg + rn * stride_sn
        acc = _pairs_k_loop(acc, a_rows, p_cols, s_cols, m_ok, n_ok, k_lo, k_end, K, IEEE, BK)
    else:
        p_rows = p_ptr + g * stride_pg + rn[:, None] * stride_pn
        s_rows = s_ptr + g * stride_sg + rn[:, None] * stride_sn
        acc = _interleaved_k_loop(
            acc, a_rows, p_rows, s_rows, m_ok, n_ok, k_lo, k_end, K, IEEE, BN, BK
        )
    # SPLIT > 1: c is the float32 partials [SPLIT, R, N] (``add_partials`` sums them in order)
    c = c_ptr + tl.program_id(2).to(tl.int64) * stride_cs + rm[:, None] * stride_cm + rn[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def launch_for(dtype: torch.dtype, rows: int, config: Fp4Config | None = None) -> Fp4Config:
    """The launch of a call with ``rows`` rows of ``dtype``: ``config`` when given (the
    sweep's), ``CONFIG``'s in the batch-invariant mode, else ``BY_ROWS``' first that holds
    ``rows`` (``CONFIG``'s past them)."""
    if config is not None:
        return config
    if dtype not in CONFIG:
        raise TypeError(f"no FP4 GEMM for {dtype} inputs")
    if not invariant_mode.enabled():
        for most, launch in BY_ROWS.get(dtype, ()):
            if rows <= most:
                return launch
    return CONFIG[dtype]


def fp4_grouped_linear_triton(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    ends: torch.Tensor,
    tiles=None,
    config: Fp4Config | None = None,
) -> torch.Tensor:
    """Rows of x [R, K] sorted by group (group g's rows end at ``ends[g]``) times group g's
    FP4 weight (packed [G, N, K/2] uint8, scale [G, N, K/32] uint8 E8M0) -> [R, N] in x's
    dtype. ``tiles``: ``group_tiles(ends, R, x.dtype)`` (reused across calls that share the
    grouping); it must be built for the launch's BM (``group_tiles_for`` with the same rows).
    ``config``: a launch other than ``launch_for``'s (the sweep's)."""
    bm, bn, bk, warps, stages, pairs, split = launch_for(x.dtype, x.shape[0], config)
    if bk % GROUP:
        raise ValueError(f"BK {bk} is not a multiple of the scale group {GROUP}")
    r, k = x.shape
    g, n, half = packed.shape
    if half * 2 != k or scale.shape != (g, n, k // GROUP):
        raise ValueError(
            f"FP4 operands of x {tuple(x.shape)}: packed {tuple(packed.shape)} and scale "
            f"{tuple(scale.shape)} (expected [G, N, {k // 2}] and [G, N, {k // GROUP}])"
        )
    out = torch.empty(r, n, dtype=x.dtype, device=x.device)
    if r == 0 or n == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    packed = packed.view(torch.uint8)
    scale = scale.view(torch.uint8)
    if packed.stride(2) != 1:
        packed = packed.contiguous()
    if scale.stride(2) != 1:
        scale = scale.contiguous()
    if tiles is None:
        tiles = group_tiles_for(ends, r, x.dtype, config)
    split = max(1, min(split, triton.cdiv(k, bk)))
    dest = out if split == 1 else out.new_empty((split, r, n), dtype=torch.float32)
    _fp4_gemm_kernel[(tiles[0].shape[0], triton.cdiv(n, bn), split)](
        x,
        packed,
        scale,
        dest,
        tiles[0],
        tiles[1],
        ends,
        n,
        k,
        x.stride(0),
        packed.stride(0),
        packed.stride(1),
        scale.stride(0),
        scale.stride(1),
        dest.stride(-2),
        dest.stride(0) if split > 1 else 0,
        IEEE=x.dtype == torch.float32,
        BM=bm,
        BN=bn,
        BK=bk,
        PAIRS=pairs,
        SPLIT=split,
        num_warps=warps,
        num_stages=stages,
    )
    if split > 1:
        add_partials(dest, out)
    return out


def group_tiles_for(
    ends: torch.Tensor, rows: int, dtype: torch.dtype, config: Fp4Config | None = None
):
    """``group_tiles`` at the BM of a call of ``rows`` rows (``launch_for``): (group of each
    tile, its first row) on the device."""
    return group_tiles(ends, rows, dtype, bm=launch_for(dtype, rows, config).bm)
