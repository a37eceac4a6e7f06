"""Proposals from a model's own draft layers (``atom.model_api.DraftRuntime``).

After each target forward the draft layers run over the positions whose target state is now
committed, and propose the next ``k`` tokens of each sequence that continues. DeepSeek's MTP
alignment: depth ``d`` (1-based) at index ``j`` reads the token at ``j + d`` and the residual of
depth ``d - 1`` at ``j`` (depth 0: the target's last-layer streams) and predicts the token at
``j + d + 1``. Depth ``d`` runs draft layer ``d - 1``; past the model's ``m`` draft layers the
last one is applied again (as DeepSeek's single MTP layer is applied recursively).

Which positions each layer runs (every layer's window ring stays contiguous, so its cursor is
always where the draft contract wants it, ``[s, s + k]`` of the next call's start s):

* depths ``d <= m`` run over exactly the target's committed span ``[s, e)`` of this step, at the
  same positions. The token at ``j + d`` is a committed token, else the proposal chain's (the
  last ``d - 1`` indices when proposing), else the last committed token: a placeholder used
  only at the end of a non-final prefill chunk, where nothing is proposed.
* depths ``d > m`` (only when proposing) run the last layer at one position each, ``e``,
  ``e + 1``, ...; the next step starts that layer at its next committed span again, at most
  ``k - m`` positions back, which the contract allows.

Each depth's proposal is made from the draft layer's logits at the item's last index: a greedy
request's is their argmax (the raw logits, as before sampled drafts existed); a sampling
request's is drawn from q, those logits through the request's own sampling transform
(``Sampler.propose``: penalties and min_tokens with the chain so far counted as generated, then
temperature, top-k, top-p: the transform the target's p gets at that position), with the
request's proposal stream. Such a chain comes back as a ``Proposal`` carrying each token's q,
which ``Sampler.verify`` needs for the exact rule; argmax chains carry none (one-hot q).

Draft rows computed from proposals or placeholders stay in the rings and in checkpoint images:
they steer later proposals only. The target verifies every proposal, so no output depends on a
draft row.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from atom.engine.greedy_walk import GreedyWalk
from atom.engine.sampler import Sampler
from atom.engine.sequence import Sequence
from atom.model_api import Span


class Proposal(list):
    """A sequence's proposed tokens (a ``list`` of ints, what ``Sequence.draft`` holds) and
    ``q``: float32 [len(self), V] on the drafter's device, row i the distribution token i was
    sampled from (given the tokens before it), or None: one-hot proposals (argmax). Tokens and
    q travel as one object so that whoever replaces the tokens (a plain list) drops q with them:
    a token verified against a q it was not drawn from would bias the output."""

    __slots__ = ("q",)

    def __init__(self, tokens=(), q: torch.Tensor | None = None):
        super().__init__(tokens)
        self.q = q


def proposal_q(draft: list[int]) -> torch.Tensor | None:
    """The q rows of ``draft`` (a ``Sequence.draft``): None unless it is a sampled
    ``Proposal``."""
    return draft.q if isinstance(draft, Proposal) else None


@dataclass
class DeviceDrafts:
    """``Drafter.propose_device``'s proposals, on the device until the step reads them."""

    chains: torch.Tensor  # int64 [B, D]: depths 1 .. D proposed at each span's committed end
    last: torch.Tensor  # depth D's output streams at each committed end [B, ...]
    spans: list[Span]  # the walk's verify spans
    ahead: int  # depths past the draft layers run on the device (0: none)


@dataclass
class DraftItem:
    """One sequence's committed span of this step and what the draft layers need of it."""

    seq: Sequence
    start: int
    end: int  # committed positions [start, end) of this step
    residual: torch.Tensor  # the target's residual rows of [start, end)
    want: int  # proposals to make (0: fill the rings only)


class Drafter:
    def __init__(
        self, runtime, speculative_tokens: int, num_layers: int, sampler: Sampler | None = None
    ):
        """``sampler``: the engine's, whose ``propose`` samples sampling requests' drafts;
        None proposes the argmax for every request."""
        if num_layers < 1:
            raise ValueError("speculative decoding needs a runtime with draft layers")
        self.runtime, self.k, self.num_layers = runtime, speculative_tokens, num_layers
        self.sampler = sampler
        self._no_blocks = torch.empty(0, dtype=torch.int64)
        self._keywords: dict[str, bool] = {}  # draft_forward's optional keywords (_takes)

    def propose(self, items: list[DraftItem]) -> dict[int, list[int]]:
        """Run the draft layers over every item; returns each proposing item's proposals
        (by seq_id; ``want`` of them, fewer only past ``k``): a ``Proposal`` with each token's
        q for a sampling request (with a sampler), a plain list of argmax tokens otherwise."""
        chains: dict[int, list[int]] = {it.seq.seq_id: [] for it in items if it.want > 0}
        if not items:
            return chains
        # q rows of the sampling requests' chains
        qs: dict[int, list[torch.Tensor]] = {
            it.seq.seq_id: [] for it in items if it.want > 0 and self._samples(it.seq)
        }
        residual = [it.residual for it in items]
        for d in range(1, min(self.k, self.num_layers) + 1):
            ids = [self._token(it, j + d, chains) for it in items for j in range(it.start, it.end)]
            spans = [Span(it.start, it.end, it.seq.slot, self._no_blocks) for it in items]
            logits, out = self._call(ids, torch.cat(residual), spans, d - 1)
            residual = list(out.split([it.end - it.start for it in items]))
            self._extend(items, logits, chains, qs, d)
        self._past_layers(items, chains, qs, [r[-1:] for r in residual])
        for sid, rows in qs.items():
            chains[sid] = Proposal(chains[sid], torch.stack(rows) if rows else None)
        return chains

    def propose_device(self, walk: GreedyWalk, residual: torch.Tensor) -> DeviceDrafts:
        """Every depth for every verify span of ``walk`` (greedy requests), on the device,
        reading nothing back. Depth d <= m runs layer d - 1 over the span's rows [s, s + n)
        (``residual``: the verify forward's rows, in the walk's order) with
        ``walk.depth_tokens`` as input, and proposes the argmax of its logits at the committed
        end's row. Rows past the committed end ran on rejected drafts: the layer's cursor ends
        at s + n, at most k past the next start, which re-runs them. Depths past m run the last
        layer at one position each, e, e + 1, ... (the committed end e = s + accepted + 1:
        spans at s + 1, s + 2, ... shifted by ``walk.accepted`` on the device), where the
        runtime takes ``shift``; else ``finish_device`` runs them once the host knows e."""
        rows, cols, chains = walk.committed_rows, [], None
        for d in range(1, min(self.k, self.num_layers) + 1):
            ids = walk.depth_tokens(d, chains)
            logits, residual = self._call_rows(ids, residual, walk.spans, d - 1, rows)
            cols.append(logits.argmax(-1))
            chains = torch.stack(cols, 1)
        last, ahead = residual[rows], 0
        if self.k > self.num_layers and self._takes("shift"):
            for ahead in range(1, self.k - self.num_layers + 1):
                spans = [
                    Span(sp.start + ahead, sp.start + ahead + 1, sp.slot, self._no_blocks)
                    for sp in walk.spans
                ]
                logits, last = self.runtime.draft_forward(
                    chains[:, -1].contiguous(),
                    last,
                    spans,
                    layer=self.num_layers - 1,
                    shift=walk.accepted,
                )
                cols.append(logits.argmax(-1))
                chains = torch.stack(cols, 1)
        return DeviceDrafts(chains, last, walk.spans, ahead)

    def finish_device(
        self,
        items: list[DraftItem],
        drafts: DeviceDrafts,
        chains: list[list[int]],
        accepted: list[int],
    ) -> dict[int, list[int]]:
        """The proposals of ``propose_device``'s spans once the host has read them
        (``chains``: each item's row of ``drafts.chains``, ``accepted``: the walk's): the
        shifted draft cursors settled in the runtime's mirror, then each proposing item's
        first ``want``, continued past the draft layers by the last one (one position each, as
        ``propose``) where the device did not. ``items``' residual is unused (None)."""
        if drafts.ahead:
            layer = self.num_layers - 1
            self.runtime.settle_draft_cursors(
                [
                    (sp.slot, layer, sp.start + a + 1 + drafts.ahead)
                    for sp, a in zip(drafts.spans, accepted)
                ]
            )
        out = {it.seq.seq_id: chain[: it.want] for it, chain in zip(items, chains) if it.want}
        if not drafts.ahead:
            picked = [it for it in items if it.want]
            rows = [drafts.last[i : i + 1] for i, it in enumerate(items) if it.want]
            self._past_layers(picked, out, {}, rows)
        return out

    def _takes(self, keyword: str) -> bool:
        """The runtime's ``draft_forward`` takes ``keyword`` (device-side chaining)."""
        if keyword not in self._keywords:
            params = inspect.signature(self.runtime.draft_forward).parameters
            self._keywords[keyword] = keyword in params
        return self._keywords[keyword]

    def _past_layers(self, items, chains, qs, residual: list[torch.Tensor]) -> None:
        """Depths m + 1 .. k (``m`` draft layers): the last layer again, at one position each
        (``e``, ``e + 1``, ...), for the items that want them; ``residual[i]``: item i's
        streams [1, ...] at its last committed index after depth m."""
        last = [i for i, it in enumerate(items) if it.want > self.num_layers]
        for d in range(self.num_layers + 1, self.k + 1):
            last = [i for i in last if items[i].want >= d]
            if not last:
                break
            picked = [items[i] for i in last]
            ids = [chains[it.seq.seq_id][-1] for it in picked]
            at = [it.end + d - self.num_layers - 1 for it in picked]
            spans = [Span(p, p + 1, it.seq.slot, self._no_blocks) for p, it in zip(at, picked)]
            res = torch.cat([residual[i] for i in last])
            logits, out = self._call(ids, res, spans, self.num_layers - 1)
            for n, i in enumerate(last):
                residual[i] = out[n : n + 1]
            self._extend(picked, logits, chains, qs, d)

    def _call_rows(self, ids, residual, spans: list[Span], layer: int, rows: torch.Tensor):
        """``draft_forward`` on device ids, with the logits of ``rows`` (one flat row per
        span) instead of each span's last; a runtime without ``logit_rows`` computes every
        row's logits and this picks them."""
        forward = self.runtime.draft_forward
        if self._takes("logit_rows"):
            return forward(ids, residual, spans, layer=layer, logit_rows=rows)
        logits, out = forward(ids, residual, spans, layer=layer, all_logits=True)
        return logits[rows], out

    def _call(self, ids: list[int], residual: torch.Tensor, spans: list[Span], layer: int):
        token_ids = torch.tensor(ids, dtype=torch.int64)
        return self.runtime.draft_forward(token_ids, residual, spans, layer=layer)

    @staticmethod
    def _token(it: DraftItem, q: int, chains: dict[int, list[int]]) -> int:
        tokens = it.seq.tokens
        if q < len(tokens):
            return tokens[q]
        chain = chains.get(it.seq.seq_id, ())
        return chain[q - len(tokens)] if q - len(tokens) < len(chain) else tokens[-1]

    def _samples(self, seq: Sequence) -> bool:
        """``seq``'s drafts are sampled from q (else: the argmax)."""
        return self.sampler is not None and not seq.params.greedy

    def _extend(
        self,
        items,
        logits: torch.Tensor,
        chains: dict[int, list[int]],
        qs: dict[int, list[torch.Tensor]],
        d: int,
    ) -> None:
        """Append depth ``d``'s proposal (from each item's row of ``logits``, its last index)
        to the chains of the items that still want one: the argmax, or for a sampling request
        (in ``qs``) a token drawn from q, whose row goes to ``qs``. One host copy reads them
        all."""
        best = logits.argmax(-1)
        wanting = [n for n, it in enumerate(items) if it.want >= d]
        drawn = [n for n in wanting if items[n].seq.seq_id in qs]
        if drawn:
            best = best.clone()
            for n in drawn:
                seq = items[n].seq
                tok, q = self.sampler.propose(logits[n], seq, chains[seq.seq_id])
                best[n] = tok[0]
                qs[seq.seq_id].append(q)
        best = best.tolist()
        for n in wanting:
            chains[items[n].seq.seq_id].append(int(best[n]))
