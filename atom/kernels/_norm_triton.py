"""The Triton kernels behind ``atom.kernels.norm`` (imported only where Triton is)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, n_cols, stride, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    x_row, o_row = x_ptr + row * stride, out_ptr + row * n_cols
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(0, n_cols, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        acc += x * x
    r = 1.0 / tl.sqrt_rn(tl.sum(acc, 0) / n_cols + eps)
    for c in range(0, n_cols, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        m = cols < n_cols
        y = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32) * r
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(o_row + cols, y.to(out_ptr.dtype.element_ty), mask=m)


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=out_dtype or x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(4096, triton.next_power_of_2(n))
        w = weight if weight is not None else x2
        _rms_norm_kernel[(x2.shape[0],)](
            x2, w, out, n, x2.stride(0), eps, HAS_W=weight is not None, BLOCK=block
        )
    return out.view(x.shape)


@triton.jit
def _hc_pre_kernel(x_ptr, pre_ptr, out_ptr, d, HC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    i = tl.arange(0, HC)
    m = (cols < d)[None, :] & (i >= 0)[:, None]
    x = tl.load(x_ptr + row * HC * d + i[:, None] * d + cols[None, :], mask=m, other=0.0)
    pre = tl.load(pre_ptr + row * HC + i)
    h = tl.sum(pre[:, None] * x.to(tl.float32), axis=0)
    tl.store(out_ptr + row * d + cols, h.to(out_ptr.dtype.element_ty), mask=cols < d)


@triton.jit
def _hc_post_kernel(
    x_ptr, out_ptr, post_ptr, c_ptr, new_ptr, d, HC: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    i = tl.arange(0, HC)
    m = (cols < d)[None, :] & (i >= 0)[:, None]
    x = tl.load(x_ptr + row * HC * d + i[:, None] * d + cols[None, :], mask=m, other=0.0)
    c = tl.load(c_ptr + row * HC * HC + i[:, None] * HC + i[None, :])  # [i, j]
    mixed = tl.sum(c[:, :, None] * x.to(tl.float32)[:, None, :], axis=0)  # [j, cols]
    o = tl.load(out_ptr + row * d + cols, mask=cols < d, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + row * HC + i)
    new = post[:, None] * o[None, :] + mixed
    tl.store(
        new_ptr + row * HC * d + i[:, None] * d + cols[None, :],
        new.to(new_ptr.dtype.element_ty),
        mask=m,
    )


BLOCK_D = 512


def hc_pre_triton(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    n, hc, d = x.shape
    x, pre = x.contiguous(), pre.float().contiguous()
    out = torch.empty(n, d, dtype=x.dtype, device=x.device)
    if n:
        _hc_pre_kernel[(n, triton.cdiv(d, BLOCK_D))](x, pre, out, d, HC=hc, BLOCK=BLOCK_D)
    return out


def hc_post_triton(
    x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, c: torch.Tensor
) -> torch.Tensor:
    n, hc, d = x.shape
    x, out = x.contiguous(), out.contiguous()
    post, c = post.float().contiguous(), c.float().contiguous()
    new = torch.empty_like(x)
    if n:
        _hc_post_kernel[(n, triton.cdiv(d, BLOCK_D))](x, out, post, c, new, d, HC=hc, BLOCK=BLOCK_D)
    return new
