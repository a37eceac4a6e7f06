"""One V4.1 decoder layer (``DecoderLayer``: Engram, attention and MoE between mHC mixers) and
its mixer, the block the main model stacks and its draft layers (``draft.DraftLayer``) and DSpark
stages (``dspark.DSparkStage``) extend.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.models.common.layers import RMSNorm
from atom.models.common.mhc import HcMixer, collapse, hc_post
from atom.models.common.moe import MoE
from atom.models.deepseek_v41.attention import CSA2Attention
from atom.models.deepseek_v41.config import V41Config
from atom.models.deepseek_v41.engram import Engram


def hc_mixer(config: V41Config, head: bool = False) -> HcMixer:
    c = config
    return HcMixer(c.hc_mult, c.hidden_size, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps, head)


class DecoderLayer(nn.Module):
    def __init__(self, config: V41Config, layer: int, dtype: torch.dtype, kv_dtype: str):
        super().__init__()
        eps = config.rms_norm_eps
        self.engram = self.engram_index = None
        if layer in config.engram_layer_ids:
            spec = config.engram_spec
            self.engram_index = config.engram_layer_ids.index(layer)
            self.engram = Engram(
                dim=config.hidden_size,
                hc=config.hc_mult,
                rows=spec.num_embeddings[self.engram_index],
                head_dim=spec.head_dim,
                n_hash_cols=spec.n_hash_cols,
                eps=config.rms_norm_eps,
                dtype=dtype,
                act_fp8=config.act_fp8_sim,
            )
        self.attn_hc = hc_mixer(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.self_attn = CSA2Attention(config, layer, dtype, kv_dtype)
        self.ffn_hc = hc_mixer(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.mlp = MoE(config, dtype, gate_temp=config.gate_temp, act_fp8=config.act_fp8_sim)

    def block(
        self,
        x: torch.Tensor,
        pre: torch.Tensor,
        engram_rows: torch.Tensor | None,
        attend,
        tap=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer around an attention callable ``attend(normed input) -> output``.

        x [N, hc, d] streams; ``pre`` [N, hc] the mix its attention collapses them with (the
        previous layer's, ``identity_pre`` for the first). As published, each sublayer's
        mixes serve the *next* sublayer's collapse: the FFN collapses with the ``pre`` this
        attention's mixer computed, and the ``pre`` of this FFN's mixer is returned for the
        next layer (or the LM head). ``engram_rows`` [N, engram layers, n_hash_cols]: the
        n-gram row ids (``EngramHash.rows``), read on an engram layer. ``tap``, when given, is
        called with the layer's input streams after its Engram (what DSpark reads). Returns
        (streams out, that ``pre``)."""
        if self.engram is not None:
            x = self.engram(x, engram_rows[:, self.engram_index])
        if tap is not None:
            tap(x)
        attn_pre, post, comb = self.attn_hc.mixes(x)
        x = hc_post(x, attend(self.input_layernorm(collapse(x, pre))), post, comb)
        ffn_pre, post, comb = self.ffn_hc.mixes(x)
        out = self.mlp(self.post_attention_layernorm(collapse(x, attn_pre)))
        return hc_post(x, out, post, comb), ffn_pre
