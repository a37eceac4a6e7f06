"""DeepSeek-V4's multi-token-prediction block (``mtp.{i}.*``) as a draft layer.

One MTP block is a full V4 block at layer index ``num_hidden_layers + i`` (window-only
attention with its own window KV, a score-routed MoE with bias: never hash-routed) with extras
around it (DeepSeek's ``MTPBlock``):

    x   = e_proj(enorm(embed(ids)))[:, None, :] + h_proj(hnorm(residual))    # [N, hc, d]
    x'  = block(x)                                                           # the streams out
    out = head(norm(hc_head(x')))                                            # logits

``embed`` and ``head`` are the main model's (shared, as published: the checkpoint has no MTP
embed or head); ``hnorm`` normalizes each of the ``hc_mult`` streams of ``residual``;
``e_proj(...)`` is added to every stream. ``hc_head``, ``norm``, ``enorm`` and ``hnorm`` are the
block's own.

Alignment (the contract of ``atom.model_api.DraftRuntime``): the draft at position p takes the
token at p + 1 and the residual at p (the target's last-layer streams before ``hc_head``, or the
previous draft step's ``x'`` when chaining) and predicts the token at p + 2. Its attention runs
at position p (RoPE of the window-only layers: ``rope_theta``, no YaRN) over its own window of
earlier draft positions.

vLLM zeroes the MTP input embedding at position 0 ("not needed by MTP"); DeepSeek's reference
``MTPBlock`` does not, and neither does this block.

The block's oracle (one whole sequence, no caches) is ``reference.reference_draft_forward``.
"""

from __future__ import annotations

import torch

from atom.models.common.layers import RMSNorm, linear
from atom.models.deepseek_v4.block import V4Block
from atom.models.deepseek_v4.config import V4Config
from atom.models.deepseek_v4.layers import V4HyperConnection


class V4MTPBlock(V4Block):
    """A V4 block at layer ``num_hidden_layers + index`` plus the MTP extras (module doc).
    Parameter names follow the published ``mtp.{i}.*`` tensors (see ``checkpoint.NAMES``)."""

    def __init__(self, config: V4Config, index: int, dtype: torch.dtype, kv_dtype: str):
        layer = config.num_hidden_layers + index
        super().__init__(config, layer, dtype, kv_dtype)
        d, eps = config.hidden_size, config.rms_norm_eps
        self.layer, self.index = layer, index
        self.dtype = dtype
        self.e_proj = linear(d, d, dtype)
        self.h_proj = linear(d, d, dtype)
        self.enorm = RMSNorm(d, eps, dtype)
        self.hnorm = RMSNorm(d, eps, dtype)
        self.norm = RMSNorm(d, eps, dtype)
        self.hc_head = V4HyperConnection(config, head=True)

    def draft_input(self, embedded: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """embedded [N, d] (the main embedding of the next tokens), residual [N, hc, d] -> the
        block's input streams [N, hc, d]."""
        dtype = self.dtype
        e = self.e_proj(self.enorm(embedded.to(dtype)))
        return e[:, None, :] + self.h_proj(self.hnorm(residual.to(dtype)))

    def draft(
        self, embedded: torch.Tensor, residual: torch.Tensor, token_ids: torch.Tensor, attend
    ) -> torch.Tensor:
        """The block's output streams [N, hc, d] (a chained step's next residual);
        ``attend(normed input) -> output`` runs its window-only attention."""
        return self(self.draft_input(embedded, residual), token_ids, attend)

    def logits(self, x: torch.Tensor, head: torch.nn.Linear) -> torch.Tensor:
        """Streams [N, hc, d] -> float32 logits [N, V] through the shared ``head``."""
        h, _, _ = self.hc_head.pre(x)
        return head(self.norm(h)).float()
