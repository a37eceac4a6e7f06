"""DeepSeek-V4.1 Engram n-gram hashing, as the published inference code defines it.

Three pieces, all independent of atom's ``V41Config`` (they take an :class:`EngramSpec`):

* the **layout**: one prime bucket count per (engram layer, n-gram size, head), the offset of
  each bucket range inside its layer's table, and the per-layer odd hash multipliers;
* the **compressed token map** (``token_map``): token ids whose text normalises alike share one
  compressed id;
* the **hash** itself, with a resumable per-request state so that a request can be hashed in
  any chunking (prefill chunks, then one token per decode step) and give the same row ids.

State encoding (per request): the compressed ids of the ``max_ngram_size - 1`` positions just
before the next one to hash, oldest first. :data:`BEFORE_START` (-2) stands for a position
before the sequence start and :data:`DEAD` (-1) for a position that breaks the n-gram look-back
(image tokens). Both make that look-back shift, and every larger one, hash as the pad id; they
are kept distinct so a state says *why* it is blocked. The state at position 0 is all
:data:`BEFORE_START`.

Overflow: multipliers are drawn below ``int64_max // compressed_vocab_size``, so the product of
a compressed id (``< compressed_vocab_size``) and a multiplier never overflows int64; every
product is therefore nonnegative, and so are the XORs, which makes ``%`` an ordinary modulo
(torch's int64 ``%`` is a floor-mod, which agrees with numpy's and Python's on these values).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from atom.models.deepseek_v41.primes import next_prime

DEAD: int = -1
"""Compressed-id sentinel: a position that breaks the look-back (image tokens)."""

BEFORE_START: int = -2
"""Compressed-id sentinel, in states only: a position before the sequence start."""

# The published seed of layer L's multiplier generator is HASH_SEED_STRIDE * L.
HASH_SEED_STRIDE = 10007
# Scale blocks of the FP8 tables (and of the activation quantisation) are 32 wide.
SCALE_BLOCK = 32


@dataclass(frozen=True)
class EngramSpec:
    """The engram_* keys of the published ``config.json`` (``text_config``), as plain values.

    ``vocab_size`` is ``engram_vocab_size`` (where every prime search starts), not the model's
    vocabulary; ``pad_token_id`` is a *token* id (the inference code's ``engram_pad_id``), mapped
    through the compressed token map before it is used in a hash.
    """

    layer_ids: tuple[int, ...]
    num_embeddings: tuple[int, ...]
    max_ngram_size: int
    vocab_size: int
    n_heads: int
    head_dim: int
    pad_token_id: int
    compressed_vocab_size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", tuple(int(v) for v in self.layer_ids))
        object.__setattr__(self, "num_embeddings", tuple(int(v) for v in self.num_embeddings))
        if not self.layer_ids or len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"engram_layer_ids must be distinct and nonempty: {self.layer_ids}")
        if len(self.num_embeddings) != len(self.layer_ids):
            raise ValueError(
                f"engram_num_embeddings has {len(self.num_embeddings)} entries for "
                f"{len(self.layer_ids)} engram layers"
            )
        if self.max_ngram_size < 2:
            raise ValueError(f"engram_max_ngram_size must be >= 2, got {self.max_ngram_size}")
        if self.n_heads < 1 or self.vocab_size < 1 or self.compressed_vocab_size < 1:
            raise ValueError("engram_n_heads, engram_vocab_size, engram_compressed_vocab_size >= 1")
        if self.head_dim < 1 or self.head_dim % SCALE_BLOCK:
            raise ValueError(f"engram_head_dim must be a multiple of {SCALE_BLOCK}")

    @property
    def n_hash_cols(self) -> int:
        """Row ids per position and engram layer: (max_ngram_size - 1) * n_heads."""
        return (self.max_ngram_size - 1) * self.n_heads

    @classmethod
    def from_text_config(cls, cfg: Mapping[str, Any]) -> EngramSpec:
        """Read the engram_* keys of a published ``text_config`` dict.

        The pad id is ``engram_pad_token_id`` in config.json and ``engram_pad_id`` in the
        inference code's ModelArgs; either spelling is accepted (config.json's wins).
        """
        pad = cfg.get("engram_pad_token_id", cfg.get("engram_pad_id"))
        if pad is None:
            raise KeyError("engram_pad_token_id")
        return cls(
            layer_ids=tuple(cfg["engram_layer_ids"]),
            num_embeddings=tuple(cfg["engram_num_embeddings"]),
            max_ngram_size=int(cfg["engram_max_ngram_size"]),
            vocab_size=int(cfg["engram_vocab_size"]),
            n_heads=int(cfg["engram_n_heads"]),
            head_dim=int(cfg["engram_head_dim"]),
            pad_token_id=int(pad),
            compressed_vocab_size=int(cfg["engram_compressed_vocab_size"]),
        )


def spec_of(config: Any) -> EngramSpec | None:
    """The ``EngramSpec`` of a ``V41Config`` (None without engram layers), its
    ``engram_num_embeddings`` filled in as the primes' sums where the config leaves it out, and
    checked against the layout (refuses tables too small for their buckets)."""
    if not config.engram_layer_ids:
        return None
    comp = config.engram_compressed_vocab_size
    rows = config.engram_num_embeddings
    spec = EngramSpec(
        layer_ids=tuple(config.engram_layer_ids),
        num_embeddings=tuple(rows or [1] * len(config.engram_layer_ids)),
        max_ngram_size=config.engram_max_ngram_size,
        vocab_size=config.engram_vocab_size,
        n_heads=config.engram_n_heads,
        head_dim=config.engram_head_dim,
        pad_token_id=config.engram_pad_token_id,
        compressed_vocab_size=config.vocab_size if comp is None else comp,
    )
    if rows is None:
        sums = tuple(sum(sum(h) for h in layer) for layer in layer_primes(spec))
        spec = dataclasses.replace(spec, num_embeddings=sums)
    build_layout(spec)
    return spec


# ---------------------------------------------------------------------------------------------
# Layout


@dataclass(frozen=True)
class HashLayout:
    """Where every (engram layer, n-gram size, head) hash lands, and the hash multipliers.

    ``primes[l][i][h]`` is the bucket count of n-gram size ``i + 2``, head ``h``, in engram
    layer ``l`` (index into ``layer_ids``, not the layer id); ``offsets[l][i][h]`` is where that
    range starts in the layer's table (ranges concatenated i-major, head-minor);
    ``multipliers[l][shift]`` multiplies the compressed id ``shift`` positions back.
    Build it from a config with :func:`build_layout`; constructing one directly (any values) is
    meant for tests.
    """

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    primes: tuple[tuple[tuple[int, ...], ...], ...]
    offsets: tuple[tuple[tuple[int, ...], ...], ...]
    multipliers: tuple[tuple[int, ...], ...]

    @property
    def n_hash_cols(self) -> int:
        """Row ids per position and engram layer: (max_ngram_size - 1) * n_heads."""
        return (self.max_ngram_size - 1) * self.n_heads

    def table_rows(self, layer_index: int) -> int:
        """Rows the hash of engram layer ``layer_index`` can address (sum of its primes)."""
        return sum(sum(per_n) for per_n in self.primes[layer_index])


def layer_primes(spec: EngramSpec) -> list[list[list[int]]]:
    """``primes[l][i][h]``, drawn in the order layer, n-gram size, head and never repeated.

    Each (layer, n) search restarts at ``engram_vocab_size - 1`` and then continues from the
    prime it just took, skipping every prime already handed out anywhere in the model.
    """
    used: set[int] = set()
    primes: list[list[list[int]]] = []
    for _ in spec.layer_ids:
        per_layer = []
        for _ in range(spec.max_ngram_size - 1):
            current = spec.vocab_size - 1
            per_n = []
            for _ in range(spec.n_heads):
                current = next_prime(current)
                while current in used:
                    current = next_prime(current)
                used.add(current)
                per_n.append(current)
            per_layer.append(per_n)
        primes.append(per_layer)
    return primes


def layer_multipliers(layer_id: int, max_ngram_size: int, compressed_vocab_size: int) -> list[int]:
    """The published odd multipliers of engram layer ``layer_id`` (by id), one per shift.

    numpy's PCG64 ``default_rng`` is part of the definition: the trained tables were indexed
    with exactly these draws, so no other generator may stand in for it.
    """
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    draw = np.random.default_rng(HASH_SEED_STRIDE * layer_id).integers(
        low=0, high=bound, size=(max_ngram_size,), dtype=np.int64
    )
    return [int(v) * 2 + 1 for v in draw]


def build_layout(spec: EngramSpec) -> HashLayout:
    """The published layout of ``spec``.

    Raises ValueError when a layer's bucket ranges (the sum of its primes) do not fit in its
    checkpoint table (``engram_num_embeddings[l]`` rows).
    """
    primes = layer_primes(spec)
    offsets = []
    for index, per_layer in enumerate(primes):
        flat = [p for per_n in per_layer for p in per_n]
        if sum(flat) > spec.num_embeddings[index]:
            raise ValueError(
                f"engram layer {spec.layer_ids[index]}: hash ranges need {sum(flat)} rows "
                f"but engram_num_embeddings gives {spec.num_embeddings[index]}"
            )
        starts = [sum(flat[:k]) for k in range(len(flat))]
        h = spec.n_heads
        offsets.append(tuple(tuple(starts[i * h : (i + 1) * h]) for i in range(len(per_layer))))
    return HashLayout(
        layer_ids=spec.layer_ids,
        max_ngram_size=spec.max_ngram_size,
        n_heads=spec.n_heads,
        primes=tuple(tuple(tuple(per_n) for per_n in per_layer) for per_layer in primes),
        offsets=tuple(offsets),
        multipliers=tuple(
            tuple(layer_multipliers(layer, spec.max_ngram_size, spec.compressed_vocab_size))
            for layer in spec.layer_ids
        ),
    )


# ---------------------------------------------------------------------------------------------
# Hashing


def initial_state(max_ngram_size: int) -> tuple[int, ...]:
    """The state of a request at position 0: ``max_ngram_size - 1`` times BEFORE_START."""
    return (BEFORE_START,) * (max_ngram_size - 1)


def check_token_map_size(size: int, spec: EngramSpec) -> None:
    """Refuse a map whose size is not the config's ``engram_compressed_vocab_size``.

    Every multiplier's bound derives from that number, so a different map would silently hash
    every n-gram into the wrong rows instead of failing.
    """
    if size != spec.compressed_vocab_size:
        raise ValueError(
            f"compressed token map has {size} ids but engram_compressed_vocab_size is "
            f"{spec.compressed_vocab_size}"
        )


class NgramHasher:
    """Tensor hashing of every engram layer at once, with per-request resumable state.

    Holds the layout as int64 tensors on ``device`` and the compressed token map. Construction
    refuses a token map whose size differs from ``spec.compressed_vocab_size``. Nothing is
    mutated by any method: states are passed in and returned.

    Shapes (m = max_ngram_size, L = number of engram layers, C = (m - 1) * n_heads):
    compressed ids ``cids`` [N] int64 in [0, compressed_vocab_size) or DEAD; per-token history
    [N, m - 1] int64 (the ids of positions t-m+1 .. t-1, oldest first, sentinels allowed);
    request states [R, m - 1] int64 in the same encoding; row ids [N, L, C] int64, n-gram-size
    major, head minor, already offset into the layer's table.
    """

    def __init__(
        self,
        spec: EngramSpec,
        token_map: tuple[Sequence[int], int],
        layout: HashLayout | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        lookup, size = token_map
        check_token_map_size(size, spec)
        self.spec = spec
        self.layout = build_layout(spec) if layout is None else layout
        if self.layout.max_ngram_size != spec.max_ngram_size:
            raise ValueError("layout and spec disagree on max_ngram_size")
        self.lookup = torch.as_tensor(list(lookup), dtype=torch.int64, device=device)
        if self.lookup.numel() and (self.lookup.min() < 0 or self.lookup.max() >= size):
            raise ValueError(f"compressed token map has ids outside [0, {size})")
        # The pad is a compressed id: the map applied to the configured pad *token*.
        self.pad = int(self.lookup[spec.pad_token_id])
        self.primes = torch.tensor(self.layout.primes, dtype=torch.int64, device=device)
        self.offsets = torch.tensor(self.layout.offsets, dtype=torch.int64, device=device)
        self.multipliers = torch.tensor(self.layout.multipliers, dtype=torch.int64, device=device)

    @property
    def history_len(self) -> int:
        """m - 1: compressed ids a state (and a per-token history) holds."""
        return self.spec.max_ngram_size - 1

    def initial_states(self, n: int) -> torch.Tensor:
        """[n, m - 1] int64 states of n requests at position 0 (all BEFORE_START)."""
        return torch.full(
            (n, self.history_len), BEFORE_START, dtype=torch.int64, device=self.lookup.device
        )

    def compress(self, token_ids: torch.Tensor, dead: torch.Tensor | None = None) -> torch.Tensor:
        """Compressed ids (same shape, int64) of ``token_ids``; DEAD where ``dead`` is True."""
        cids = self.lookup[token_ids.long()]
        return cids if dead is None else torch.where(dead, DEAD, cids)

    def histories(
        self, cids: torch.Tensor, states: torch.Tensor, lengths: torch.Tensor | Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(history [N, m-1], new_states [R, m-1]) for a flat batch of R request spans.

        ``cids`` [N] holds the spans back to back (request r owns ``lengths[r]`` entries, in
        order, sum of lengths = N; a length may be 0); ``states`` [R, m-1] is each request's
        state at its span start. ``history[k]`` are the m-1 compressed ids before token k and
        ``new_states[r]`` the state at request r's span end. Inputs are not mutated.
        """
        m1 = self.history_len
        lengths = torch.as_tensor(lengths, dtype=torch.int64, device=cids.device)
        starts = torch.cumsum(lengths, 0) - lengths
        owner = torch.repeat_interleave(torch.arange(lengths.numel(), device=cids.device), lengths)
        local = torch.arange(cids.numel(), device=cids.device) - starts[owner]
        history = self._window(cids, states, owner, starts[owner], local)
        ends = torch.arange(lengths.numel(), device=cids.device)
        new_states = self._window(cids, states, ends, starts, lengths)
        assert history.shape == (cids.numel(), m1)
        return history, new_states

    def _window(
        self,
        cids: torch.Tensor,
        states: torch.Tensor,
        req: torch.Tensor,
        start: torch.Tensor,
        local: torch.Tensor,
    ) -> torch.Tensor:
        # Request r's extended sequence is state[r] ++ its span; the m-1 ids before local
        # position p are entries p .. p+m-2 of it: the first m-1 entries come from the state.
        m1 = self.history_len
        idx = local[:, None] + torch.arange(m1, device=cids.device)[None, :]
        from_state = idx < m1
        state_vals = states[req[:, None], idx.clamp(max=m1 - 1)]
        if cids.numel() == 0:
            return state_vals
        # Entries taken from the state index below the span start; clamp them to a valid slot.
        span_vals = cids[(start[:, None] + idx - m1).clamp(min=0)]
        return torch.where(from_state, state_vals, span_vals)

    def rows(self, cids: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """Row ids [N, L, C] int64 of tokens ``cids`` [N] with per-token ``history`` [N, m-1].

        Look-back ``shift`` reads ``cids`` (shift 0) or ``history[:, m-1-shift]``; once one is
        DEAD or BEFORE_START (any negative id), it and every larger shift hash as the pad.
        Preconditions (not checked, to stay free of host syncs): nonnegative ids are below
        ``compressed_vocab_size``.
        """
        m = self.spec.max_ngram_size
        looks = torch.cat([cids[:, None], history.flip(-1)], dim=1)  # [N, m], shift-major
        blocked = torch.cumsum((looks < 0).to(torch.int32), dim=1) > 0  # cumulative
        tokens = torch.where(blocked, self.pad, looks)
        products = tokens[:, None, :] * self.multipliers[None, :, :]  # [N, L, m]
        rolling = products[..., 0]
        out = []
        for shift in range(1, m):
            rolling = torch.bitwise_xor(rolling, products[..., shift])
            # Nonnegative operands: torch's floor-mod is the plain modulo here.
            out.append(rolling[:, :, None] % self.primes[None, :, shift - 1, :])
        rows = torch.stack(out, dim=2) + self.offsets[None]  # [N, L, m-1, H]
        return rows.flatten(2)

    def hash_batch(
        self, cids: torch.Tensor, states: torch.Tensor, lengths: torch.Tensor | Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [N, L, C], new_states [R, m-1]) for a flat batch of spans (see ``histories``)."""
        history, new_states = self.histories(cids, states, lengths)
        return self.rows(cids, history), new_states

    def hash_span(
        self, cids: torch.Tensor | Sequence[int], state: Sequence[int]
    ) -> tuple[torch.Tensor, tuple[int, ...]]:
        """One request's span [start, end): (rows [end-start, L, C], state at ``end``).

        ``cids`` are the span's compressed ids (DEAD allowed); ``state`` is the state at
        ``start`` (a tuple of m-1 ids, e.g. :func:`initial_state` for start = 0).
        """
        cids_t = torch.as_tensor(cids, dtype=torch.int64, device=self.lookup.device).reshape(-1)
        if len(state) != self.history_len:
            raise ValueError(f"state must hold {self.history_len} ids, got {len(state)}")
        states = torch.tensor([list(state)], dtype=torch.int64, device=cids_t.device)
        rows, new_states = self.hash_batch(cids_t, states, [cids_t.numel()])
        return rows, tuple(int(v) for v in new_states[0].tolist())
