"""The Triton kernel behind ``atom.kernels.route`` (imported only where Triton is)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels._torch_math_triton import expf, log1pf
from atom.kernels.triton_env import interpreting


@triton.jit
def _softplus(z, LIBDEVICE: tl.constexpr):
    """torch's CUDA softplus (beta 1, threshold 20): z above 20, else log1p(expf(z))."""
    return tl.where(z > 20.0, z, log1pf(expf(z, LIBDEVICE), LIBDEVICE))


@triton.jit(do_not_specialize=["n"])
def _route_kernel(
    logits_ptr,
    bias_ptr,
    idx_ptr,
    w_ptr,
    n,
    n_experts,
    stride,
    temp,
    scale,
    eps,
    TOP_K: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    em = e < n_experts
    z = tl.math.div_rn(tl.load(logits_ptr + row * stride + e, mask=em, other=0.0), temp)
    scores = tl.math.sqrt_rn(_softplus(z, LIBDEVICE))
    biased = scores + tl.load(bias_ptr + e, mask=em, other=0.0)
    biased = tl.where(em, biased, float("-inf"))
    k = tl.arange(0, BLOCK_K)  # slots past TOP_K stay 0 and are not stored
    picks = tl.zeros([BLOCK_K], dtype=tl.int32)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        top = tl.max(biased, 0)
        pick = tl.min(tl.where(biased == top, e, BLOCK_E), 0)  # the first of equals
        picks = tl.where(k == j, pick, picks)
        w = tl.where(k == j, tl.sum(tl.where(e == pick, scores, 0.0), 0), w)
        biased = tl.where(e == pick, float("-inf"), biased)
    if NORMALIZE:
        w = tl.math.div_rn(w, tl.sum(w, 0) + eps)
    tl.store(idx_ptr + row * TOP_K + k, picks.to(tl.int64), mask=k < TOP_K)
    tl.store(w_ptr + row * TOP_K + k, w * scale, mask=k < TOP_K)


def route_triton(
    logits: torch.Tensor,
    bias: torch.Tensor,
    temp: float,
    top_k: int,
    scale: float,
    eps: float = 1e-20,
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``route_torch`` in one kernel: logits [N, E] float32, bias [E] float32 contiguous;
    ``normalize``: divide the weights by their sum + ``eps`` (``route_torch``'s rule)."""
    n, n_experts = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    idx = torch.empty(n, top_k, dtype=torch.int64, device=logits.device)
    w = torch.empty(n, top_k, dtype=torch.float32, device=logits.device)
    if n:
        _route_kernel[(n,)](
            logits,
            bias,
            idx,
            w,
            n,
            n_experts,
            logits.stride(0),
            float(temp),
            float(scale),
            float(eps),
            TOP_K=top_k,
            NORMALIZE=normalize,
            BLOCK_K=triton.next_power_of_2(top_k),
            BLOCK_E=triton.next_power_of_2(n_experts),
            LIBDEVICE=not interpreting(),
            num_warps=4 if n_experts > 128 else 1,
            enable_fp_fusion=False,
        )
    return idx, w
