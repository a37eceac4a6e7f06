"""Per-token building blocks of V4 that differ from V4.1's, and the ones reused from it.

Reused by import where the math is the same: ``rms_norm`` / ``RMSNorm``, the mHC stream update
``HyperConnection.post`` (X_j = post_j * out + sum_i C_ij X_i), the YaRN frequencies and angle
table of ``Rope``, and the MoE's experts and dispatch (``MoE.mix``, clamped SwiGLU experts and
the shared expert).

V4's own:
* RoPE pairs features *interleaved* (2i, 2i+1), V4.1 rotates halves;
* mHC's mixing values are scaled per group (``hc_*_scale``) before the bias, and its Sinkhorn
  puts eps in every denominator and ends on a column normalization (V4.1: no eps, ends on rows);
* the MoE's first ``num_hash_layers`` layers route by a fixed table ``tid2eid[token id]``
  (weights still from the router's scores), the others by top-k of score + bias (noaux_tc).
  V4 applies the routing weight before the expert's down projection, V4.1 after it: the same
  function, rounded in another order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom.models.common.layers import hc_post, rms_norm
from atom.models.common.moe import MoE
from atom.models.common.rope import InterleavedRope  # noqa: F401  (re-exported)
from atom.models.deepseek_v4.config import V4Config


def sinkhorn_v4(logits: torch.Tensor, hc: int, iters: int, eps: float) -> torch.Tensor:
    """[N, hc*hc] float32 -> C [N, hc, hc]: row softmax + eps, a column normalization, then
    ``iters - 1`` rounds of row and column normalization, each denominator + eps."""
    c = torch.softmax(logits.reshape(-1, hc, hc), dim=-1) + eps
    c = c / (c.sum(1, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(2, keepdim=True) + eps)
        c = c / (c.sum(1, keepdim=True) + eps)
    return c


class V4HyperConnection(nn.Module):
    """mHC around one sublayer (``head=False``) or before the LM head (``head=True``).

    mix = fn(RMSNorm(flat X)) (no weight); pre = sigmoid(mix * scale_0 + base) + hc_eps;
    post = 2 sigmoid(mix * scale_1 + base); C = sinkhorn_v4(mix * scale_2 + base). Parameters
    are float32, as published (``hc_*_fn`` [mix, hc*d], ``hc_*_base`` [mix], ``hc_*_scale``
    [3], or [1] for the head).
    """

    def __init__(self, config: V4Config, head: bool = False):
        super().__init__()
        hc, d = config.hc_mult, config.hidden_size
        self.hc, self.head = hc, head
        self.iters, self.eps = config.hc_sinkhorn_iters, config.hc_eps
        self.norm_eps = config.rms_norm_eps
        n_mix = hc if head else (2 + hc) * hc
        self.fn = nn.Parameter(torch.empty(n_mix, hc * d, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(n_mix, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(1 if head else 3, dtype=torch.float32))

    def pre(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """x [N, hc, d] -> (sublayer input [N, d], post [N, hc], C [N, hc, hc])."""
        hc = self.hc
        mix = F.linear(rms_norm(x.flatten(1).float(), None, self.norm_eps), self.fn)
        pre = torch.sigmoid(mix[:, :hc] * self.scale[0] + self.base[:hc]) + self.eps
        h = (pre[:, :, None] * x.float()).sum(1).to(x.dtype)
        if self.head:
            return h, None, None
        post = 2 * torch.sigmoid(mix[:, hc : 2 * hc] * self.scale[1] + self.base[hc : 2 * hc])
        comb = mix[:, 2 * hc :] * self.scale[2] + self.base[2 * hc :]
        return h, post, sinkhorn_v4(comb, hc, self.iters, self.eps)

    post = staticmethod(hc_post)


class V4Gate(nn.Module):
    """Router: ``weight`` [E, d]; ``bias`` [E] (score layers) or ``tid2eid`` [V, top_k] int64
    (hash layers: the experts of each token id, fixed)."""

    def __init__(self, config: V4Config, hashed: bool, dtype: torch.dtype):
        super().__init__()
        e, d = config.n_routed_experts, config.hidden_size
        self.weight = nn.Parameter(torch.empty(e, d, dtype=dtype))
        if hashed:
            k = config.num_experts_per_tok
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, k, dtype=torch.int64))
            self.bias = None
        else:
            self.bias = nn.Parameter(torch.zeros(e, dtype=torch.float32))


class V4MoE(MoE):
    """V4.1's experts and dispatch, with V4's router (hash or noaux_tc top-k)."""

    def __init__(self, config: V4Config, layer: int, dtype: torch.dtype):
        super().__init__(config, dtype)
        self.gate = V4Gate(config, config.is_hash_layer(layer), dtype)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        return self.mix(x, *self.route_ids(x, token_ids))

    def route_ids(self, x: torch.Tensor, token_ids: torch.Tensor):
        """(expert ids [N, top_k], weights [N, top_k] float32): weights are the chosen experts'
        sqrt(softplus) scores, normalized, times ``routed_scaling_factor``."""
        scores = torch.sqrt(F.softplus(F.linear(x.float(), self.gate.weight.float())))
        if self.gate.bias is None:
            idx = self.gate.tid2eid[token_ids]
        else:
            biased = scores + self.gate.bias
            # ties go to the smaller expert id, identically in every path
            idx = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, : self.top_k]
        w = scores.gather(1, idx)
        return idx, w / w.sum(-1, keepdim=True) * self.scale
