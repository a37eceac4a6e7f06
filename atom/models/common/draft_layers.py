"""``DraftLayers``: ``atom.model_api.DraftRuntime`` as V4.1's and V4's runtimes share it. A
runtime mixing it in has ``model`` (``num_draft_layers``, ``forward_paged`` with
``return_residual``, ``forward_draft_paged``), ``kv``, ``slots`` (``advance_draft``),
``cuda_graphs`` and ``span_graphs`` (None, or with ``verify`` and ``draft``)."""

from __future__ import annotations

import torch

from atom.model_api import Span, shifted_spans


class DraftLayers:
    @property
    def num_draft_layers(self) -> int:
        return self.model.num_draft_layers

    def forward_with_residual(
        self, token_ids: torch.Tensor, spans: list[Span], all_logits: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` that also returns every token's residual (a verify forward replays a
        span graph where it can)."""
        if self.cuda_graphs and self.span_graphs is not None:
            got = self.span_graphs.verify(token_ids, spans)
            if got is not None:
                logits, residual = got
                if not all_logits:
                    ends = torch.tensor([sp.num_tokens for sp in spans]).cumsum(0) - 1
                    logits = logits[ends.to(logits.device)]
                return logits, residual
        return self.model.forward_paged(
            token_ids, spans, self.kv, self.slots, all_logits, return_residual=True
        )

    def draft_forward(
        self,
        token_ids: torch.Tensor,
        residual: torch.Tensor,
        spans: list[Span],
        *,
        layer: int = 0,
        all_logits: bool = False,
        logit_rows: torch.Tensor | None = None,
        shift: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft layer (contract: ``DraftRuntime``): replayed in a draft graph where one
        fits, else eager."""
        if self.cuda_graphs and self.span_graphs is not None and not all_logits:
            got = self.span_graphs.draft(token_ids, residual, spans, layer, logit_rows, shift)
            if got is not None:
                return got
        return self.model.forward_draft_paged(
            token_ids,
            residual,
            shifted_spans(spans, shift),
            self.slots,
            layer=layer,
            all_logits=all_logits,
            logit_rows=logit_rows,
        )

    def settle_draft_cursors(self, cursors: list[tuple[int, int, int]]) -> None:
        """(slot, layer, position) of each draft cursor a shifted ``draft_forward`` left: into
        the host mirror (no device access)."""
        for slot, layer, position in cursors:
            self.slots.advance_draft(slot, layer, position)
