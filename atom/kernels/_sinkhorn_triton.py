"""The Triton kernel behind ``atom.kernels.sinkhorn`` (imported only where Triton is)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels._torch_math_triton import expf
from atom.kernels.triton_env import interpreting


# n varies every call: specializing on it (n == 1, n % 16 == 0) would recompile mid-serving
@triton.jit(do_not_specialize=["n"])
def _sinkhorn_kernel(
    x_ptr,
    out_ptr,
    n,
    stride,
    ITERS: tl.constexpr,
    EPS: tl.constexpr,
    HC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    i = tl.arange(0, HC)
    cell = i[None, :, None] * HC + i[None, None, :]
    mask = (rows < n)[:, None, None] & (cell >= 0)
    x = tl.load(x_ptr + rows[:, None, None] * stride + cell, mask=mask, other=0.0)
    c = _sinkhorn_rows(x, ITERS, EPS)
    tl.store(out_ptr + rows[:, None, None] * (HC * HC) + cell, c, mask=mask)


@triton.jit
def _sinkhorn_rows(x, ITERS: tl.constexpr, EPS: tl.constexpr):
    """x [BLOCK, HC, HC] float32 logits -> their mixing matrices."""
    e = tl.exp(x - tl.max(x, axis=2, keep_dims=True))
    c = tl.math.div_rn(e, tl.sum(e, axis=2, keep_dims=True)) + EPS
    c = tl.math.div_rn(c, tl.sum(c, axis=1, keep_dims=True) + EPS)
    for _ in range(ITERS - 1):
        c = tl.math.div_rn(c, tl.sum(c, axis=2, keep_dims=True) + EPS)
        c = tl.math.div_rn(c, tl.sum(c, axis=1, keep_dims=True) + EPS)
    return c


@triton.jit
def _sigmoid(z, LIBDEVICE: tl.constexpr):
    """torch's CUDA sigmoid, 1 / (1 + expf(-z)) with IEEE division: torch's bits."""
    return tl.math.div_rn(1.0, 1.0 + expf(-z, LIBDEVICE))


@triton.jit(do_not_specialize=["n"])
def _hc_mix_kernel(
    mix_ptr,
    scale_ptr,
    base_ptr,
    pre_ptr,
    post_ptr,
    c_ptr,
    n,
    stride,
    ITERS: tl.constexpr,
    EPS: tl.constexpr,
    HC: tl.constexpr,
    BLOCK: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    i = tl.arange(0, HC)
    vmask = (rows < n)[:, None] & (i >= 0)[None, :]
    row = mix_ptr + rows[:, None] * stride
    s0, s1, s2 = tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
    z = tl.load(row + i[None, :], mask=vmask, other=0.0) * s0 + tl.load(base_ptr + i)[None, :]
    tl.store(pre_ptr + rows[:, None] * HC + i[None, :], _sigmoid(z, LIBDEVICE) + EPS, mask=vmask)
    z = tl.load(row + HC + i[None, :], mask=vmask, other=0.0) * s1
    z = z + tl.load(base_ptr + HC + i)[None, :]
    tl.store(post_ptr + rows[:, None] * HC + i[None, :], 2.0 * _sigmoid(z, LIBDEVICE), mask=vmask)
    cell = i[None, :, None] * HC + i[None, None, :]
    mask = (rows < n)[:, None, None] & (cell >= 0)
    x = tl.load(row[:, :, None] + 2 * HC + cell, mask=mask, other=0.0) * s2
    x = x + tl.load(base_ptr + 2 * HC + cell)
    c = _sinkhorn_rows(x, ITERS, EPS)
    tl.store(c_ptr + rows[:, None, None] * (HC * HC) + cell, c, mask=mask)


def hc_mix_triton(
    mix: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hc_mix_torch`` in one kernel: mix [N, (2 + hc) * hc] float32 (last stride 1)."""
    n = mix.shape[0]
    pre = torch.empty(n, hc, dtype=torch.float32, device=mix.device)
    post = torch.empty(n, hc, dtype=torch.float32, device=mix.device)
    c = torch.empty(n, hc, hc, dtype=torch.float32, device=mix.device)
    if n:
        _hc_mix_kernel[(triton.cdiv(n, 4),)](
            mix,
            scale,
            base,
            pre,
            post,
            c,
            n,
            mix.stride(0),
            ITERS=iters,
            EPS=eps,
            HC=hc,
            BLOCK=4,
            LIBDEVICE=not interpreting(),
            num_warps=1,
            enable_fp_fusion=False,
        )
    return pre, post, c


def sinkhorn_triton(
    logits: torch.Tensor, hc: int, iters: int, eps: float, config: dict | None = None
) -> torch.Tensor:
    """``config``: launch parameters (BLOCK rows per program, num_warps) over the defaults
    (benchmarks sweep them)."""
    n = logits.shape[0]
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(n, hc, hc, dtype=torch.float32, device=logits.device)
    if n == 0:
        return out
    # 4 tokens on one warp: the 40 reductions stay in the warp (benchmarks/kernel_sweep.py:
    # 5.3 us for 16 tokens on the H200, 14.9 us with 64 tokens on 4 warps)
    cfg = dict(BLOCK=4, num_warps=1) | (config or {})
    _sinkhorn_kernel[(triton.cdiv(n, cfg["BLOCK"]),)](
        logits, out, n, logits.stride(0), ITERS=iters, EPS=eps, HC=hc, **cfg
    )
    return out
