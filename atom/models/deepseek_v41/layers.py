"""V4.1's Engram (RMSNorm, linears, mHC and the MoE are shared with V4: ``atom.models.common``).

Each is position-local (Engram reads the n-gram ids it is given), so the paged forward and the
reference forward share them unchanged.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from atom.kernels.engram import engram_kernel_usable, engram_rows, engram_rows_torch
from atom.models.common.layers import RMSNorm, linear, rms_norm
from atom.models.deepseek_v41.config import V41Config

__all__ = ["Engram"]


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
