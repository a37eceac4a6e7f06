"""mHC's doubly stochastic mixing matrix, as DeepSeek's published V4 and V4.1 code computes it:
row softmax + eps, a column normalization, then ``iters - 1`` rounds of row and column
normalization, every denominator + eps (so it ends on columns), per token, in one kernel.

The torch expression launches 4 kernels per round (20 rounds, two hyper-connections per layer:
160 launches per layer per forward); on a GPU that is launch time, not math.

``hc_mix`` is a sublayer mixer's whole epilogue after its projection (pre, post and the matrix
from the raw mix, ``HcMixer.mixes``), the same kernel with the ten element-wise ops before the
matrix folded in.
"""

from __future__ import annotations

import functools

import torch

from atom.kernels import invariant, use_triton


def sinkhorn_torch(logits: torch.Tensor, hc: int, iters: int, eps: float) -> torch.Tensor:
    """logits [N, hc * hc] float32 -> C [N, hc, hc] float32 (the reference expression)."""
    c = invariant.softmax(logits.reshape(-1, hc, hc), dim=-1) + eps
    c = c / (invariant.sum(c, 1, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (invariant.sum(c, 2, keepdim=True) + eps)
        c = c / (invariant.sum(c, 1, keepdim=True) + eps)
    return c


def sinkhorn(logits: torch.Tensor, hc: int, iters: int, eps: float) -> torch.Tensor:
    """Same as ``sinkhorn_torch``; one Triton kernel where ``use_triton`` allows (hc a power
    of two, no gradient wanted: the kernel has no backward), the torch expression elsewhere."""
    wants_grad = logits.requires_grad and torch.is_grad_enabled()
    usable = use_triton(logits, row_local=True) and logits.dtype == torch.float32
    if wants_grad or not usable or hc & (hc - 1):
        return sinkhorn_torch(logits, hc, iters, eps)
    from atom.kernels._sinkhorn_triton import sinkhorn_triton

    return sinkhorn_triton(logits, hc, iters, eps)


def hc_mix_torch(
    mix: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sublayer mixer's values from its raw mix [N, (2 + hc) * hc] float32, ``scale`` [3],
    ``base`` [(2 + hc) * hc]: (pre [N, hc], post [N, hc], C [N, hc, hc]), float32, as
    DeepSeek's published code computes them (module doc of ``atom.models.common.mhc``)."""
    sigmoid = functools.partial(invariant.pointwise, torch.sigmoid)
    pre = sigmoid(mix[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * sigmoid(mix[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = mix[:, 2 * hc :] * scale[2] + base[2 * hc :]
    return pre, post, sinkhorn(comb, hc, iters, eps)


def hc_mix(
    mix: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hc_mix_torch``; one Triton kernel where ``sinkhorn``'s would run (every value to the
    float32 rounding of the torch expression's, not its bits: the kernel's sigmoid and softmax
    take Triton's exponential)."""
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (mix, scale, base))
    usable = use_triton(mix, "hc_mix", row_local=True) and mix.dtype == torch.float32
    if wants_grad or not usable or hc & (hc - 1) or mix.stride(-1) != 1:
        return hc_mix_torch(mix, scale, base, hc, iters, eps)
    from atom.kernels._sinkhorn_triton import hc_mix_triton

    return hc_mix_triton(mix, scale.float().contiguous(), base.float().contiguous(), hc, iters, eps)
