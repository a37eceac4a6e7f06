"""The accept walk of a speculative step's verify spans, on the device, for greedy requests.

A verify span ``[s, s + n)`` runs a sequence's last committed token and its ``n - 1`` drafts;
row ``r`` (position ``s + r``) predicts the token at ``s + r + 1``. Under greedy decoding the
token decided at every position of the walk is that row's argmax (an accepted draft equals it,
the first rejected one is replaced by it, the bonus token after the last draft is it), so the
walk is: the span's rows' argmax ``best``, and ``accepted``, the number of leading drafts equal
to the argmax of the row before them. The committed tokens are ``best[lo .. lo + accepted]``
and the committed end is ``s + accepted + 1``.

Computing this on the device lets the draft layers run on the committed rows right after the
verify forward (``Drafter.propose_device``), with no host round trip between the two; the
host reads the walk and the proposals in one copy at the end (``spec_step``). Stop tokens and
length limits are the host's: a sequence that stops inside its committed tokens finishes there
(its proposals, made at the device's end, are dropped with it).

Only plain greedy requests without logprobs qualify (``eligible``): a sampling request's walk
draws random numbers per position, and logprobs need the rows on the host anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atom.engine.sampler import needs_prompt_logits, plain_greedy
from atom.engine.sequence import ScheduledSpan
from atom.model_api import Span


def eligible(spans: list[ScheduledSpan]) -> bool:
    """Every span is a decode position plus its drafts (possibly none) of a plain greedy
    request without logprobs: the walk can run on the device."""
    return bool(spans) and all(
        sp.restore is None
        and sp.start == sp.seq.num_tokens - 1
        and sp.end == sp.start + 1 + len(sp.drafts)
        and plain_greedy(sp.seq)
        and sp.seq.params.logprobs is None
        and not needs_prompt_logits(sp.seq, sp.start)
        for sp in spans
    )


@dataclass
class GreedyWalk:
    """One step's walk over its verify spans (in step order, rows in span order)."""

    spans: list[Span]  # each verify span's positions [s, s + n) (no blocks: draft layers)
    best: torch.Tensor  # int64 [N]: each row's argmax
    accepted: torch.Tensor  # int64 [B]: leading drafts equal to the row before them's argmax
    lo: torch.Tensor  # int64 [B]: each span's first row
    last: torch.Tensor  # int64 [B]: each span's last row
    row_span: torch.Tensor  # int64 [N]: each row's span
    row_offset: torch.Tensor  # int64 [N]: each row's index within its span

    @classmethod
    def run(cls, logits: torch.Tensor, spans: list[ScheduledSpan]) -> GreedyWalk:
        """``logits``: float [N, V], every row of ``spans`` (eligible ones) in order."""
        dev, b = logits.device, len(spans)
        sizes = [sp.end - sp.start for sp in spans]
        if logits.shape[0] != sum(sizes):
            raise ValueError(f"logits hold {logits.shape[0]} rows, the spans {sum(sizes)}")
        k = max(len(sp.drafts) for sp in spans)
        lo, row_span, row_offset, grid_rows, grid_drafts, at = [], [], [], [], [], 0
        for i, (sp, n) in enumerate(zip(spans, sizes)):
            lo.append(at)
            row_span += [i] * n
            row_offset += range(n)
            drafts = list(sp.drafts)
            grid_rows += [at + j for j in range(len(drafts))] + [at] * (k - len(drafts))
            grid_drafts += drafts + [-1] * (k - len(drafts))  # -1: never an argmax
            at += n
        last = [a + n - 1 for a, n in zip(lo, sizes)]
        host = torch.tensor(lo + last + row_span + row_offset + grid_rows + grid_drafts)
        if dev.type == "cuda":
            host = host.pin_memory()
        flat = host.to(dev, non_blocking=True)
        n_rows = at
        lo_d, last_d, row_span_d, row_offset_d, rest = flat.split([b, b, n_rows, n_rows, 2 * b * k])
        best = logits.argmax(-1)
        if k:
            rows, drafts = rest.view(2, b, k)
            match = best[rows] == drafts
            accepted = match.long().cumprod(1).sum(1)
        else:
            accepted = torch.zeros(b, dtype=torch.int64, device=dev)
        empty = torch.empty(0, dtype=torch.int64)
        return cls(
            [Span(sp.start, sp.end, sp.seq.slot, empty) for sp in spans],
            best,
            accepted,
            lo_d,
            last_d,
            row_span_d,
            row_offset_d,
        )

    @property
    def committed_rows(self) -> torch.Tensor:
        """int64 [B]: each span's last committed row (``lo + accepted``, position ``e - 1``)."""
        return self.lo + self.accepted

    def depth_tokens(self, d: int, chains: torch.Tensor | None) -> torch.Tensor:
        """int64 [N]: the input token of draft depth ``d`` (1-based) at every row: at position
        p the token at p + d, a committed one (``best``) where it is, else the proposal chain's
        (``chains`` [B, >= d - 1], depths 1 .. d - 1 at the committed end). Rows past the
        committed end get some valid token: their draft rows are re-run before being read."""
        t = self.row_offset + (d - 1)  # the token at p + d is committed token t of the step
        acc = self.accepted[self.row_span]
        mine = torch.minimum(self.lo[self.row_span] + t, self.last[self.row_span])
        if d == 1 or chains is None:
            return self.best[mine]
        c = (t - acc - 1).clamp(0, d - 2)
        return torch.where(t <= acc, self.best[mine], chains[self.row_span, c])
