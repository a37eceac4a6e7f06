"""DeepSeek-V4.1's Engram, as the published inference code defines it: one module per engram
layer, and ``EngramHash``, the model's n-gram hashing of every engram layer at once.

Parameters carry the checkpoint's names under ``layers.{L}.engram.``:

* ``embed.weight`` [rows, head_dim]: the hashed n-gram table, in the compute dtype (the
  published checkpoint stores it as FP8 E4M3 with ``embed.scale`` [rows, head_dim / 32] E8M0
  exponents; ``dequantise_rows`` decodes that form, exactly, since an e4m3 value times a
  power of two is representable in bf16);
* ``wkv.weight`` [(hc + 1) * dim, n_hash_cols * head_dim] (FP8 with [32, 32] block scales in
  the checkpoint);
* ``q_weight``, ``k_weight`` [hc, dim] float32.

The row ids come from ``EngramHash`` (``atom.models.deepseek_v41.ngram_hash`` holds the layout,
the token map and the hashing).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from atom.kernels import invariant
from atom.kernels.fp8_gemm import fp8_act_round
from atom.models.common.layers import Linear
from atom.models.common.promoted import promoted
from atom.models.deepseek_v41.ngram_hash import (
    BEFORE_START,
    SCALE_BLOCK,
    EngramSpec,
    NgramHasher,
)
from atom.models.deepseek_v41.token_map import identity_token_map

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


class Engram(nn.Module):
    """The published V4.1 Engram: hashed n-gram rows gated into every hyper-connection stream.

    ``rows`` is the table's row count (``engram_num_embeddings[l]``), ``n_hash_cols`` =
    (max_ngram_size - 1) * n_heads, ``eps`` the model's ``rms_norm_eps``. ``act_fp8`` rounds
    wkv's input as the published FP8 GEMM does (``atom.kernels.fp8_gemm.fp8_act_round``:
    ``fp8_act_sim``'s bits).
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
        self.eps, self.act_fp8, self.dtype = eps, act_fp8, dtype
        self.embed = nn.Embedding(rows, head_dim, dtype=dtype, device=device)
        self.wkv = Linear(
            n_hash_cols * head_dim, (hc + 1) * dim, bias=False, dtype=dtype, device=device
        )
        self.q_weight = nn.Parameter(torch.ones(hc, dim, dtype=torch.float32, device=device))
        self.k_weight = nn.Parameter(torch.ones(hc, dim, dtype=torch.float32, device=device))
        # tensor parallelism (``tp_narrow``): joins the ranks' columns of looked-up rows
        self.gather_rows: Callable[[torch.Tensor], torch.Tensor] | None = None

    def tp_splits(self) -> dict[str, int]:
        """What the ranks split (``atom.models.common.tensor_parallel``): the table by columns
        (each rank holds every row's head_dim / N values, and with them whole scale groups
        of 32 at stored precision). The table is most of the published model's bytes
        (hundreds of millions of rows per engram layer), so holding it whole on every rank
        would not fit; split by columns rather than rows, every rank looks up the same row
        ids and the ranks' parts concatenate, exactly, into the unsplit rows (no padding: a
        row count need not divide, head_dim does). wkv and the gate stay whole."""
        return {"embed.weight": 1}

    def tp_narrow(self, world: int, reduce, gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Look up this rank's columns; ``gather`` concatenates the ranks' in rank order."""
        if gather is None and reduce is not None:
            raise ValueError("a split Engram needs the ranks' gather")
        self.gather_rows = gather

    def wkv_input(self, e: torch.Tensor) -> torch.Tensor:
        """wkv's activations [N, n_hash_cols * head_dim], rounded with ``act_fp8`` (per 32
        values, UE8M0 scales) as the reference's FP8 GEMM rounds them; ``e`` is not mutated."""
        return fp8_act_round(e, SCALE_BLOCK) if self.act_fp8 else e

    def forward(
        self, x: torch.Tensor, row_ids: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [N, hc, dim] streams, row_ids [N, n_hash_cols] int64 -> [N, hc, dim], x's dtype:
        X_c + gate_c * value, gate_c = sigmoid(signed sqrt(<X_c, q_weight_c k_weight_c, key_c>
        / (rms(X_c) rms(key_c) sqrt(dim)))), each stream copy normalised on its own.

        ``token_mask`` [N] bool (optional): False forces the gate to 0 there (image positions),
        so those streams come back unchanged. Nothing is mutated.
        """
        n = x.shape[0]
        if x.shape[1:] != (self.hc, self.dim) or row_ids.shape != (n, self.n_hash_cols):
            raise ValueError(f"x {tuple(x.shape)} / row_ids {tuple(row_ids.shape)} mismatch")
        e = self.embed(row_ids)
        if self.gather_rows is not None:  # this rank's columns -> every rank's, in rank order
            e = self.gather_rows(e)
        e = e.flatten(1).to(self.dtype)
        kv = self.wkv(self.wkv_input(e))
        key, value = kv.split([self.hc * self.dim, self.dim], dim=-1)
        key = key.float().view(n, self.hc, self.dim)
        h = x.float()
        qw, kw = self.q_weight, self.k_weight
        weight = promoted(self, "gate_weight", lambda: qw.float() * kw.float(), qw, kw)
        rstd = torch.rsqrt(invariant.mean(h.square(), -1) + self.eps) * torch.rsqrt(
            invariant.mean(key.square(), -1) + self.eps
        )
        dot = invariant.sum(h * weight * key, -1) * rstd * self.dim**-0.5
        gate = invariant.pointwise(
            torch.sigmoid, torch.copysign(dot.abs().clamp_min(GATE_DOT_FLOOR).sqrt(), dot)
        )
        if token_mask is not None:
            gate = gate.masked_fill(~token_mask.bool()[:, None], 0.0)
        return (h + gate[..., None] * value.float()[:, None, :]).to(x.dtype)


class EngramHash(nn.Module):
    """The n-gram row ids of every engram layer, from the model's n-gram windows.

    ``rows(grams)``: grams [N, 4] int64, the token ids at t-3 .. t (-1 before the sequence, as
    the paged forward's plan and the reference build them) -> [N, layers, n_hash_cols]. Token
    ids are mapped through the compressed token map (``set_token_map``; the identity over the
    vocabulary until a checkpoint's tokenizer gives another), and -1 becomes ``BEFORE_START``.
    The tables live in non-persistent buffers, so they follow ``.to()``; ``build`` recreates
    them (after a model built on ``meta`` is materialized).
    """

    def __init__(self, spec: EngramSpec, vocab_size: int, device=None) -> None:
        super().__init__()
        self.spec, self.vocab_size = spec, vocab_size
        # the identity serves a model whose compressed vocabulary is its vocabulary (the
        # presets); a published model's comes from its tokenizer (``set_token_map``, which its
        # loader calls: ``token_map.attach_token_map``), and until then ``rows`` refuses
        same = spec.compressed_vocab_size == vocab_size
        self._token_map = identity_token_map(vocab_size) if same else None
        self.hasher = None
        self.build(device)

    @property
    def needs_token_map(self) -> bool:
        return self._token_map is None

    def set_token_map(self, token_map: tuple[list[int], int]) -> None:
        """Use a compressed token map (lookup over the whole vocabulary, size); its size must
        be ``engram_compressed_vocab_size``."""
        if len(token_map[0]) != self.vocab_size:
            raise ValueError(
                f"the compressed token map covers {len(token_map[0])} token ids, the model's "
                f"vocabulary has {self.vocab_size}"
            )
        self._token_map = token_map
        self.build(self.lookup.device if self.hasher is not None else self._device)

    def build(self, device=None) -> None:
        """(Re)build the tables on ``device`` (computed on the host; on ``meta`` they keep only
        their shapes, and a model built there calls ``build`` again once materialized)."""
        self._device = device
        if self._token_map is None:  # built once a map is set
            return
        hasher = NgramHasher(self.spec, self._token_map, device="cpu")
        if device is not None:  # on meta: shapes only (tracing), rebuilt once materialized
            for name in ("lookup", "primes", "offsets", "multipliers"):
                setattr(hasher, name, getattr(hasher, name).to(device))
        self.hasher = hasher
        for name in ("lookup", "primes", "offsets", "multipliers"):
            self.register_buffer(name, getattr(hasher, name), persistent=False)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        if self.hasher is not None:
            for name in ("lookup", "primes", "offsets", "multipliers"):
                setattr(self.hasher, name, getattr(self, name))
        return out

    def rows(self, grams: torch.Tensor) -> torch.Tensor:
        if self.hasher is None:
            raise RuntimeError(
                f"this model's Engram hashes n-grams over a compressed vocabulary of "
                f"{self.spec.compressed_vocab_size} ids (engram_compressed_vocab_size), not its "
                f"{self.vocab_size} token ids: it needs its tokenizer's compressed token map, "
                "which loading the checkpoint with its tokenizer.json sets"
            )
        m1 = self.spec.max_ngram_size - 1
        window = grams[:, grams.shape[1] - 1 - m1 :]
        cids = torch.where(window >= 0, self.lookup[window.clamp(min=0)], BEFORE_START)
        return self.hasher.rows(cids[:, -1], cids[:, :-1])
