"""Batch-invariant arithmetic: each token's result computed in an order that depends only on
that token's own inputs, never on how many other tokens share its forward or where it sits.

``EngineConfig.batch_invariant`` (``--batch-invariant``) turns the mode on for the process
(``configure``, applied when an engine is built, like the Triton switches). Off, every function
here is the plain torch call it replaces, so the default path is unchanged.

Why the default is not invariant (measured on CPU, float32): a GEMM's row 0 for the same input
row comes out in other bits when only the number of rows M changes (MKL runs M = 1 to 3 through
other kernels than M >= 4); the MoE runs its experts densely for small batches and per expert
otherwise, so a token's expert outputs are summed in another order; and an attention over every
visible compressed row (V4's HCA layers) scans the batch's largest row count, so a token's
softmax and value sums change length with the other sequences. On the GPU the same holds, and
more so (cuBLAS picks tiles and split-K by M).

In the mode:

- ``linear``, ``bmm``, ``grouped_linear``: on CUDA one Triton GEMM of a fixed launch
  configuration (``atom.kernels._invariant_gemm_triton``; ``fixed_gemm``), whose K split is
  set by the weight's shape alone. On CPU the rows go through the GEMM in tiles of
  ``ROW_TILE`` rows (the last padded with zero rows), all tiles as one batched GEMM of one
  shape: every row meets the same kernel, in the same position class, whatever M is.
- ``sum`` and ``mean``: on CUDA one launch of ``ordered_sum``
  (``atom.kernels._invariant_reduce_triton``), in an order set by the reduced length and the
  dimension's place alone (torch's CUDA reductions split a row by how many rows there are).
- attention, the indexer's scores and its top-k order: ``atom.kernels.invariant_attention``,
  built on these.
- the MoE (``atom.models.common.moe``): on CUDA grouped GEMMs of the fixed kernel over the
  expert-sorted rows, no host sync (so decode graphs replay in the mode), each token's slots
  added in slot order; on CPU the per-expert loop, each token's expert outputs added in expert
  order.

A token's window part and its chunking depend on its tile (prefill) or on the window (decode),
so a token computed in a prefill chunk and the same token computed by a decode step may still
differ in the last bits: the mode promises invariance to the batch and to the chunking of
prefill (tiles are aligned to positions), which is what a tier-resumed request needs (its
prefix is loaded and its tail prefilled, as the first pass prefilled it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom.kernels.invariant_mode import STATE as _MODE
from atom.kernels.invariant_mode import configure, enabled  # noqa: F401 - the mode's switch

NEG_INF = float("-inf")

# rows per GEMM tile in the mode (CPU: MKL is invariant from 4 rows on; CUDA: one wgmma M tile)
ROW_TILE = {"cpu": 16, "cuda": 64}


# elements per padded block of a pointwise op in the mode (a multiple of every SIMD width)
POINTWISE_BLOCK = 64


def pointwise(fn, *xs: torch.Tensor) -> torch.Tensor:
    """``fn(*xs)`` for an element-wise ``fn`` (exp, sigmoid, silu, softplus, cos, ...); in the
    mode, evaluated on contiguous copies padded to a multiple of ``POINTWISE_BLOCK`` elements.
    On CPU torch computes such functions with SIMD approximations in a loop's body and with the
    scalar library function in its tail, which round differently: without the padding, an
    element's bits would depend on where it falls in the tensor, i.e. on the batch. CUDA's
    element-wise kernels apply one device function to every element, vectorized or not: no
    padding there."""
    if not _MODE["on"] or xs[0].is_cuda:
        return fn(*xs)
    shape = torch.broadcast_shapes(*(x.shape for x in xs))
    flat = [x.expand(shape).contiguous().view(-1) for x in xs]
    n = flat[0].numel()
    pad = -n % POINTWISE_BLOCK
    if pad:
        flat = [torch.cat([f, f.new_zeros(pad)]) for f in flat]
    return fn(*flat)[:n].view(shape)


# a reduced dimension up to this long is added element-wise, in order (the mode, CUDA)
SHORT_SUM = 32


def sum(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:  # noqa: A001
    """``x.sum(dim, keepdim)``; in the mode on CUDA in an order set by the reduced length
    alone: torch's CUDA reductions split a row among threads and blocks by how many rows
    there are (the batch). Where Triton imports, one launch of ``ordered_sum``
    (``atom.kernels._invariant_reduce_triton``: float32 accumulation in the order of the
    terms); without it, a short dimension is added element-wise in order and a longer one is
    a product with a ones vector through the mode's ``linear``. On CPU torch's own (its
    reductions do not depend on the other rows there)."""
    if not (_MODE["on"] and x.is_cuda):
        return x.sum(dim, keepdim=keepdim)
    dim = dim % x.dim()
    n = x.shape[dim]
    if n == 0:
        return x.sum(dim, keepdim=keepdim)
    if fixed_gemm(x) and x.is_floating_point():
        from atom.kernels._invariant_reduce_triton import ordered_sum

        total = ordered_sum(x, dim)
        return total.unsqueeze(dim) if keepdim else total
    if n <= SHORT_SUM:
        total = x.select(dim, 0)
        for i in range(1, n):
            total = total + x.select(dim, i)
    else:
        moved = x.movedim(dim, -1)
        total = linear(moved, moved.new_ones(1, n)).squeeze(-1)
    return total.unsqueeze(dim) if keepdim else total


def mean(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """``x.mean(dim, keepdim)``, through ``sum`` (the mode's order on CUDA)."""
    if not (_MODE["on"] and x.is_cuda):
        return x.mean(dim, keepdim=keepdim)
    return sum(x, dim, keepdim) / x.shape[dim]


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.softmax(x, dim)``; in the mode, max-subtracted ``exp`` through ``pointwise`` and
    a sum along ``dim`` (each output's own elements, in order)."""
    if not _MODE["on"]:
        return torch.softmax(x, dim)
    e = pointwise(torch.exp, x - x.amax(dim, keepdim=True))
    return e / sum(e, dim, keepdim=True)


def row_tile(device: torch.device) -> int:
    return ROW_TILE.get(device.type, 16)


def _float32_gemm(x: torch.Tensor) -> bool:
    """Whether the mode multiplies a CPU GEMM with operands like ``x`` (bfloat16, float16) as
    float32. Torch picks its reduced-precision CPU GEMM kernel (oneDNN's or its own, which
    round some outputs apart) by the product of all the GEMM's sizes, the row or batch count
    included (ATen's ``mkldnn_gemm_min_size``, 16^3): a row's bits would change with the rows
    beside it (a [B, 2, 64] x [B, 64, 16] ``bmm``, a decode row's window scores, takes one
    kernel for B <= 2 and the other from 3 on). Its float32 GEMM takes one path whatever the
    count, so the operands are converted (exactly) to float32, multiplied, and the result is
    rounded to their dtype once. On CUDA the fixed kernel (``fixed_gemm``) runs instead."""
    return x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)


# operand alignment (bytes) in the mode: BLAS kernels pick other code paths (and sums) for
# operands that start unaligned or have odd leading dimensions, so each operand is a fresh
# contiguous tensor starting on this boundary
ALIGN = 64
# key columns of a GEMM are padded to a multiple of this (masked keys)
KEY_PAD = 16


def aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous tensor whose data starts on an ``ALIGN``-byte boundary."""
    if x.is_contiguous() and x.data_ptr() % ALIGN == 0:
        return x
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if out.data_ptr() % ALIGN:  # the allocator aligns far more than this; never seen
        raise RuntimeError("an unaligned allocation in the batch-invariant mode")
    return out.copy_(x)


def operand(x: torch.Tensor) -> torch.Tensor:
    """An operand of ``bmm``: aligned where BLAS multiplies it (``aligned``); as it is where the
    fixed kernel does (it takes any strides and offsets)."""
    return x if fixed_gemm(x) else aligned(x)


def pad_rows(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """``x`` with zeros appended along ``dim`` up to a multiple of ``multiple``."""
    pad = -x.shape[dim] % multiple
    if not pad:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim)


def _tiles(x: torch.Tensor, tile: int) -> torch.Tensor:
    """x [M, ...] -> [ceil(M / tile), tile, ...], padded with zero rows, aligned."""
    return aligned(pad_rows(x, 0, tile)).view(-1, tile, *x.shape[1:])


def fixed_gemm(x: torch.Tensor) -> bool:
    """Whether the mode's GEMMs on tensors like ``x`` run the fixed-configuration Triton kernel
    (``atom.kernels._invariant_gemm_triton``): on CUDA where Triton imports (and on CPU under
    Triton's interpreter, for tests). Elsewhere (CPU) they run row-tiled through torch."""
    from atom.kernels.triton_env import interpreting, triton_importable

    if not (x.is_cuda or interpreting()):
        return False
    return triton_importable()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear(x, weight, bias)``; in the mode, one fixed-configuration kernel (CUDA) or
    row-tiled (module doc)."""
    if not _MODE["on"]:
        return F.linear(x, weight, bias)
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    if m == 0:
        return F.linear(x, weight, bias)
    if fixed_gemm(x):
        from atom.kernels._invariant_gemm_triton import invariant_linear

        y = invariant_linear(rows, weight)
        if bias is not None:
            y = y + bias
        return y.view(*lead, weight.shape[0])
    dtype = x.dtype
    if _float32_gemm(x):
        rows, weight = rows.float(), weight.float()
    if k % KEY_PAD:  # an odd K: zero columns, so every row of a tile starts aligned
        rows, weight = pad_rows(rows, 1, KEY_PAD), pad_rows(weight, 1, KEY_PAD)
    tiled = _tiles(rows, row_tile(x.device))
    y = torch.matmul(tiled, aligned(weight).t()).reshape(-1, weight.shape[0])[:m]
    if bias is not None:
        y = y + bias
    return y.to(dtype).view(*lead, weight.shape[0])


def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [n, g, i], weight [g, o, i] -> [n, g, o] (``einsum("ngi,goi->ngo")``); in the mode,
    row-tiled over n (module doc)."""
    grads = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if grads or x.shape[0] == 0:
        return torch.einsum("ngi,goi->ngo", x, weight)
    if not _MODE["on"]:
        # the product of einsum("ngi,goi->ngo"), written where the [n, g, o] result lies (its
        # group-major view): the einsum's bmm wrote [g, n, o] and a copy followed
        out = x.new_empty(x.shape[0], weight.shape[0], weight.shape[1])
        torch.bmm(x.transpose(0, 1), weight.transpose(1, 2), out=out.transpose(0, 1))
        return out
    n, g, _ = x.shape
    if fixed_gemm(x):  # group j: the n rows of x[:, j] against weight[j]
        return bmm(x.transpose(0, 1), weight.transpose(1, 2)).transpose(0, 1)
    dtype = x.dtype
    if _float32_gemm(x):
        x, weight = x.float(), weight.float()
    tiled = _tiles(x, row_tile(x.device)).permute(2, 0, 1, 3)  # [g, tiles, tile, i]
    tiled = aligned(tiled)
    y = torch.matmul(tiled, aligned(weight.transpose(1, 2))[:, None])  # [g, tiles, tile, o]
    return y.permute(1, 2, 0, 3).reshape(-1, g, weight.shape[1])[:n].to(dtype)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)``; in the mode on CUDA, the fixed-configuration kernel, one group per
    batch entry (cuBLAS may pick its kernel by the batch count); on CPU, bfloat16 and float16
    as float32 (``_float32_gemm``: torch picks their kernel by the batch count too)."""
    if _MODE["on"] and fixed_gemm(a):
        from atom.kernels._invariant_gemm_triton import invariant_bmm

        return invariant_bmm(a, b)
    if _MODE["on"] and _float32_gemm(a):
        return torch.bmm(a.float(), b.float()).to(a.dtype)
    return torch.bmm(a, b)
