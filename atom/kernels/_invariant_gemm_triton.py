"""The Triton GEMM behind the batch-invariant mode on CUDA (``atom.kernels.invariant``; imported
only where Triton is).

``_gemm_kernel`` computes one [BM, BN] tile of ``rows @ weight[g].T`` per program, its K loop
in order over BK-wide blocks into one float32 accumulator. BK is fixed per weight shape
(``CONFIG``, ``SHAPE_CONFIG``), never chosen by M; only which program computes which outputs
may change with M (``PREFILL_CONFIG``: wider tiles for a prefill). K may be split into
contiguous ranges (``splits``: by the weight's shape and the device alone), whose float32
partials are added in range order afterwards: decode-shaped calls then have enough programs to
stream the weight.
An output element's value therefore depends only on its own input row and weight column: not
on how many rows the call has, nor where its row sits in its tile (the tensor-core product of a
tile treats every row alike). cuBLAS does not promise that: its kernels and split-K change with
M (on the H200, K=5120 N=1024 gives another row 0 from M=256 on).

Grouped calls (the MoE's routed experts): ``rows`` sorted by group, ``ends[g]`` the end row of
group g; the tile table (``group_tiles``) is built on the device, so the call has no host
sync and can be captured in a CUDA graph. A tile never spans two groups.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from atom.kernels._invariant_reduce_triton import add_partials

# (BM, BN, BK, warps, stages) per input dtype; the same for every shape: a row's bits must
# not depend on M, and one configuration per dtype keeps them independent of N and K as well
CONFIG = {
    torch.bfloat16: (64, 128, 64, 4, 3),
    torch.float16: (64, 128, 64, 4, 3),
    torch.float32: (32, 64, 32, 4, 2),
}


@triton.jit
def _gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    tile_group_ptr,
    tile_row_ptr,
    ends_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bg,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cs,
    k_per,
    nsplit,
    IN_KERNEL: tl.constexpr,
    GROUPED: tl.constexpr,
    IEEE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    if GROUPED:
        g, row0, end = group_tile(tile_group_ptr, tile_row_ptr, ends_ptr, pid_m)
    else:
        g = 0
        row0 = pid_m.to(tl.int64) * BM
        end = M
    rm = row0 + tl.arange(0, BM)
    rn = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_rows = a_ptr + rm[:, None] * stride_am
    b_cols = b_ptr + g * stride_bg + rn[None, :] * stride_bn
    m_ok = rm < end
    n_ok = rn < N
    # this program's ranges of K: all of them (IN_KERNEL) or its own; each into its own
    # accumulator from zero, added in range order
    first = 0 if IN_KERNEL else split
    last = nsplit if IN_KERNEL else split + 1
    total = tl.zeros([BM, BN], dtype=tl.float32)
    for s in range(first, last):
        acc = _k_range(
            a_rows,
            b_cols,
            m_ok,
            n_ok,
            rk,
            s * k_per,
            K,
            k_per,
            stride_ak,
            stride_bk,
            IEEE,
            BM,
            BN,
            BK,
        )
        total = tl.where(s == first, acc, total + acc)
    c = c_ptr + split.to(tl.int64) * stride_cs + rm[:, None] * stride_cm + rn[None, :]
    tl.store(c, total.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def group_tile(tile_group_ptr, tile_row_ptr, ends_ptr, pid_m):
    """(group, first row, the group's end row) of tile ``pid_m`` of a ``group_tiles`` table; a
    spare tile (group -1) has group 0 and end 0: no rows."""
    g = tl.load(tile_group_ptr + pid_m).to(tl.int64)
    row0 = tl.load(tile_row_ptr + pid_m).to(tl.int64)
    end = tl.load(ends_ptr + g, mask=g >= 0, other=0).to(tl.int64)
    end = tl.where(g >= 0, end, 0)
    return tl.maximum(g, 0), row0, end


@triton.jit
def _k_range(
    a_rows,
    b_cols,
    m_ok,
    n_ok,
    rk,
    k_lo,
    K,
    k_per,
    stride_ak,
    stride_bk,
    IEEE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """One tile's products over K range [k_lo, k_lo + k_per), in order, from zero (float32)."""
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    k_hi = tl.minimum(K, k_lo + k_per)
    for k0 in range(k_lo, k_hi, BK):
        k = k0 + rk
        k_ok = k < k_hi
        a = tl.load(a_rows + k[None, :] * stride_ak, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_cols + k[:, None] * stride_bk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    return acc


# (dtype, N, K) -> (BN, BK, warps, stages) for one weight shape, over ``CONFIG``'s (a choice
# by the weight's shape keeps a row's bits independent of M; BM stays the dtype's: the MoE's
# grouped calls share one tile table across shapes). Filled from
# benchmarks/invariant_gemm_sweep.py's per-shape results (a shape not named: ``CONFIG``). The
# bf16 entries: the V4.1-Flash linear shapes (v41-bench's), each its least sum over M = 16 and
# 4096 of time over cuBLAS's among the sweep's tiles at SPLIT_PROGRAMS = 1, measured on the H200
# at e17dae5 (benchmarks/results/invariant_gemm_sweep_h200.md)
_BF16_SHAPES = {
    (1280, 5120): (128, 64, 4, 4),
    (32768, 1280): (256, 64, 8, 4),
    (512, 5120): (128, 64, 4, 4),
    (8192, 4096): (128, 64, 4, 4),
    (5120, 8192): (256, 64, 8, 4),
    (2304, 5120): (128, 64, 4, 4),
    (5120, 2304): (128, 64, 4, 4),
    (25600, 1536): (256, 64, 8, 4),
    (4096, 1280): (128, 128, 4, 3),
    (32, 5120): (64, 128, 4, 4),
    (128, 512): (64, 128, 4, 4),
    (129280, 5120): (256, 64, 8, 4),
}
SHAPE_CONFIG: dict[tuple[torch.dtype, int, int], tuple[int, int, int, int]] = {
    (torch.bfloat16, n, k): tile for (n, k), tile in _BF16_SHAPES.items()
}


# (dtype, N, K) -> (BM, BN, warps, stages) of a call of at least ``PREFILL_ROWS`` rows (not
# grouped), over the shape's own configuration: a bigger tile for a prefill's many rows. What
# decides a product's bits is kept: the shape's BK (the same tensor-core products, added in
# the same order along K) and its split of K (``splits``, from the shape's configuration).
# BM, BN, warps and stages only say which program computes which outputs, so a row gets the
# same bits at either tile (tests/kernels/test_invariant_gemm.py checks it on the GPU, and
# benchmarks/invariant_prefill_sweep.py keeps only tiles that do). A shape not named
# keeps its one configuration for every M. The entries: v41-bench's shapes where the sweep's
# fastest bit-keeping tile beat the shape's own by 7% or more at M = 4096 and did not lose at
# M = 1024 (H100, benchmarks/results/invariant_prefill_sweep_h100.md).
PREFILL_ROWS = 1024
_BF16_PREFILL = {
    (4096, 1280): (128, 128, 8, 3),
    (5120, 8192): (128, 128, 8, 4),
    (8192, 4096): (128, 128, 8, 4),
    (5120, 2304): (128, 128, 8, 4),
    (25600, 1536): (128, 256, 8, 3),
    (32768, 1280): (128, 256, 8, 3),
    (129280, 5120): (128, 256, 8, 3),
}
PREFILL_CONFIG: dict[tuple[torch.dtype, int, int], tuple[int, int, int, int]] = {
    (torch.bfloat16, n, k): tile for (n, k), tile in _BF16_PREFILL.items()
}


def fits(tile: tuple[int, int, int, int, int], device: torch.device) -> bool:
    """Whether a (BM, BN, BK, warps, stages) tile's pipelined bf16 operands fit the device's
    shared memory (an estimate: stages x (BM + BN) x BK x 2 bytes)."""
    bm, bn, bk, _, stages = tile
    limit = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    return stages * (bm + bn) * bk * 2 <= limit


def _config(dtype: torch.dtype, n: int | None = None, k: int | None = None, m: int = 0):
    """(BM, BN, BK, warps, stages) of a call of ``m`` rows (0: the shape's own configuration)
    with an [n, k] weight in ``dtype``."""
    if dtype not in CONFIG:
        raise TypeError(f"no batch-invariant GEMM for {dtype}")
    shaped = SHAPE_CONFIG.get((dtype, n, k))
    own = CONFIG[dtype] if shaped is None else (CONFIG[dtype][0], *shaped)
    wide = PREFILL_CONFIG.get((dtype, n, k)) if m >= PREFILL_ROWS else None
    if wide is None:
        return own
    bm, bn, warps, stages = wide
    return bm, bn, own[2], warps, stages


# programs a call should have at least, so that a decode-shaped GEMM (few rows) streams its
# weight at full bandwidth: the device's SM count (a fixed number where there is none)
_PROGRAMS_CPU = 8
# K blocks each split of K keeps at least, and the most splits
_MIN_SPLIT_BLOCKS, _MAX_SPLITS = 4, 16
# programs per SM a single row tile's call aims at (benchmarks/invariant_gemm_sweep.py sweeps it)
SPLIT_PROGRAMS = 1


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(device: torch.device) -> int:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _sm_count(index)
    return _PROGRAMS_CPU


def splits(n: int, k: int, dtype: torch.dtype, device: torch.device) -> int:
    """Into how many contiguous K ranges a call of an [n, k] weight splits (each summed by its
    own programs into float32 partials, the partials then added in range order): a function of
    n, k, the dtype and the device alone, never of M, so a row's bits stay independent of the
    batch. Enough ranges to give the device one program per SM with a single row tile."""
    _, bn, bk, _, _ = _config(dtype, n, k)
    programs = _programs(device) * SPLIT_PROGRAMS
    by_k = triton.cdiv(k, bk) // _MIN_SPLIT_BLOCKS
    return max(1, min(programs // triton.cdiv(n, bn), by_k, _MAX_SPLITS))


def _launch(rows, weight, out, tiles, ends, grouped: bool):
    n, k = weight.shape[-2], weight.shape[-1]
    bm, bn, bk, warps, stages = _config(rows.dtype, n, k, 0 if grouped else rows.shape[0])
    grid_m = tiles[0].shape[0] if grouped else triton.cdiv(rows.shape[0], bm)
    if out.shape[0] == 0 or n == 0:
        return out
    split = splits(n, k, rows.dtype, rows.device)
    k_per = triton.cdiv(triton.cdiv(k, bk), split) * bk
    split = triton.cdiv(k, k_per)  # no empty range
    # with programs enough for the device without a split (a prefill), one program runs all
    # of its tile's ranges: the same float32 partials, added in the same order, as a split
    # launch and ``add_partials`` (the same bits), without the partials' round trip
    in_kernel = split > 1 and grid_m * triton.cdiv(n, bn) >= _programs(rows.device)
    dest = out
    if split > 1 and not in_kernel:
        dest = torch.empty(split, *out.shape, dtype=torch.float32, device=out.device)
    dummy = ends if ends is not None else out
    grid_split = 1 if in_kernel else split
    _gemm_kernel[(grid_m, triton.cdiv(n, bn), grid_split)](
        rows,
        weight,
        dest,
        tiles[0] if tiles is not None else dummy,
        tiles[1] if tiles is not None else dummy,
        dummy,
        rows.shape[0],
        n,
        k,
        rows.stride(0),
        rows.stride(1),
        weight.stride(0) if grouped else 0,
        weight.stride(-2),
        weight.stride(-1),
        dest.stride(-2),
        dest.stride(0) if dest is not out else 0,
        k_per,
        split,
        IN_KERNEL=in_kernel,
        GROUPED=grouped,
        IEEE=rows.dtype == torch.float32,
        BM=bm,
        BN=bn,
        BK=bk,
        num_warps=warps,
        num_stages=stages,
    )
    if dest is not out:  # the partials added in range order, element-wise, in one launch
        add_partials(dest, out)
    return out


def invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T -> [M, N] in x's dtype (float32 accumulation)."""
    if weight.dtype != x.dtype:
        raise TypeError(f"input {x.dtype} and weight {weight.dtype} differ")
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    return _launch(x, weight, out, None, None, grouped=False)


def group_tiles(ends: torch.Tensor, rows: int, dtype: torch.dtype, bm: int | None = None):
    """The tile table of a grouped call on the device: (group of each tile, its first row),
    ``ceil(rows / BM) + groups`` entries (an upper bound on the tiles; the spare ones have
    group -1). ``ends`` [G] int: the end row of each group (a cumulative count). ``bm``: the
    tile's rows (default: this kernel's for ``dtype``)."""
    bm = _config(dtype)[0] if bm is None else bm
    groups = ends.shape[0]
    ends = ends.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    per = (ends - starts + bm - 1) // bm
    tile_end = torch.cumsum(per, 0)
    t = torch.arange(triton.cdiv(rows, bm) + groups, device=ends.device)
    g = torch.searchsorted(tile_end, t, right=True)
    valid = g < groups
    gc = g.clamp(max=groups - 1)
    first = starts[gc] + (t - (tile_end[gc] - per[gc])) * bm
    return torch.where(valid, gc, -1).to(torch.int32), first.to(torch.int32)


def invariant_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)``: a [B, M, K], b [B, K, N] -> [B, M, N], as a grouped call (group i:
    a[i]'s M rows against b[i]), so no row depends on B."""
    bsz, m, k = a.shape
    if bsz == 0 or m == 0:
        return torch.bmm(a, b)
    if a.dtype != b.dtype:
        raise TypeError(f"operands {a.dtype} and {b.dtype} differ")
    ends = torch.arange(1, bsz + 1, device=a.device, dtype=torch.int64) * m
    rows = a.reshape(bsz * m, k)
    return invariant_grouped_linear(rows, b.transpose(1, 2), ends).view(bsz, m, -1)


def invariant_grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, tiles=None
) -> torch.Tensor:
    """Rows of x [R, K] sorted by group, group g's rows ending at ``ends[g]``, times weight
    [G, N, K] of their group -> [R, N] in x's dtype. ``tiles``: ``group_tiles(ends, R,
    x.dtype)``, built once for calls that share the grouping."""
    if weight.dtype != x.dtype:
        raise TypeError(f"input {x.dtype} and weight {weight.dtype} differ")
    if tiles is None:
        tiles = group_tiles(ends, x.shape[0], x.dtype)
    out = torch.empty(x.shape[0], weight.shape[1], dtype=x.dtype, device=x.device)
    return _launch(x, weight, out, tiles, ends, grouped=True)
