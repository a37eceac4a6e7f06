"""The token embedding and the LM head, split by vocabulary across tensor-parallel ranks.

Both are the plain modules at one rank (``VocabEmbedding`` is an ``nn.Embedding``, ``VocabHead``
a ``Linear``: same parameters, same state dict, same arithmetic). Split
(``atom.models.common.tensor_parallel``: each declares ``tp_splits``), rank r of N holds the
rows of token ids [r * V/N, (r + 1) * V/N):

* the embedding looks up the ids it holds, zeros for the others, and the ranks' sum (the
  forward's all-reduce) is the unsplit lookup exactly: every element is one rank's value plus
  zeros;
* the head computes the logits of its ids, and an all-gather concatenates the ranks' in rank
  order into every id's logits (each logit is one rank's dot product over the whole hidden
  state).

Why: both are whole-vocabulary tables (V4.1-Flash: 2 x 129280 x 5120 bf16, 2.65 GB) that every
rank would otherwise hold and, for the head, read in full at every decode step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from atom.kernels import invariant
from atom.models.common.layers import Linear

Collective = Callable[[torch.Tensor], torch.Tensor]


class VocabEmbedding(nn.Embedding):
    """``nn.Embedding`` that tensor parallelism may split by vocabulary (module doc)."""

    vocab_start = 0  # the first token id this rank holds (0 when whole)
    reduce_rows: Collective | None = None

    def tp_splits(self) -> dict[str, int]:
        return {"weight": 0}

    def tp_narrowed(self, attr: str, dim: int, rank: int, world: int) -> None:
        self.vocab_start = rank * self.weight.shape[0]
        self.num_embeddings = self.weight.shape[0]

    def tp_narrow(self, world: int, reduce: Collective, gather: Collective | None) -> None:
        self.reduce_rows = reduce

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.reduce_rows is None:
            return super().forward(ids)
        local = ids - self.vocab_start
        held = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.reduce_rows(rows.masked_fill(~held[..., None], 0))


class VocabHead(Linear):
    """The LM head (a ``Linear``) that tensor parallelism may split by vocabulary (module doc).
    ``float_logits`` is the float32 product the DSpark stages take (``invariant.linear`` of
    float32 operands), gathered the same way."""

    gather_logits: Collective | None = None

    def tp_splits(self) -> dict[str, int]:
        return {"weight": 0}

    def tp_narrow(self, world: int, reduce: Collective | None, gather: Collective) -> None:
        if gather is None and reduce is not None:
            raise ValueError("a split LM head needs the ranks' gather")
        self.gather_logits = gather

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._joined(super().forward(x))

    def float_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self._joined(invariant.linear(x.float(), self.weight.float()))

    def _joined(self, part: torch.Tensor) -> torch.Tensor:
        return part if self.gather_logits is None else self.gather_logits(part.contiguous())
