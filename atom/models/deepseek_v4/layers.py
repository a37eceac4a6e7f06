"""Per-token building blocks of V4 of its own: its mHC wiring (each sublayer collapses the
streams with its own mix, a head mixer reads them for the LM head) and its router.

Shared with V4.1 (``atom.models.common``): RMSNorm, the mHC mixing values and Sinkhorn
(``mhc``), the RoPE pairings and YaRN (``rope``), the MoE's experts and dispatch (``moe``).

The router: the MoE's first ``num_hash_layers`` layers route by a fixed table
``tid2eid[token id]`` (weights still from the router's scores), the others by top-k of score +
bias (noaux_tc). The published code applies the routing weight before the expert's down
projection, the shared MoE after it: the same function, rounded in another order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom.kernels import invariant
from atom.kernels.route import route
from atom.models.common.mhc import HcMixer, collapse, hc_post
from atom.models.common.moe import MoE
from atom.models.common.promoted import float_weight
from atom.models.common.rope import InterleavedRope  # noqa: F401  (re-exported)
from atom.models.deepseek_v4.config import V4Config


class V4HyperConnection(HcMixer):
    """mHC around one sublayer (``head=False``) or before the LM head (``head=True``), each
    collapsing the streams with its own ``pre`` (``atom.models.common.mhc``)."""

    def __init__(self, config: V4Config, head: bool = False):
        c = config
        super().__init__(
            c.hc_mult, c.hidden_size, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps, head
        )

    def pre(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """x [N, hc, d] -> (sublayer input [N, d], post [N, hc], C [N, hc, hc])."""
        pre, post, comb = self.mixes(x)
        return collapse(x, pre), post, comb

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
        logits = invariant.linear(x.float(), float_weight(self.gate))
        if self.gate.bias is not None:  # ties go to the smaller expert id, in every path
            return route(logits, self.gate.bias, 1.0, self.top_k, self.scale, 0.0, True)
        scores = torch.sqrt(invariant.pointwise(F.softplus, logits))
        idx = self.gate.tid2eid[token_ids]
        w = scores.gather(1, idx)
        return idx, w / invariant.sum(w, -1, keepdim=True) * self.scale
