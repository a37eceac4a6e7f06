"""CSA2 attention: weights and the position-local math shared by the paged and reference paths.

A layer attends over its own sliding window (every layer) and, on compressed layers, over a
top-k selection of its kv owner's compressed rows, with one learned sink per head in the softmax
denominator. How rows, rings and selections are *kept* differs between the paged forward
(pages + state slots) and the reference (whole sequence); the math of each row does not, and
lives here.

Selections: ``select_topk`` ranks by score with ties to the smaller row, identically wherever it
runs. A query at position p sees ``(p + 1) // ratio`` compressed rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from atom.kernels import invariant, invariant_attention
from atom.kernels.fp8_gemm import fp8_act_round
from atom.models.common.formats import fp4_act_sim
from atom.models.common.glue_compile import region
from atom.models.common.layers import RMSNorm, linear, rms_norm
from atom.models.common.prefill_tiles import tile_attention
from atom.models.common.promoted import float_weight
from atom.models.common.rope import InterleavedRope
from atom.models.common.selection import (  # noqa: F401  (the rest: re-exported)
    NEG_INF,
    candidate_row_mask,
    gather_selected,
    mask_invisible,
    picked_ids,
    select_topk,
    visible_rows,
    window_mask,
)
from atom.models.common.storage import kv_roundtrip
from atom.models.common.tensor_parallel import sum_partials
from atom.models.deepseek_v41.config import LayerMode, V41Config


class Compressor(nn.Module):
    """Owner compressor: ratio 2 pools a pair with a per-feature softmax gate; ratio 1 projects."""

    def __init__(self, config: V41Config, ratio: int, dtype: torch.dtype):
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.ratio = ratio
        self.wkv = linear(d, hd, dtype)
        self.wgate = linear(d, hd, dtype) if ratio > 1 else None
        self.norm = RMSNorm(hd, config.rms_norm_eps, dtype)

    def raw(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token projections (float32), the values a compressor ring keeps."""
        if self.wgate is None:  # ratio 1: a plain projection in the compute dtype
            return self.wkv(u).float(), None
        # the pooling compressors project in float32, as published (weights promoted)
        x = u.float()
        values = invariant.linear(x, float_weight(self.wkv))
        return values, invariant.linear(x, float_weight(self.wgate))

    def pool(self, values: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        """values/scores [G, ratio, hd] float32 -> normalized latents [G, hd] float32."""
        if scores is None:
            pooled = values[:, 0]
        else:
            pooled = invariant.sum(invariant.softmax(scores, dim=1) * values, 1)
        return rms_norm(pooled, self.norm.weight, self.norm.eps)


class Indexer(nn.Module):
    """Index query (per index-source layer) and, on owners, the index-key projection."""

    def __init__(self, config: V41Config, owner: bool, dtype: torch.dtype):
        super().__init__()
        self.heads, self.dim = config.index_n_heads, config.index_head_dim
        self.wq_b = linear(config.q_lora_rank, self.heads * self.dim, dtype)
        self.weights_proj = linear(config.hidden_size, self.heads, dtype)
        if owner:
            self.wk = linear(config.head_dim, self.dim, dtype)
            self.k_norm = RMSNorm(self.dim, config.rms_norm_eps, dtype)

    def scores(self, qi: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """qi [T, Hi, D], w [T, Hi], keys [R, D] shared or [T, R, D] per query (all float32)
        -> s [T, R] = sum_h w ReLU(q.k). ``keys`` may also be an object scoring the queries
        itself (``index_scores(qi, w)``: the paged prefill's keys, one set per sequence)."""
        if not isinstance(keys, torch.Tensor):
            return keys.index_scores(qi, w)
        if invariant.enabled():
            return invariant_attention.index_scores(qi, w, keys)
        dots = torch.einsum("thd,trd->thr" if keys.dim() == 3 else "thd,rd->thr", qi, keys)
        return torch.einsum("th,thr->tr", w, torch.relu(dots))


class CSA2Attention(nn.Module):
    def __init__(self, config: V41Config, layer: int, dtype: torch.dtype, kv_dtype: str):
        super().__init__()
        c = config
        # a layer past num_hidden_layers is a draft layer: window-only, short RoPE (``draft``)
        main = layer < c.num_hidden_layers
        self.layer, self.mode = layer, c.layer_modes[layer] if main else LayerMode.WINDOW
        self.ratio = c.compress_ratios[layer] if main else 0
        self.kv_owner = c.kv_owner[layer] if main else None
        self.sel_owner = c.selection_owner[layer] if main else None
        self.is_candidate_source = layer == c.candidate_source_layer_id
        self.heads, self.head_dim = c.num_attention_heads, c.head_dim
        self.window, self.topk = c.sliding_window, c.index_topk
        self.cand_blocks, self.cand_block_size = c.candidate_topk_blocks, c.candidate_block_size
        self.groups, self.kv_dtype, self.dtype = c.o_groups, kv_dtype, dtype
        self.kv_fp8_sim, self.compressed_fp4_sim = c.kv_fp8_sim, c.compressed_fp4_sim
        self.index_fp4_sim, self.act_fp8_sim = c.index_fp4_sim, c.act_fp8_sim
        self.build_ropes(c)
        self.scale = self.head_dim**-0.5  # on every layer, as published: no YaRN mscale
        d = c.hidden_size
        self.q_a_proj = linear(d, c.q_lora_rank, dtype)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, dtype)
        self.q_b_proj = linear(c.q_lora_rank, self.heads * self.head_dim, dtype)
        self.kv_proj = linear(d, self.head_dim, dtype)
        self.kv_norm = RMSNorm(self.head_dim, c.rms_norm_eps, dtype)
        self.attn_sink = nn.Parameter(torch.zeros(self.heads, dtype=torch.float32))
        per_group = self.heads // self.groups * self.head_dim
        self.o_a_proj = linear(per_group, self.groups * c.o_lora_rank, dtype)
        self.o_b_proj = linear(self.groups * c.o_lora_rank, d, dtype)
        self.o_lora_rank = c.o_lora_rank
        # tensor parallelism (``atom.distributed``): this rank holds a slice of the heads and
        # output groups, and this sums the ranks' partial outputs; None without it
        self.reduce_output: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.compressor = Compressor(c, self.ratio, dtype) if self.mode is LayerMode.FULL else None
        self.indexer = (
            Indexer(c, owner=self.mode is LayerMode.FULL, dtype=dtype)
            if self.mode in (LayerMode.FULL, LayerMode.REINDEX)
            else None
        )

    def tp_splits(self) -> dict[str, int]:
        """What the ranks split (``atom.models.common.tensor_parallel``): the heads' query
        projection rows and sinks (head-major, so whole heads), the output projection's groups
        (``o_a_proj`` rows: group g reads heads g*H/G .. (g+1)*H/G - 1, so a rank's heads are
        exactly its groups' heads) and ``o_b_proj``'s matching input columns."""
        return {"q_b_proj.weight": 0, "attn_sink": 0, "o_a_proj.weight": 0, "o_b_proj.weight": 1}

    def tp_narrow(self, world: int, reduce: Callable[[torch.Tensor], torch.Tensor], gather) -> None:
        """Hold one rank's heads and groups; sum the ranks' partial outputs with ``reduce``."""
        self.heads //= world
        self.groups //= world
        self.reduce_output = reduce

    def build_ropes(self, c: V41Config) -> None:
        """(Re)build the RoPE tables on the current default device (``atom.distributed`` calls
        it again after materializing a model built on ``meta``)."""
        main = self.layer < c.num_hidden_layers
        theta, scaling = c.layer_rope(self.layer) if main else (c.rope_theta, None)
        self.rope = InterleavedRope(c.qk_rope_head_dim, theta, scaling)
        self.index_rope = InterleavedRope(c.qk_rope_head_dim, theta, scaling)

    # ---- per-token projections ------------------------------------------------------------

    @region
    def queries(self, u: torch.Tensor, cs) -> tuple[torch.Tensor, torch.Tensor]:
        """u [N, d] -> (q [N, H, hd] rotated at the token positions, q latent [N, q_lora])."""
        qlat = self.q_a_layernorm(self.q_a_proj(self.act(u)))
        q = self.q_b_proj(self.act(qlat)).view(-1, self.heads, self.head_dim)
        return self.rope.apply_(q, cs), qlat

    @region
    def window_kv(self, u: torch.Tensor, cs) -> torch.Tensor:
        """Window KV [N, hd], normalized, rotated and rounded to the storage dtype."""
        kv = self.rope.apply_(self.kv_norm(self.kv_proj(self.act(u))), cs)
        if self.kv_fp8_sim:
            kv = fp8_act_round(kv, 32)
        return kv_roundtrip(kv, self.kv_dtype)

    def compressed_rows(self, latents: torch.Tensor, cs) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [G, hd] float32 of groups j, cs at positions j*ratio -> (main rows [G, hd]
        rounded as stored, index keys [G, D] float32 *before* index quantization: the paged
        path packs them into PAGE, the reference applies ``index_roundtrip``)."""
        lat = latents.to(self.dtype)  # one cast for both readers
        k = self.indexer.k_norm(self.indexer.wk(lat)).float()
        # then rotated in place where the cast made a tensor of its own (latents stay as given)
        # that no backward reads (wk saves its input for the weight's gradient)
        fresh = latents.dtype != self.dtype and not torch.is_grad_enabled()
        main = (self.rope.apply_ if fresh else self.rope.apply)(lat, cs)
        if self.compressed_fp4_sim:
            main = fp4_act_sim(main, 16, "e4m3")
        main = kv_roundtrip(main, self.kv_dtype)
        return main, self.index_round(self.index_rope.apply_(k, cs))

    @region
    def index_query(self, qlat: torch.Tensor, u: torch.Tensor, cs):
        """(qi [N, Hi, D] float32 rotated, head weights [N, Hi] float32)."""
        ix = self.indexer
        qi = ix.wq_b(self.act(qlat)).view(-1, ix.heads, ix.dim).float()
        w = ix.weights_proj(u).float() * (ix.heads**-0.5 * ix.dim**-0.5)
        return self.index_round(self.index_rope.apply_(qi, cs)), w

    def act(self, x: torch.Tensor) -> torch.Tensor:
        """The input of an FP8 linear as the published code feeds it (``act_fp8_sim``)."""
        return fp8_act_round(x, 32) if self.act_fp8_sim else x

    def index_round(self, x: torch.Tensor) -> torch.Tensor:
        """Index queries and keys through FP4, E8M0 scales per 32 (``index_fp4_sim``), no
        Hadamard rotation (V4's indexer has one; V4.1's published one does not)."""
        return fp4_act_sim(x, 32, "e8m0") if self.index_fp4_sim else x

    # ---- attention ------------------------------------------------------------------------

    def attend(
        self,
        q: torch.Tensor,
        win_k: torch.Tensor,
        win_mask: torch.Tensor,
        comp: torch.Tensor | None,
        comp_valid: torch.Tensor | None,
    ) -> torch.Tensor:
        """q [T, H, hd]; window keys [Nw, hd] shared (or [T, Nw, hd] per query) with mask
        [T, Nw]; selected compressed rows [T, K, hd] with validity [T, K]. K = V (MQA); the
        sink joins the denominator."""
        if invariant.enabled():
            return invariant_attention.sink_attention_rows(
                q, win_k, win_mask, comp, comp_valid, self.attn_sink, self.scale
            )
        per_query = win_k.dim() == 3
        win = torch.einsum("thd,tnd->thn" if per_query else "thd,nd->thn", q, win_k).float()
        parts = [(win * self.scale).masked_fill(~win_mask[:, None, :], NEG_INF)]
        if comp is not None:
            sc = torch.einsum("thd,tkd->thk", q, comp).float() * self.scale
            parts.append(sc.masked_fill(~comp_valid[:, None, :], NEG_INF))
        sink = self.attn_sink.view(1, -1, 1).expand(q.shape[0], -1, 1)
        probs = torch.softmax(torch.cat(parts + [sink], dim=-1), dim=-1).to(q.dtype)
        nw = win_k.shape[-2]
        out = torch.einsum("thn,tnd->thd" if per_query else "thn,nd->thd", probs[..., :nw], win_k)
        if comp is not None:
            out = out + torch.einsum("thk,tkd->thd", probs[..., nw:-1], comp)
        return out

    def attend_tiles(
        self,
        q: torch.Tensor,
        win_k: torch.Tensor,
        win_mask: torch.Tensor,
        comp: torch.Tensor | None,
        comp_valid: torch.Tensor | None,
        window: int | None = None,
    ) -> torch.Tensor:
        """``attend`` for B tiles of Q queries at once, each tile with its own window keys:
        q [B, Q, H, hd], win_k [B, L, hd], win_mask [B, Q, L], comp [B * Q, K, hd], comp_valid
        [B * Q, K] -> [B * Q, H, hd]. The same arithmetic per query as ``attend``; ``window``:
        a ``PrefillBatch``'s tiles (``tile_attention``)."""
        return tile_attention(
            q, win_k, win_mask, comp, comp_valid, self.attn_sink, self.scale, window
        )

    def output(self, o: torch.Tensor, cs) -> torch.Tensor:
        """Inverse RoPE at the query position (in place: ``o`` [N, H, hd] is the caller's
        attention output, read by nothing after), then the grouped output projection (under
        tensor parallelism: of this rank's groups, summed over the ranks)."""
        return sum_partials(self._output_projection(o, cs), self.reduce_output)

    @region
    def _output_projection(self, o: torch.Tensor, cs) -> torch.Tensor:
        """``output`` on this rank: inverse RoPE, the grouped then the second projection."""
        o = self.rope.apply_(o, cs, inverse=True)
        n = o.shape[0]
        grouped = o.reshape(n, self.groups, -1)
        w = self.o_a_proj.weight.view(self.groups, self.o_lora_rank, -1)
        mid = invariant.grouped_linear(grouped, w).reshape(n, -1)
        return self.o_b_proj(self.act(mid))


# ---- selection ------------------------------------------------------------------------------


def layer_selection(
    attn: CSA2Attention,
    qlat: torch.Tensor,
    u: torch.Tensor,
    cs,
    keys: torch.Tensor,
    visible: torch.Tensor,
    candidates: torch.Tensor | None,
    fixed_k: bool = False,
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """Run an index-source layer's indexer for T queries over R index keys ([R, D] shared, or
    [T, R, D] per query with ``visible`` per query hiding each one's padding).

    Returns ((row ids, valid), candidate mask): the candidate source computes the mask its
    REINDEX layers restrict to; a REINDEX layer applies ``candidates``. ``fixed_k`` pads the
    selection to exactly ``index_topk`` picks (shapes independent of R).
    """
    qi, w = attn.index_query(qlat, u, cs)
    scores = mask_invisible(attn.indexer.scores(qi, w, keys), visible)
    new_candidates = None
    if attn.is_candidate_source:
        new_candidates = candidate_row_mask(scores, visible, attn.cand_block_size, attn.cand_blocks)
    if attn.mode is LayerMode.REINDEX:
        scores = scores.masked_fill(~candidates, NEG_INF)
    return select_topk(scores, attn.topk, fixed_k), new_candidates
