"""The Triton kernel behind ``atom.kernels.moe_combine`` (imported only where Triton is)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _moe_combine_kernel(s_ptr, y_ptr, inv_ptr, o_ptr, d, K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < d
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(K):
        row = tl.load(inv_ptr + t * K + s).to(tl.int64)
        v = tl.load(y_ptr + row * d + cols, mask=m, other=0.0).to(tl.float32)
        acc = v if s == 0 else acc + v
    shared = tl.load(s_ptr + t * d + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + t * d + cols, shared + acc, mask=m)


def moe_combine_triton(shared, y, order, k):
    n, d = shared.shape[0], y.shape[1]
    out = torch.empty(n, d, dtype=torch.float32, device=y.device)
    if n == 0:
        return out
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    shared, y = shared.contiguous(), y.contiguous()
    block = 1024
    _moe_combine_kernel[(n, triton.cdiv(d, block))](shared, y, inv, out, d, K=k, BLOCK=block)
    return out
