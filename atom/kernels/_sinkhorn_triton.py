"""The Triton kernel behind ``atom.kernels.sinkhorn`` (imported only where Triton is)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    e = tl.exp(x - tl.max(x, axis=2, keep_dims=True))
    c = tl.math.div_rn(e, tl.sum(e, axis=2, keep_dims=True)) + EPS
    c = tl.math.div_rn(c, tl.sum(c, axis=1, keep_dims=True) + EPS)
    for _ in range(ITERS - 1):
        c = tl.math.div_rn(c, tl.sum(c, axis=2, keep_dims=True) + EPS)
        c = tl.math.div_rn(c, tl.sum(c, axis=1, keep_dims=True) + EPS)
    tl.store(out_ptr + rows[:, None, None] * (HC * HC) + cell, c, mask=mask)


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
