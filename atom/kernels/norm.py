"""RMSNorm and mHC's stream combination (before a sublayer) and mixing (after it), each one
kernel over the rows instead of a chain of float32 elementwise ops.

Per layer and token the torch expressions read and write the hc x hidden residual streams in
float32 several times (a prefill of 4096 tokens moves ~13 GB per layer through them); the
kernels read the streams once in their stored dtype and write the result once.
"""

from __future__ import annotations

import torch

from atom.kernels import invariant, use_triton


def _kernel_ok(*ts: torch.Tensor) -> bool:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts):
        return False  # the kernels have no backward
    return use_triton(ts[0], row_local=True)  # one program per row (per d-block for mHC)


def rms_norm_torch(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    xf = x.float()
    out = xf * torch.rsqrt(invariant.mean(xf.pow(2), -1, keepdim=True) + eps)
    if weight is not None:
        out = out * weight.float()
    return out.to(out_dtype or x.dtype)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., n] -> x / rms(x) (* weight), float32 inside, in ``out_dtype`` (default x's).
    ``rms_norm(x, w, eps, torch.float32)`` is ``rms_norm(x.float(), w, eps)`` without the
    float32 copy of x (the same bits: the kernel reads x into float32 either way)."""
    if not _kernel_ok(x, weight):
        return rms_norm_torch(x, weight, eps, out_dtype)
    from atom.kernels._norm_triton import rms_norm_triton

    return rms_norm_triton(x, weight, eps, out_dtype)


def hc_pre_torch(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """x [N, hc, d], pre [N, hc] float32 -> sum_i pre_i x_i [N, d] in x's dtype."""
    return invariant.sum(pre[:, :, None] * x.float(), 1).to(x.dtype)


def hc_pre(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    hc = x.shape[1]
    if hc & (hc - 1) or not _kernel_ok(x, pre):
        return hc_pre_torch(x, pre)
    from atom.kernels._norm_triton import hc_pre_triton

    return hc_pre_triton(x, pre)


def hc_post_torch(
    x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, c: torch.Tensor
) -> torch.Tensor:
    """X_j = post_j * out + sum_i C_ij X_i: x [N, hc, d], out [N, d], post [N, hc], C [N, hc,
    hc] float32 -> [N, hc, d] in x's dtype."""
    if invariant.enabled():  # the streams added in order, element-wise (no batched GEMM)
        xf = x.float()
        mixed = c[:, 0, :, None] * xf[:, 0, None, :]
        for i in range(1, x.shape[1]):
            mixed = mixed + c[:, i, :, None] * xf[:, i, None, :]
    else:
        mixed = torch.einsum("nij,nid->njd", c, x.float())
    return (post[:, :, None] * out.float()[:, None, :] + mixed).to(x.dtype)


def hc_post(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, c: torch.Tensor):
    hc = x.shape[1]
    if hc & (hc - 1) or not _kernel_ok(x, out, post, c):
        return hc_post_torch(x, out, post, c)
    from atom.kernels._norm_triton import hc_post_triton

    return hc_post_triton(x, out, post, c)
