"""DSpark: DeepSeek-V4.1's block drafter, as the published inference code defines it.

``dspark_stages`` stages (checkpoint ``mtp.{i}.*``), each a V4.1 block (window-only attention,
an MoE of ``dspark_n_routed_experts`` experts choosing ``dspark_num_experts_per_tok``, no
Engram), draft ``B = dspark_block_size`` tokens in one pass. After the target has computed
position p and produced token t(p+1):

    main_hidden(q) = concat over dspark_target_layer_ids of the mean over the hc streams of
                     that layer's input (after its Engram), for every target position q
    main_x(q)      = main_norm(main_proj(main_hidden(q)))                    # stage 0's
    block ids      = [t(p+1), noise, ..., noise]        (B ids, dspark_noise_token_id)
    x              = embed(block ids) on every stream; pre = the one-hot identity mix
    each stage     : the V4.1 block around DSpark attention (below), as a main layer runs
    h              = collapse(x, pre of the last stage's FFN mixer)
    logits[i]      = head(norm(h))[i] + markov_head(markov_embed(out[i]))    # float32
    out[0] = t(p+1); out[i + 1] = argmax(logits[i])     (greedy; sampling is the engine's)
    confidence[i]  = confidence_head([h[i], markov_embed(out[i])])

so ``out[1..B]`` are drafts for positions p+2 .. p+B+1; ``logits[i]`` predicts position
p+2+i. DSpark attention of a stage: the B block queries sit at positions p+1 .. p+B; their
keys (= values) are the stage's window of *target* KV, ``kv_norm(wkv(main_x(q)))`` rotated at q
for the last ``sliding_window`` target positions q <= p, followed by the block's own KV; every
block query sees every block key (no causal mask inside the block) and the whole window, with
the stage's sink. The stage's RoPE is the window layers' (``rope_theta``, no YaRN).

``draft_block`` is the reference of one draft (whole arrays, no state); the engine's paged
path keeps each stage's window of target KV in the request's state instead.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.models.common.layers import Linear, RMSNorm, linear
from atom.models.common.mhc import collapse, identity_pre
from atom.models.deepseek_v41.attention import CSA2Attention
from atom.models.deepseek_v41.block import DecoderLayer
from atom.models.deepseek_v41.config import V41Config


def stage_config(config: V41Config) -> V41Config:
    """The config a stage's block is built from: the DSpark expert counts (the main ones when
    unset, as published)."""
    c = config
    return c.model_copy(
        update=dict(
            n_routed_experts=c.dspark_n_routed_experts or c.n_routed_experts,
            num_experts_per_tok=c.dspark_num_experts_per_tok or c.num_experts_per_tok,
        )
    )


class DSparkStage(DecoderLayer):
    """Stage ``stage``: a block at layer index ``num_hidden_layers + stage`` (window-only
    attention), plus stage 0's ``main_proj`` / ``main_norm`` and the last stage's ``norm``,
    Markov head and confidence head."""

    def __init__(self, config: V41Config, stage: int, dtype: torch.dtype, kv_dtype: str):
        super().__init__(stage_config(config), config.num_hidden_layers + stage, dtype, kv_dtype)
        c, d = config, config.hidden_size
        self.stage = stage
        self.act = self.self_attn.act
        if stage == 0:
            width = d * len(c.dspark_target_layer_ids)
            self.main_proj = linear(width, d, dtype)
            self.main_norm = RMSNorm(d, c.rms_norm_eps, dtype)
        if stage == c.dspark_stages - 1:
            rank = c.dspark_markov_rank
            self.norm = RMSNorm(d, c.rms_norm_eps, dtype)
            self.markov_embed = nn.Embedding(c.vocab_size, rank, dtype=dtype)
            # float32, as published (its logits are added to the head's float32 logits)
            self.markov_head = Linear(rank, c.vocab_size, bias=False, dtype=torch.float32)
            self.confidence = Linear(d + rank, 1, bias=False, dtype=torch.float32)

    def main_x(self, main_hidden: torch.Tensor) -> torch.Tensor:
        """Stage 0: target hidden [Q, targets * d] -> main_x [Q, d]."""
        return self.main_norm(self.main_proj(self.act(main_hidden)))

    def target_kv(self, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """This stage's window keys of target positions: [Q, hd], rotated and rounded as a
        window ring row is."""
        attn: CSA2Attention = self.self_attn
        return attn.window_kv(main_x, attn.rope.cos_sin(positions))

    def attend(self, u: torch.Tensor, ring: torch.Tensor, positions: torch.Tensor):
        """DSpark attention: block inputs u [B, d] at ``positions`` [B] over the window of
        target keys ``ring`` [W, hd] and the block's own keys, all visible to all."""
        attn: CSA2Attention = self.self_attn
        cs = attn.rope.cos_sin(positions)
        q, _ = attn.queries(u, cs)
        keys = torch.cat([ring, attn.window_kv(u, cs)])
        mask = torch.ones(u.shape[0], keys.shape[0], dtype=torch.bool, device=u.device)
        return attn.output(attn.attend(q, keys, mask, None, None), cs)

    def markov(self, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logit bias [..., V] float32, Markov embedding [..., rank]) of the previous token."""
        e = self.markov_embed(token)
        return self.markov_head(e.float()), e


@torch.no_grad()
def draft_block(
    model, main_hidden: torch.Tensor, token: int, position: int, forced: list[int] | None = None
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """The reference of one DSpark draft (module doc), greedy.

    ``main_hidden`` [p + 1, targets * d]: the target hidden of positions 0 .. p
    (``reference.target_hidden``); ``token`` t(p+1); ``position`` p. Returns (the B drafted
    ids for p+2 .. p+B+1, logits [B, V] float32, confidence [B] float32). ``forced`` (tests):
    the ids to chain the Markov head through instead of the argmaxes (the logits of each
    position then follow from those ids).
    """
    c: V41Config = model.config
    stages: list[DSparkStage] = list(model.dspark)
    dev = model.device
    b, win = c.dspark_block_size, c.sliding_window
    p = position
    q0 = max(0, p - win + 1)
    target_pos = torch.arange(q0, p + 1, device=dev)
    main_x = stages[0].main_x(main_hidden[q0 : p + 1])
    block_pos = torch.arange(p + 1, p + 1 + b, device=dev)
    ids = torch.full((b,), c.dspark_noise_token_id, dtype=torch.int64, device=dev)
    ids[0] = token
    x = model._embed(ids)
    pre = identity_pre(x)
    for st in stages:
        ring = st.target_kv(main_x, target_pos)
        x, pre = st.block(x, pre, None, lambda u, s=st, r=ring: s.attend(u, r, block_pos))
    last = stages[-1]
    h = collapse(x, pre)
    logits = model.lm_head.float_logits(last.norm(h))
    out = [token]
    embeds = []
    for i in range(b):
        bias, e = last.markov(torch.tensor(out[i], device=dev))
        logits[i] += bias
        embeds.append(e)
        out.append(int(logits[i].argmax()) if forced is None else forced[i])
    conf = last.confidence(torch.cat([h, torch.stack(embeds)], dim=-1).float()).squeeze(-1)
    return out[1:], logits, conf
