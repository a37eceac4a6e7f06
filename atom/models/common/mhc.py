"""mHC (manifold-constrained hyper-connections) as DeepSeek's published V4 and V4.1 code
computes it: the residual stream is ``hc`` copies X [N, hc, d], and each sublayer reads a
weighted sum of them and writes back through a doubly stochastic mixing matrix.

``HcMixer.mixes(X)`` (float32): mix = fn(RMSNorm(flat X)) with no norm weight; then
  pre  = sigmoid(mix[:hc] * scale_0 + base[:hc]) + hc_eps           [N, hc]
  post = 2 sigmoid(mix[hc:2hc] * scale_1 + base[hc:2hc])            [N, hc]
  C    = sinkhorn(mix[2hc:] * scale_2 + base[2hc:])                 [N, hc, hc]
(a head mixer has only ``pre``: fn [hc, hc*d], scale [1]). ``collapse(X, pre)`` =
sum_b pre_b X_b is a sublayer's input, ``hc_post`` the update X_j = post_j * out + sum_i C_ij
X_i. How the families wire them differs: V4 collapses each sublayer with its own ``pre`` and has a
head mixer; V4.1 collapses a sublayer with the ``pre`` its *predecessor* computed (the first
attention with the one-hot ``identity_pre``) and the LM head with the last FFN's.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.kernels import invariant
from atom.kernels.norm import hc_post, hc_pre, rms_norm
from atom.kernels.sinkhorn import hc_mix
from atom.models.common.glue_compile import region

__all__ = ["HcMixer", "collapse", "hc_post", "identity_pre"]

collapse = hc_pre  # x [N, hc, d], pre [N, hc] float32 -> sum_b pre_b x_b [N, d], x's dtype


def identity_pre(x: torch.Tensor) -> torch.Tensor:
    """The one-hot pre mix [N, hc] (float32) V4.1's first layer collapses its input with (all
    copies are the embedding there, so it reads copy 0)."""
    # built on the device (a scalar store into a device tensor would copy from the host)
    one_hot = torch.arange(x.shape[1], device=x.device) == 0
    return one_hot.to(torch.float32).expand(x.shape[0], -1).contiguous()


class HcMixer(nn.Module):
    """The mixing values of one sublayer (``head=False``) or of an LM head reader
    (``head=True``). Parameters float32, named as published: ``fn`` [n_mix, hc*d] (``hc_*_fn``),
    ``base`` [n_mix] (``hc_*_base``), ``scale`` [3] or [1] (``hc_*_scale``)."""

    def __init__(
        self, hc: int, dim: int, iters: int, eps: float, norm_eps: float, head: bool = False
    ):
        super().__init__()
        self.hc, self.head = hc, head
        self.iters, self.eps, self.norm_eps = iters, eps, norm_eps
        n_mix = hc if head else (2 + hc) * hc
        self.fn = nn.Parameter(torch.empty(n_mix, hc * dim, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(n_mix, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(1 if head else 3, dtype=torch.float32))

    @region
    def mixes(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """x [N, hc, d] -> (pre [N, hc], post [N, hc], C [N, hc, hc]), float32; (pre, None,
        None) for a head mixer."""
        hc = self.hc
        flat = rms_norm(x.flatten(1), None, self.norm_eps, out_dtype=torch.float32)
        mix = invariant.linear(flat, self.fn)
        if self.head:
            pre = invariant.pointwise(torch.sigmoid, mix * self.scale[0] + self.base) + self.eps
            return pre, None, None
        return hc_mix(mix, self.scale, self.base, hc, self.iters, self.eps)
