"""One DeepSeek-V4 layer: mHC around window/compressed attention, mHC around the MoE."""

from __future__ import annotations

import torch
from torch import nn

from atom.models.common.layers import RMSNorm
from atom.models.deepseek_v4.attention import V4Attention
from atom.models.deepseek_v4.config import V4Config
from atom.models.deepseek_v4.layers import V4HyperConnection, V4MoE


class V4Block(nn.Module):
    def __init__(self, config: V4Config, layer: int, dtype: torch.dtype, kv_dtype: str):
        super().__init__()
        eps = config.rms_norm_eps
        self.hc_attn = V4HyperConnection(config)
        self.attn_norm = RMSNorm(config.hidden_size, eps, dtype)
        self.attn = V4Attention(config, layer, dtype, kv_dtype)
        self.hc_ffn = V4HyperConnection(config)
        self.ffn_norm = RMSNorm(config.hidden_size, eps, dtype)
        self.ffn = V4MoE(config, layer, dtype)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor, attend) -> torch.Tensor:
        """One layer around an attention callable ``attend(normed input) -> output``; the MoE
        reads the token ids (hash-routed layers)."""
        h, post, c = self.hc_attn.pre(x)
        x = self.hc_attn.post(x, attend(self.attn_norm(h)), post, c)
        h, post, c = self.hc_ffn.pre(x)
        return self.hc_ffn.post(x, self.ffn(self.ffn_norm(h), token_ids), post, c)
