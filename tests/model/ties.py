"""Tie-aware comparison of two forwards of one model (paged vs reference, CUDA vs CPU).

A forward makes discrete choices: each index-source layer's top-k rows per query
(``select_topk``), the candidate source's blocks (``candidate_row_mask``) and every token's
experts (MoE routing). Two correct fp32 evaluations differ by rounding (~1e-5 on index scores
after a few layers: other reduction orders, another BLAS, CUDA's kernels); where a choice's
margin is smaller than that, they choose differently and the logits of the positions downstream
differ by 1e-2 to 1. Such near-ties are not rare: the indexer's ReLU leaves ~7% of the scores at
exactly 0, so for a query whose k-th score is 0 a row whose heads cancel to ~1e-7 sits right at
the boundary (v41-mini, 600 tokens: 173 of 2400 query selections end inside that cluster).

``DecisionTrace.recording()`` keeps one run's choices per (kind, layer, position);
``DecisionTrace.forcing()`` runs a second forward that takes the recorded choice wherever it
differs from its own *and* is a top-k of its own scores within ``tol`` (a near-tie, listed in
``forced``); any other difference fails (``DecisionMismatch``). The logits can then be compared
at fp32 tolerance: what remains is arithmetic, not a flipped choice.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from atom.models.common.moe import MoE
from atom.models.deepseek_v41 import attention, model, paged_attention, paged_decode, reference
from atom.models.deepseek_v41.config import LayerMode

NEG_INF = float("-inf")


class DecisionMismatch(AssertionError):
    """A recorded choice is not a top-k of the forcing run's scores within tolerance."""


@dataclass
class Forced:
    kind: str  # "select" | "blocks" | "experts"
    layer: int
    position: int
    gap: float  # best left-out score minus worst chosen score, in the forcing run (<= tol)


def near_tie_gap(scores: torch.Tensor, chosen: list[int]) -> float:
    """scores [R] (-inf = ineligible): how far ``chosen`` is from being a top-|chosen| set,
    max(score of an eligible row left out) - min(score of a chosen row); <= 0 when it is one."""
    if not chosen:
        return 0.0
    s = scores.double()
    pick = torch.zeros_like(s, dtype=torch.bool)
    pick[chosen] = True
    worst_in = s[pick].min().item()
    rest = s[~pick & (s > NEG_INF)]
    best_out = rest.max().item() if rest.numel() else NEG_INF
    return best_out - worst_in


def margin(scores: torch.Tensor, chosen: list[int]) -> float:
    """How far ``chosen`` (a top-|chosen| set of ``scores``) is from a different choice: the
    smallest nonzero gap between a chosen and an eligible left-out score (inf if none). Exact
    ties (ReLU's zeros) are not counted: they are broken by row id, identically everywhere."""
    s = scores.double()
    pick = torch.zeros_like(s, dtype=torch.bool)
    pick[chosen] = True
    inside, out = s[pick], s[~pick & (s > NEG_INF)]
    if not inside.numel() or not out.numel():
        return float("inf")
    worst_in, best_out = inside.min(), out.max()
    below = out[out < worst_in]
    above = inside[inside > best_out]
    gaps = [float("inf")]
    if below.numel():
        gaps.append((worst_in - below.max()).item())
    if above.numel():
        gaps.append((above.min() - best_out).item())
    return min(gaps)


class DecisionTrace:
    """Record a forward's discrete choices, or force recorded near-tie choices into another."""

    def __init__(self, tol: float = 1e-4):
        self.tol = tol
        self.choices: dict[tuple[str, int, int], list[int]] = {}
        self.forced: list[Forced] = []
        self.margins: dict[tuple[str, int, int], float] = {}  # recorded choices' margins
        self.decisions = 0
        self._mode: str | None = None
        self._layer: int | None = None
        self._block: int | None = None  # the layer whose attention ran last (the MoE's)
        self._tokens: list[int] | None = None  # positions of the rows the MoE sees
        self._queries: list[list[int]] = []  # positions of each pending layer_selection call
        self._current: list[int] | None = None

    @contextlib.contextmanager
    def recording(self):
        with self._patched("record"):
            yield self

    @contextlib.contextmanager
    def forcing(self):
        with self._patched("force"):
            yield self

    # ---- the decision points ------------------------------------------------------------

    def _decide(self, kind: str, positions: list[int], own: list[list[int]], scores) -> list:
        """Per row: the choice to use (own, or the recorded near-tie alternative)."""
        if positions is None or len(positions) != len(own):
            raise DecisionMismatch(f"{kind} at layer {self._layer}: positions of the rows unknown")
        out = []
        for r, (pos, mine) in enumerate(zip(positions, own)):
            key = (kind, self._layer, pos)
            self.decisions += 1
            if self._mode == "record":
                self.choices[key] = sorted(mine)
                self.margins[key] = margin(scores[r], mine)
                out.append(mine)
                continue
            if key not in self.choices:
                raise DecisionMismatch(f"{key}: no recorded choice (different schedule?)")
            theirs = self.choices[key]
            if theirs == sorted(mine):
                out.append(mine)
                continue
            row = scores[r]
            gap = near_tie_gap(row, theirs)
            if len(theirs) != len(mine) or gap > self.tol:
                raise DecisionMismatch(
                    f"{key}: recorded {theirs}, own {sorted(mine)}; the recorded choice is "
                    f"{gap:.3g} below the own choice's scores (tolerance {self.tol:g})"
                )
            self.forced.append(Forced(kind, self._layer, pos, gap))
            out.append(sorted(theirs, key=lambda i: (-row[i].item(), i)))
        return out

    def _select_topk(self, orig, scores, k, fixed=False):
        ids, valid = orig(scores, k, fixed)
        positions = self._current
        own = [[i for i, v in zip(a, b) if v] for a, b in zip(ids.tolist(), valid.tolist())]
        picks = self._decide("select", positions, own, scores.detach().cpu())
        if self._mode == "force":
            ids = ids.clone()
            for r, (p, m) in enumerate(zip(picks, own)):
                if p is not m:
                    ids[r, : len(p)] = torch.tensor(p, dtype=ids.dtype)
        return ids, valid

    def _candidate_rows(self, orig, scores, visible, block_rows, keep_blocks):
        mask = orig(scores, visible, block_rows, keep_blocks)
        t, r = scores.shape
        nb = -(-r // block_rows)
        own = [[b for b, c in enumerate(row) if c] for row in mask[:, ::block_rows].tolist()]
        # block scores as candidate_row_mask ranks them (newest block first, always kept)
        padded = torch.full((t, nb * block_rows), NEG_INF, dtype=torch.float64)
        padded[:, :r] = scores.detach().cpu().double()
        block = padded.view(t, nb, block_rows).amax(-1)
        newest = ((visible.cpu() - 1) // block_rows).clamp(min=0)
        block[torch.arange(t), newest] = torch.where(
            visible.cpu() > 0, float("inf"), block[torch.arange(t), newest]
        )
        picks = self._decide("blocks", self._current, own, block)
        if self._mode == "force":
            chosen = torch.zeros(t, nb, dtype=torch.bool)
            for i, p in enumerate(picks):
                chosen[i, p] = True
            mask = chosen.repeat_interleave(block_rows, dim=1)[:, :r].to(mask.device)
        return mask

    def _layer_selection(self, orig, attn, *args, **kwargs):
        self._layer = attn.layer
        self._current = self._queries.pop(0)
        return orig(attn, *args, **kwargs)

    def _moe_forward(self, orig, moe: MoE, x):
        self._layer = self._block
        scores = torch.sqrt(F.softplus(F.linear(x, moe.gate.weight).float()))
        biased = scores + moe.gate.e_score_correction_bias
        order = torch.sort(biased, dim=-1, descending=True, stable=True).indices
        own = order[:, : moe.top_k].tolist()
        picks = self._decide("experts", self._tokens, own, biased.detach().cpu())
        if self._mode == "record" or all(p is m for p, m in zip(picks, own)):
            return orig(moe, x)
        # the routing sort inside MoE.forward returns the forced experts first
        forced = order.clone()
        for r, (p, m) in enumerate(zip(picks, own)):
            if p is not m:
                rest = [e for e in order[r].tolist() if e not in p]
                forced[r] = torch.tensor(p + rest, dtype=order.dtype)
        real_sort = torch.sort

        def routing_sort(t, *a, **kw):
            torch.sort = real_sort  # only the first sort (the routing) is replaced
            return torch.return_types.sort((t.gather(-1, forced), forced))

        torch.sort = routing_sort
        try:
            return orig(moe, x)
        finally:
            torch.sort = real_sort

    # ---- where the positions come from ----------------------------------------------------

    def _paged_attention(self, orig, attn, u, angles, seqs, decode, *args):
        self._block, self._tokens = attn.layer, angles.positions.tolist()
        if attn.mode in (LayerMode.FULL, LayerMode.REINDEX):
            self._queries = [s.positions.tolist() for s in seqs]
            if decode is not None:
                self._queries.append(decode.pos.tolist())
        return orig(attn, u, angles, seqs, decode, *args)

    def _reference_attention(self, orig, attn, u, pos, *args):
        self._block, self._tokens = attn.layer, pos.tolist()
        n, tile = pos.numel(), reference.QUERY_TILE
        self._queries = [pos[t0 : t0 + tile].tolist() for t0 in range(0, n, tile)]
        return orig(attn, u, pos, *args)

    @contextlib.contextmanager
    def _patched(self, mode: str):
        self._mode = mode
        patches = [
            (attention, "select_topk", self._select_topk),
            (attention, "candidate_row_mask", self._candidate_rows),
            (reference, "layer_selection", self._layer_selection),
            (paged_attention, "layer_selection", self._layer_selection),
            (paged_decode, "layer_selection", self._layer_selection),
            (model, "paged_attention", self._paged_attention),
            (reference, "_attention", self._reference_attention),
            (MoE, "forward", self._moe_forward),
        ]
        saved = []
        try:
            for owner, name, hook in patches:
                orig = getattr(owner, name)
                saved.append((owner, name, orig))
                wrapped = (lambda h, o: lambda *a, **k: h(o, *a, **k))(hook, orig)
                setattr(owner, name, wrapped)
            yield
        finally:
            for owner, name, orig in reversed(saved):
                setattr(owner, name, orig)
            self._mode = None
