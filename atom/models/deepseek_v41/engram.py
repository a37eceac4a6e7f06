"""DeepSeek-V4.1 Engram module (one per engram layer), as the published inference code defines it.

Parameters carry the checkpoint's names under ``layers.{L}.engram.``:

* ``embed.weight`` [rows, head_dim] float8_e4m3fn and ``embed.scale`` [rows, head_dim / 32]
  E8M0 (one exponent byte per 32 values: 2^(byte - 127));
* ``wkv.weight`` [(hc + 1) * dim, n_hash_cols * head_dim] in the compute dtype (the checkpoint
  stores it FP8 with [32, 32] block scales; dequantising it on load is the loader's job);
* ``q_weight``, ``k_weight`` [hc, dim] float32.

The row ids come from :class:`atom.models.deepseek_v41.ngram_hash.NgramHasher` (one engram
layer's slice ``rows[:, layer_index, :]``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from atom.models.common.formats import fp8_act_sim
from atom.models.deepseek_v41.ngram_hash import SCALE_BLOCK

# E8M0 has no dedicated dtype on older torch: fall back to raw bytes (same storage).
E8M0_DTYPE: torch.dtype = getattr(torch, "float8_e8m0fnu", torch.uint8)

# Floor of |dot| under the gate's square root: keeps the sqrt's slope finite at 0.
GATE_DOT_FLOOR = 1e-6


def _e8m0_table(device: torch.device) -> torch.Tensor:
    # 2^(b - 127) for every byte, exact in float32 (b = 0 is the subnormal 2^-127); byte 255 is
    # the format's NaN.
    values = [math.ldexp(1.0, b - 127) for b in range(255)] + [math.nan]
    return torch.tensor(values, dtype=torch.float32, device=device)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """float32 values (same shape) of E8M0 scales stored as ``E8M0_DTYPE`` or uint8 bytes."""
    raw = scale.view(torch.uint8).long()
    return _e8m0_table(scale.device)[raw]


def dequantise_rows(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """bf16 [..., D] of FP8 rows ``weight`` [..., D] with E8M0 ``scale`` [..., D / 32].

    Each group of 32 consecutive values is multiplied by its scale in float32, then rounded to
    bf16 as the reference does. That rounding is exact: an e4m3 value has 4 significant bits,
    a power-of-two scale only moves its exponent, and bf16 has 8 significant bits and float32's
    exponent range, so the product is representable unless it leaves the normal range (|v| >
    bf16 max, or a nonzero |v| < 2^-126 with bits below bf16's subnormal step), which no
    sensibly scaled table reaches.
    """
    d = weight.shape[-1]
    if d % SCALE_BLOCK or scale.shape[-1] * SCALE_BLOCK != d:
        raise ValueError(f"scale {tuple(scale.shape)} does not cover rows of width {d}")
    values = weight.view(torch.float8_e4m3fn).float().unflatten(-1, (-1, SCALE_BLOCK))
    return (values * e8m0_to_float(scale)[..., None]).flatten(-2).to(torch.bfloat16)


class EngramTable(nn.Module):
    """One engram layer's FP8 row table: ``weight`` [rows, head_dim], ``scale`` [rows, hd/32]."""

    def __init__(self, rows: int, head_dim: int, device: torch.device | str | None = None):
        super().__init__()
        if head_dim % SCALE_BLOCK:
            raise ValueError(f"head_dim {head_dim} is not a multiple of {SCALE_BLOCK}")
        self.rows, self.head_dim = rows, head_dim
        weight = torch.zeros(rows, head_dim, dtype=torch.float8_e4m3fn, device=device)
        # Byte 127 is a scale of 1.
        scale = torch.full((rows, head_dim // SCALE_BLOCK), 127, dtype=torch.uint8, device=device)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scale = nn.Parameter(scale.view(E8M0_DTYPE), requires_grad=False)

    def lookup(self, row_ids: torch.Tensor) -> torch.Tensor:
        """bf16 [*row_ids.shape, head_dim] dequantised rows; ``row_ids`` int64 in [0, rows)."""
        flat = row_ids.reshape(-1)
        # Gather raw bytes: indexing float8 dtypes is not implemented on every backend.
        weight = self.weight.view(torch.uint8)[flat]
        scale = self.scale.view(torch.uint8)[flat]
        return dequantise_rows(weight, scale).reshape(*row_ids.shape, self.head_dim)


class PublishedEngram(nn.Module):
    """The published V4.1 Engram: hashed n-gram rows gated into every hyper-connection stream.

    ``rows`` is the checkpoint table's row count (``engram_num_embeddings[l]``), ``n_hash_cols``
    = (max_ngram_size - 1) * n_heads, ``eps`` the model's ``rms_norm_eps``. ``act_fp8`` makes
    wkv's input go through the FP8 activation simulation (per 32 values, UE8M0 scales) that the
    reference's FP8 GEMM applies (``atom.models.common.formats.fp8_act_sim``); the default
    False feeds wkv the bf16 rows unrounded.
    """

    def __init__(
        self,
        *,
        dim: int,
        hc: int,
        rows: int,
        head_dim: int,
        n_hash_cols: int,
        eps: float,
        dtype: torch.dtype = torch.bfloat16,
        act_fp8: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.dim, self.hc, self.head_dim, self.n_hash_cols = dim, hc, head_dim, n_hash_cols
        self.eps, self.act_fp8 = eps, act_fp8
        self.embed = EngramTable(rows, head_dim, device=device)
        self.wkv = nn.Linear(
            n_hash_cols * head_dim, (hc + 1) * dim, bias=False, dtype=dtype, device=device
        )
        self.q_weight = nn.Parameter(
            torch.ones(hc, dim, dtype=torch.float32, device=device), requires_grad=False
        )
        self.k_weight = nn.Parameter(
            torch.ones(hc, dim, dtype=torch.float32, device=device), requires_grad=False
        )

    def wkv_input(self, e: torch.Tensor) -> torch.Tensor:
        """Hook for wkv's activations [N, n_hash_cols * head_dim] (compute dtype).

        With ``act_fp8`` they are rounded (per 32 values, UE8M0 scales) as the reference's FP8
        GEMM rounds them; a new tensor is returned, ``e`` is not mutated.
        """
        return fp8_act_sim(e, block=SCALE_BLOCK) if self.act_fp8 else e

    def forward(
        self, x: torch.Tensor, row_ids: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [N, hc, dim] streams, row_ids [N, n_hash_cols] int64 -> [N, hc, dim], x's dtype.

        ``token_mask`` [N] bool (optional): False forces the gate to 0 there (image positions),
        so those streams come back unchanged. Nothing is mutated.
        """
        n = x.shape[0]
        if x.shape[1:] != (self.hc, self.dim) or row_ids.shape != (n, self.n_hash_cols):
            raise ValueError(f"x {tuple(x.shape)} / row_ids {tuple(row_ids.shape)} mismatch")
        e = self.embed.lookup(row_ids).flatten(1).to(self.wkv.weight.dtype)
        kv = self.wkv(self.wkv_input(e))
        key, value = kv.split([self.hc * self.dim, self.dim], dim=-1)
        key = key.float().view(n, self.hc, self.dim)
        h = x.float()
        weight = self.q_weight.float() * self.k_weight.float()
        # Each stream copy is normalised on its own (mean over dim only), as is its key.
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(
            key.square().mean(-1) + self.eps
        )
        dot = (h * weight * key).sum(-1) * rstd * self.dim**-0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_DOT_FLOOR).sqrt(), dot))
        if token_mask is not None:
            gate = gate.masked_fill(~token_mask.bool()[:, None], 0.0)
        return (h + gate[..., None] * value.float()[:, None, :]).to(x.dtype)
