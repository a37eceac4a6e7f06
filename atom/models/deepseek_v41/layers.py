"""Per-token building blocks of V4.1: RMSNorm, mHC residual streams, MoE, Engram.

Each is position-local (Engram reads the n-gram ids it is given), so the paged forward and the
reference forward share them unchanged.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from atom.kernels.engram import engram_kernel_usable, engram_rows, engram_rows_torch
from atom.kernels.moe_combine import moe_combine
from atom.kernels.norm import hc_post, hc_pre, rms_norm
from atom.kernels.sinkhorn import sinkhorn
from atom.models.deepseek_v41.config import V41Config

__all__ = ["rms_norm", "RMSNorm", "HyperConnection", "MoE", "Engram", "linear"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def linear(in_f: int, out_f: int, dtype: torch.dtype) -> nn.Linear:
    return nn.Linear(in_f, out_f, bias=False, dtype=dtype)


class HyperConnection(nn.Module):
    """mHC: mixes ``hc`` residual streams around one sublayer (or, with ``head=True``, reads
    them for the LM head).

    From RMS-normalized flat(X), a linear map gives pre (hc), post (hc) and a hc x hc matrix C,
    made doubly stochastic by row softmax + eps and ``iters`` rounds of column/row
    normalization. The sublayer sees sum_b pre_b X_b; X_j <- post_j * out + sum_i C_ij X_i.
    """

    def __init__(self, config: V41Config, dtype: torch.dtype, head: bool = False):
        super().__init__()
        hc, d = config.hc_mult, config.hidden_size
        self.hc, self.head = hc, head
        self.iters, self.eps, self.norm_eps = config.hc_sinkhorn_iters, config.hc_eps, 1e-6
        n_out = hc if head else 2 * hc + hc * hc
        self.fn = linear(hc * d, n_out, dtype)
        self.bias = nn.Parameter(torch.zeros(n_out, dtype=torch.float32))

    def _mix(self, x: torch.Tensor) -> torch.Tensor:
        flat = rms_norm(x.flatten(1), None, self.norm_eps)
        return self.fn(flat).float() + self.bias

    def pre(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """x [N, hc, d] -> (sublayer input [N, d], post [N, hc], C [N, hc, hc])."""
        hc = self.hc
        mix = self._mix(x)
        pre = torch.sigmoid(mix[:, :hc]) + 1e-6
        h = hc_pre(x, pre)
        if self.head:
            return h, None, None
        post = 2 * torch.sigmoid(mix[:, hc : 2 * hc])
        return h, post, sinkhorn(mix[:, 2 * hc :], hc, self.iters, self.eps)

    @staticmethod
    def post(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, c: torch.Tensor):
        """X_j = post_j * out + sum_i C_ij X_i."""
        return hc_post(x, out, post, c)


class Expert(nn.Module):
    """Clamped SwiGLU: down(silu(min(gate, L)) * clamp(up, -L, L))."""

    def __init__(self, d: int, inter: int, limit: float, dtype: torch.dtype):
        super().__init__()
        self.limit = limit
        self.gate_proj = linear(d, inter, dtype)
        self.up_proj = linear(d, inter, dtype)
        self.down_proj = linear(inter, d, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gate_proj(x).clamp(max=self.limit)
        u = self.up_proj(x).clamp(-self.limit, self.limit)
        return self.down_proj(F.silu(g) * u)


class MoEGate(nn.Module):
    def __init__(self, config: V41Config, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(config.n_routed_experts, config.hidden_size, dtype=dtype)
        )
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(config.n_routed_experts, dtype=torch.float32)
        )


class MoE(nn.Module):
    """Routed experts (top-k on sqrt(softplus) scores + bias) plus shared experts.

    Two ways to run the routed experts, same math: *routed* sends each expert its tokens (one
    host sync per layer, for the counts); *dense* runs every expert on every token as three
    batched matmuls and weights the outputs by the (mostly zero) routing matrix. Dense is used
    for small batches that would touch most experts anyway (``n * top_k >= experts`` and
    ``n <= DENSE_MAX_TOKENS``: decode), where it reads the same weights with no sync and a
    handful of launches instead of ten per expert. On CUDA bf16 the routed experts run as
    grouped GEMMs with no sync instead (``_grouped``, same math).
    """

    DENSE_MAX_TOKENS = 64

    def __init__(self, config: V41Config, dtype: torch.dtype):
        super().__init__()
        d, inter = config.hidden_size, config.moe_intermediate_size
        self.top_k, self.scale = config.num_experts_per_tok, config.routed_scaling_factor
        self.limit = config.swiglu_limit
        self.gate = MoEGate(config, dtype)
        self.experts = nn.ModuleList(
            Expert(d, inter, config.swiglu_limit, dtype) for _ in range(config.n_routed_experts)
        )
        self.shared_experts = Expert(d, inter * config.n_shared_experts, config.swiglu_limit, dtype)
        self._stack: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # tensor parallelism (``atom.distributed``): this rank holds a slice of every expert's
        # intermediate dimension, and this sums the ranks' float32 partial outputs
        self.reduce_output: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(x, *self.route(x))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [N, top_k], weights [N, top_k] float32) of each token."""
        scores = torch.sqrt(F.softplus(F.linear(x, self.gate.weight).float()))
        biased = scores + self.gate.e_score_correction_bias
        # ties go to the smaller expert id, identically in every path
        idx = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, : self.top_k]
        w = scores.gather(1, idx)
        return idx, w / w.sum(-1, keepdim=True) * self.scale

    def path(self, n: int, x: torch.Tensor) -> str:
        """How ``mix`` runs the routed experts of ``n`` tokens like ``x`` (dtype, device):
        "dense", "grouped" (both without host sync) or "loop" (one host sync per layer)."""
        if n * self.top_k >= len(self.experts) and n <= self.DENSE_MAX_TOKENS:
            return "dense"
        return "grouped" if _grouped_mm_usable(x) else "loop"

    def mix(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The shared expert plus the routed experts ``idx`` weighted by ``w`` (under tensor
        parallelism: this rank's slice of each, summed over the ranks in float32)."""
        out = self._mix_float(x, idx, w)
        if self.reduce_output is not None:
            out = self.reduce_output(out)
        return out.to(x.dtype)

    def _mix_float(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        shared = self.shared_experts(x)
        path = self.path(x.shape[0], x)
        if path == "grouped":
            try:
                y, order = self._grouped(x, idx)
            except RuntimeError as e:  # an unsupported shape or build: the loop, from now on
                _GROUPED_MM["failed"] = f"{type(e).__name__}: {e}"
            else:
                # each token's top_k weighted outputs summed in slot order: an ``index_add_``
                # of the sorted rows would add them with atomics, in an order that changes from
                # run to run (and with it, in bfloat16, an output now and then)
                return moe_combine(shared, y, order, w)
        out = shared.float()
        if path == "dense":
            return out + self._dense(x, idx, w)
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)  # token rows grouped by expert, rows ascending
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()  # the one sync
        rows, slot = order // self.top_k, order % self.top_k
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                r = rows[start : start + count]
                y = expert(x.index_select(0, r)).float() * w[r, slot[start : start + count], None]
                out.index_add_(0, r, y)
                start += count
        return out

    def _grouped(self, x: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed experts as three grouped GEMMs over the token rows sorted by expert
        (``torch._grouped_mm``): the group offsets stay on the device, so no host sync.
        Returns (outputs [N * top_k, d] in expert order, order: row i is token order[i] //
        top_k's slot order[i] % top_k), for ``moe_combine`` (one kernel on CUDA with
        ``ATOM_TRITON_ON=moe_combine``)."""
        gate, up, down = self.stacked_weights()
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)  # token rows grouped by expert, rows ascending
        counts = torch.zeros(gate.shape[0], dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        rows = order // self.top_k
        xs = x.index_select(0, rows)
        g = torch._grouped_mm(xs, gate.transpose(1, 2), offs=offs).clamp(max=self.limit)
        u = torch._grouped_mm(xs, up.transpose(1, 2), offs=offs).clamp(-self.limit, self.limit)
        return torch._grouped_mm(F.silu(g) * u, down.transpose(1, 2), offs=offs), order

    def _dense(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.stacked_weights()
        xb = x.unsqueeze(0).expand(gate.shape[0], -1, -1)
        g = torch.bmm(xb, gate.transpose(1, 2)).clamp(max=self.limit)
        u = torch.bmm(xb, up.transpose(1, 2)).clamp(-self.limit, self.limit)
        y = torch.bmm(F.silu(g) * u, down.transpose(1, 2)).float()  # [E, n, d]
        route = torch.zeros(x.shape[0], gate.shape[0], dtype=torch.float32, device=x.device)
        route.scatter_(1, idx, w)
        return (y * route.t()[:, :, None]).sum(0)

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert weights as [E, ...] tensors. Without autograd, the experts' parameters are
        made views of one stacked tensor each (no second copy; loads and in-place updates show
        through); restacked if the parameters were replaced (``.to()``, a new ``.data``)."""
        per = [(e.gate_proj.weight, e.up_proj.weight, e.down_proj.weight) for e in self.experts]
        if torch.is_grad_enabled() and per[0][0].requires_grad:
            return tuple(torch.stack(ws) for ws in zip(*per))  # differentiable (training)
        stack = self._stack
        if stack is None or any(
            p.data_ptr() != s[i].data_ptr() or p.device != s.device
            for i, ps in enumerate(per)
            for p, s in zip(ps, stack)
        ):
            stack = tuple(torch.stack([p.detach() for p in ws]) for ws in zip(*per))
            for i, ps in enumerate(per):
                for p, s in zip(ps, stack):
                    p.data = s[i]
            self._stack = stack
        return stack


_GROUPED_MM: dict[object, object] = {"failed": None}


def _grouped_mm_usable(x: torch.Tensor) -> bool:
    """The routed experts run as grouped GEMMs (no host sync) on CUDA bf16 where torch has
    ``_grouped_mm`` (sm90+); ``ATOM_GROUPED_MM=0`` turns it off, and a failed call turns it off
    for the process (``_GROUPED_MM["failed"]`` says why). Elsewhere the per-expert loop runs,
    with its one host sync per layer (the expert counts)."""
    if x.device.type not in ("cuda", "meta") or x.dtype != torch.bfloat16:
        return False
    if torch.is_grad_enabled():
        return False
    if _GROUPED_MM["failed"] or os.environ.get("ATOM_GROUPED_MM", "1") == "0":
        return False
    if x.device.type == "meta":  # shape tracing (tests/model/test_host_syncs.py)
        return hasattr(torch, "_grouped_mm")
    key = ("cap", x.device.index)
    if key not in _GROUPED_MM:
        _GROUPED_MM[key] = hasattr(torch, "_grouped_mm") and (
            torch.cuda.get_device_capability(x.device) >= (9, 0)
        )
    return bool(_GROUPED_MM[key])


def _primes_below(n: int, count: int) -> list[int]:
    out, k = [], n
    while len(out) < count and k >= 2:
        if all(k % p for p in range(2, int(math.isqrt(k)) + 1)):
            out.append(k)
        k -= 1
    if len(out) < count:
        raise ValueError(f"engram_table_size={n} leaves fewer than {count} primes for the heads")
    return out


ENGRAM_HASH_MASK = (1 << 40) - 1


class Engram(nn.Module):
    """Hashed n-gram memory gated into every stream, before its layer's block.

    For orders 2..max_ngram, the last n token ids (mapped into a compressed vocabulary by the
    fixed ``vocab_map`` table) are hashed with a rolling multiply-XOR, per head with its own odd
    multiplier, modulo that head's prime table size. A -1 anywhere in the n ids (before the
    sequence start) drops that n-gram. State across forwards: the last 3 token ids.
    """

    def __init__(self, config: V41Config, layer: int, dtype: torch.dtype):
        super().__init__()
        d = config.hidden_size
        self.orders = list(range(2, config.engram_max_ngram + 1))
        heads = config.engram_n_heads
        n_tables = len(self.orders) * heads
        self.sizes = _primes_below(config.engram_table_size, n_tables)
        self.multipliers = [
            ((0x9E3779B1 * (layer * 131 + k + 1)) & 0x3FFFFF) | 1 for k in range(n_tables)
        ]
        self.heads, self.de, self.eps = heads, config.engram_embed_dim, config.rms_norm_eps
        ids = torch.arange(config.vocab_size, dtype=torch.int64)
        vmap = (ids * 0x9E3779B1 + layer) % config.engram_vocab_size
        self.register_buffer("vocab_map", vmap)
        self.tables = nn.ModuleList(nn.Embedding(size, self.de, dtype=dtype) for size in self.sizes)
        self.key_proj = linear(n_tables * self.de, d, dtype)
        self.value_proj = linear(n_tables * self.de, d, dtype)
        self.key_norm = RMSNorm(d, config.rms_norm_eps, dtype)
        self._stack: tuple[torch.Tensor, torch.Tensor, list[int]] | None = None

    def rows(self, cid: torch.Tensor) -> torch.Tensor:
        """Every table's hashed row of each token [N, tables * de] (``engram_rows_torch``),
        in one kernel on CUDA over the tables stacked into one tensor."""
        weights = [t.weight for t in self.tables]
        if not engram_kernel_usable(cid, weights[0]):
            return engram_rows_torch(
                cid,
                weights,
                self.orders,
                self.heads,
                self.multipliers,
                self.sizes,
                ENGRAM_HASH_MASK,
            )
        return engram_rows(cid, *self._stacked(weights), ENGRAM_HASH_MASK)

    def _stacked(self, weights: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(tables [sum of sizes, de], meta [4, tables] on their device): the tables' weights
        are made views of one stacked tensor (no second copy; loads show through), restacked
        if a weight was replaced (``MoE.stacked_weights`` does the same for experts)."""
        got = self._stack
        if got is not None:
            table, meta, bases = got
            if table.device == weights[0].device and all(
                w.data_ptr() == table[b].data_ptr() for w, b in zip(weights, bases)
            ):
                return table, meta
        table = torch.cat([w.detach() for w in weights])
        bases = [sum(self.sizes[:k]) for k in range(len(weights))]
        for w, b, size in zip(weights, bases, self.sizes):
            w.data = table[b : b + size]
        orders = [n for n in self.orders for _ in range(self.heads)]
        meta = torch.tensor([self.multipliers, self.sizes, bases, orders], dtype=torch.int64)
        self._stack = (table, meta.to(table.device), bases)
        return self._stack[:2]

    def forward(self, x: torch.Tensor, grams: torch.Tensor) -> torch.Tensor:
        """x [N, hc, d]; grams [N, 4] token ids at t-3..t (-1 = before the sequence)."""
        cid = torch.where(grams >= 0, self.vocab_map[grams.clamp(min=0)], -1)
        e = self.rows(cid)
        key = self.key_norm(self.key_proj(e)).float()
        value = self.value_proj(e).float()
        xs = rms_norm(x, None, self.eps).float()
        gate = torch.sigmoid((xs * key[:, None, :]).sum(-1) / math.sqrt(x.shape[-1]))
        return (x.float() + gate[:, :, None] * value[:, None, :]).to(x.dtype)
