"""V4 attention: weights and the per-row math shared by the paged forward and the oracle.

Every layer attends over its own sliding window of ``kv_norm(wkv x)`` (K = V, MQA). A CSA layer
(ratio 4) also attends the top-k of its compressed rows that its indexer picks; an HCA layer
every visible compressed row. A query at position p sees ``(p + 1) // ratio`` rows; one learned
sink per head joins the softmax denominator; the softmax scale is head_dim^-0.5.

Compressor: per token, ``kv = wkv(x)`` and ``score = wgate(x) + ape[pos % ratio]`` in float32.
Group j (tokens j*r .. j*r + r - 1) is a per-feature softmax-weighted sum of its tokens' kv. At
ratio 4 the projections are twice as wide and groups overlap: group j pools the *first* half of
group j-1's tokens together with the *second* half of its own (group 0 sees nothing before it).
Then RMSNorm, RoPE on the last dims at position j*r, and the storage rounding: FP8 simulation of
the NoPE dims for attention rows, Hadamard + FP4 for the indexer's own compressor (each when
its config flag is on). How rows and partial groups are *kept* differs between the two paths;
the math of a group, given its tokens, lives here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from atom.kernels import invariant, invariant_attention
from atom.kernels.block_round import block_round
from atom.models.common.glue_compile import region
from atom.models.common.layers import RMSNorm, linear, rms_norm
from atom.models.common.promoted import float_stacked
from atom.models.common.storage import kv_roundtrip
from atom.models.common.tensor_parallel import sum_partials
from atom.models.deepseek_v4.config import CSA_RATIO, FP4_SIM_BLOCK, FP8_SIM_BLOCK, V4Config
from atom.models.deepseek_v4.layers import InterleavedRope
from atom.models.deepseek_v4.quant import hadamard

NEG_INF = float("-inf")


class V4Compressor(nn.Module):
    """Gated pooling of ``ratio`` tokens into one row of ``dim`` features (see module doc)."""

    def __init__(self, config: V4Config, ratio: int, dim: int, for_index: bool, dtype):
        super().__init__()
        self.ratio, self.dim = ratio, dim
        self.overlap = ratio == CSA_RATIO
        width = (2 if self.overlap else 1) * dim
        self.for_index = for_index
        self.fp8 = config.kv_fp8_sim and not for_index
        self.fp4 = config.index_fp4_sim and for_index
        self.rope_dim = config.qk_rope_head_dim
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.wkv = linear(config.hidden_size, width, dtype)
        self.wgate = linear(config.hidden_size, width, dtype)
        self.norm = RMSNorm(dim, config.rms_norm_eps, dtype)

    def raw(self, u: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token (kv, score) float32 [N, width], the values a partial group keeps."""
        kv, score = self.project(u)
        return kv, score + self.ape[positions % self.ratio]

    def project(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``raw`` before the score's ``ape`` row (a decode step's pooling kernel adds it):
        both projections in one GEMM, its two column blocks."""
        both = invariant.linear(u.float(), float_stacked(self, "wkv_wgate", self.wkv, self.wgate))
        return both.split(self.wkv.weight.shape[0], -1)

    def pool(
        self,
        kv: torch.Tensor,
        score: torch.Tensor,
        prev_kv: torch.Tensor | None,
        prev_score: torch.Tensor | None,
    ) -> torch.Tensor:
        """kv/score [G, r, width] of G whole groups; with overlap, prev_* [G, r, dim] are the
        first halves of each group's predecessor (zeros / -inf for group 0). -> [G, dim]."""
        if self.overlap:
            d = self.dim
            kv = torch.cat([prev_kv, kv[..., d:]], dim=1)
            score = torch.cat([prev_score, score[..., d:]], dim=1)
        return invariant.sum(kv * invariant.softmax(score, dim=1), 1)

    def rows(self, pooled: torch.Tensor, rope: InterleavedRope, cs) -> torch.Tensor:
        """Pooled [G, dim] at positions j*r (cs) -> finished rows [G, dim]: the main
        compressor's in its weights' dtype (FP8-rounded values are exact there, so rounding
        in that dtype gives what rounding in float32 and casting back gave), the indexer's in
        float32."""
        x = rope.apply_(self.norm(pooled.to(self.wkv.weight.dtype)), cs)
        if self.fp8:
            x = block_round(x, "fp8", FP8_SIM_BLOCK, x.shape[-1] - self.rope_dim)
        if not self.for_index:
            return x
        return block_round(hadamard(x), "fp4", FP4_SIM_BLOCK) if self.fp4 else x.float()


def overlap_prev(
    kv: torch.Tensor, score: torch.Tensor, first: tuple[torch.Tensor, torch.Tensor] | None, d: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Predecessor halves for whole groups kv/score [G, r, 2d]: group 0 of the batch takes
    ``first`` ([r, d] each: the last group before the batch) or nothing (zeros, -inf)."""
    if first is None:
        first = (kv.new_zeros(kv.shape[1], d), kv.new_full((kv.shape[1], d), NEG_INF))
    prev_kv = torch.cat([first[0][None], kv[:-1, :, :d]])
    prev_score = torch.cat([first[1][None], score[:-1, :, :d]])
    return prev_kv, prev_score


class V4Indexer(nn.Module):
    """Scores the compressed rows for a CSA layer's queries: its own compressor makes the keys,
    its query comes from the attention's query latent."""

    def __init__(self, config: V4Config, dtype):
        super().__init__()
        self.heads, self.dim = config.index_n_heads, config.index_head_dim
        self.topk, self.fp4 = config.index_topk, config.index_fp4_sim
        self.wq_b = linear(config.q_lora_rank, self.heads * self.dim, dtype)
        self.weights_proj = linear(config.hidden_size, self.heads, dtype)
        self.compressor = V4Compressor(config, CSA_RATIO, self.dim, True, dtype)

    @region
    def query(self, qr: torch.Tensor, u: torch.Tensor, rope: InterleavedRope, cs):
        """(qi [N, Hi, D] float32, head weights [N, Hi] float32)."""
        qi = rope.apply_(self.wq_b(qr).view(-1, self.heads, self.dim), cs).float()
        if self.fp4:
            qi = block_round(hadamard(qi), "fp4", FP4_SIM_BLOCK)
        w = self.weights_proj(u).float() * (self.dim**-0.5 * self.heads**-0.5)
        return qi, w

    @staticmethod
    def scores(qi: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """qi [T, Hi, D], w [T, Hi], keys [R, D] -> [T, R] = sum_h w_h ReLU(q_h . k)."""
        if invariant.enabled():
            return invariant_attention.index_scores(qi, w, keys)
        return torch.einsum("th,thr->tr", w, torch.relu(torch.einsum("thd,rd->thr", qi, keys)))


class V4Attention(nn.Module):
    def __init__(self, config: V4Config, layer: int, dtype: torch.dtype, kv_dtype: str):
        super().__init__()
        c = config
        self.layer, self.ratio = layer, c.layer_ratio(layer)
        self.heads, self.head_dim, self.window = c.num_attention_heads, c.head_dim, c.sliding_window
        self.groups, self.o_lora_rank = c.o_groups, c.o_lora_rank
        self.kv_dtype, self.eps, self.dtype = kv_dtype, c.rms_norm_eps, dtype
        self.rope_dim, self.fp8 = c.qk_rope_head_dim, c.kv_fp8_sim
        self.build_ropes(c)
        self.scale = self.head_dim**-0.5
        d = c.hidden_size
        self.wq_a = linear(d, c.q_lora_rank, dtype)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, dtype)
        self.wq_b = linear(c.q_lora_rank, self.heads * self.head_dim, dtype)
        self.wkv = linear(d, self.head_dim, dtype)
        self.kv_norm = RMSNorm(self.head_dim, c.rms_norm_eps, dtype)
        self.attn_sink = nn.Parameter(torch.zeros(self.heads, dtype=torch.float32))
        self.wo_a = linear(
            self.heads * self.head_dim // self.groups, self.groups * c.o_lora_rank, dtype
        )
        self.wo_b = linear(self.groups * c.o_lora_rank, d, dtype)
        # tensor parallelism (``tp_narrow``): this rank holds a slice of the heads and output
        # groups, and this sums the ranks' partial outputs; None without it
        self.reduce_output: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.compressor = (
            V4Compressor(c, self.ratio, self.head_dim, False, dtype) if self.ratio else None
        )
        self.indexer = V4Indexer(c, dtype) if self.ratio == CSA_RATIO else None

    def build_ropes(self, c: V4Config) -> None:
        """(Re)build the RoPE table on the current default device (``atom.distributed`` calls
        it again after materializing a model built on ``meta``)."""
        theta, scaling = c.layer_rope(self.layer)
        self.rope = InterleavedRope(c.qk_rope_head_dim, theta, scaling)

    def tp_splits(self) -> dict[str, int]:
        """What the ranks split (``atom.models.common.tensor_parallel``): the heads' query
        projection rows and sinks (whole heads), the output projection's groups (``wo_a`` rows:
        a rank's heads are exactly its groups' heads) and ``wo_b``'s matching input columns.
        The query latent, the window KV, the compressor and the indexer stay whole."""
        return {"wq_b.weight": 0, "attn_sink": 0, "wo_a.weight": 0, "wo_b.weight": 1}

    def tp_narrow(self, world: int, reduce: Callable[[torch.Tensor], torch.Tensor], gather) -> None:
        """Hold one rank's heads and groups; sum the ranks' partial outputs with ``reduce``."""
        self.heads //= world
        self.groups //= world
        self.reduce_output = reduce

    @region
    def queries(self, u: torch.Tensor, cs) -> tuple[torch.Tensor, torch.Tensor]:
        """u [N, d] -> (q [N, H, hd] per-head RMS-normalized and rotated, q latent [N, q_lora])."""
        qr = self.q_norm(self.wq_a(u))
        q = rms_norm(self.wq_b(qr).view(-1, self.heads, self.head_dim), None, self.eps)
        return self.rope.apply_(q, cs), qr

    @region
    def window_kv(self, u: torch.Tensor, cs) -> torch.Tensor:
        """Window KV [N, hd]: normalized, rotated, FP8-simulated NoPE dims, storage-rounded."""
        kv = self.rope.apply_(self.kv_norm(self.wkv(u)), cs)
        if self.fp8:
            kv = block_round(kv, "fp8", FP8_SIM_BLOCK, kv.shape[-1] - self.rope_dim)
        return kv_roundtrip(kv, self.kv_dtype)

    @region
    def main_rows(self, pooled: torch.Tensor, cs) -> torch.Tensor:
        """Finished compressed rows as stored in PAGE (storage-rounded), float32 -> dtype."""
        rows = self.compressor.rows(pooled, self.rope, cs).to(self.dtype)
        return kv_roundtrip(rows, self.kv_dtype)

    @region
    def attend(
        self,
        q: torch.Tensor,
        win_k: torch.Tensor,
        win_mask: torch.Tensor,
        comp: torch.Tensor | None,
        comp_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """q [T, H, hd]; window keys [Nw, hd] shared or [T, Nw, hd] per query, with mask
        [T, Nw]; compressed rows [R, hd] shared or [T, K, hd] per query, with mask [T, R] /
        [T, K]. The sink joins the denominator."""
        if invariant.enabled():
            return invariant_attention.sink_attention_rows(
                q, win_k, win_mask, comp, comp_mask, self.attn_sink, self.scale
            )
        win_eq = "thd,tnd->thn" if win_k.dim() == 3 else "thd,nd->thn"
        logits = [torch.einsum(win_eq, q, win_k).float() * self.scale]
        logits[0] = logits[0].masked_fill(~win_mask[:, None, :], NEG_INF)
        per_query = comp is not None and comp.dim() == 3
        if comp is not None:
            eq = "thd,tkd->thk" if per_query else "thd,kd->thk"
            sc = torch.einsum(eq, q, comp).float() * self.scale
            logits.append(sc.masked_fill(~comp_mask[:, None, :], NEG_INF))
        sink = self.attn_sink.view(1, -1, 1).expand(q.shape[0], -1, 1)
        probs = torch.softmax(torch.cat(logits + [sink], dim=-1), dim=-1).to(q.dtype)
        nw = win_k.shape[-2]
        pv_eq = "thn,tnd->thd" if win_k.dim() == 3 else "thn,nd->thd"
        out = torch.einsum(pv_eq, probs[..., :nw], win_k)
        if comp is not None:
            eq = "thk,tkd->thd" if per_query else "thk,kd->thd"
            out = out + torch.einsum(eq, probs[..., nw:-1], comp)
        return out

    def output(self, o: torch.Tensor, cs) -> torch.Tensor:
        """Inverse RoPE at the query position (in place: ``o`` [N, H, hd] is the caller's
        attention output, read by nothing after), then the grouped output projection (under
        tensor parallelism: of this rank's groups, summed over the ranks in float32)."""
        return sum_partials(self._output_projection(o, cs), self.reduce_output)

    @region
    def _output_projection(self, o: torch.Tensor, cs) -> torch.Tensor:
        """``output`` on this rank: inverse RoPE, the grouped then the second projection."""
        o = self.rope.apply_(o, cs, inverse=True)
        n = o.shape[0]
        w = self.wo_a.weight.view(self.groups, self.o_lora_rank, -1)
        mid = invariant.grouped_linear(o.reshape(n, self.groups, -1), w).reshape(n, -1)
        return self.wo_b(mid)
