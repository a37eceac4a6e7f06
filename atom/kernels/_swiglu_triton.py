"""The Triton kernel behind ``atom.kernels.swiglu`` (imported only where Triton is)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels._torch_math_triton import expf
from atom.kernels.triton_env import interpreting


@triton.jit
def _swiglu_kernel(
    g_ptr,
    u_ptr,
    w_ptr,
    order_ptr,
    out_ptr,
    cols,
    g_stride,
    u_stride,
    out_stride,
    limit,
    WEIGHT: tl.constexpr,
    ORDER: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < cols
    g = tl.load(g_ptr + r * g_stride + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r * u_stride + c, mask=m, other=0.0).to(tl.float32)
    g = tl.where(g > limit, limit, g)  # torch's clamp: NaN stays NaN
    u = tl.where(u > limit, limit, u)
    u = tl.where(u < -limit, -limit, u)
    h = tl.math.div_rn(g, 1.0 + expf(-g, LIBDEVICE)) * u  # torch's CUDA SiLU, then the product
    if WEIGHT:
        src = r
        if ORDER:
            src = tl.load(order_ptr + r).to(tl.int64)
        h = h * tl.load(w_ptr + src).to(tl.float32)
    tl.store(out_ptr + r * out_stride + c, h.to(out_ptr.dtype.element_ty), mask=m)


def swiglu_triton(
    g: torch.Tensor,
    u: torch.Tensor,
    limit: float,
    dtype: torch.dtype,
    w: torch.Tensor | None,
    order: torch.Tensor | None,
) -> torch.Tensor:
    """``swiglu_torch`` in one kernel: g, u [R, I] with unit column stride."""
    if g.stride(1) != 1:
        g = g.contiguous()
    if u.stride(1) != 1:
        u = u.contiguous()
    rows, cols = g.shape
    out = torch.empty(rows, cols, dtype=dtype, device=g.device)
    wf = w.reshape(-1).contiguous() if w is not None else g
    of = order.contiguous() if order is not None else g
    block = min(1024, triton.next_power_of_2(cols))
    _swiglu_kernel[(rows, triton.cdiv(cols, block))](
        g,
        u,
        wf,
        of,
        out,
        cols,
        g.stride(0),
        u.stride(0),
        out.stride(0),
        limit,
        WEIGHT=w is not None,
        ORDER=order is not None,
        LIBDEVICE=not interpreting(),
        BLOCK=block,
        enable_fp_fusion=False,
    )
    return out
