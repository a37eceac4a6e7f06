"""Sampling: greedy, or temperature with top-k / top-p, repeatable per request with a seed.

Before either, per request and in vLLM's order: ``min_tokens`` masks EOS and the stop token
ids, then the repetition penalty (prompt + output tokens), then the frequency and presence
penalties (output tokens). A request with none of these samples from the logits as they came.
Log-probabilities (``token_logprobs``) are of the model's raw distribution, before any of it.

Speculative decoding: ``Sampler.propose`` samples a sampling request's draft token from the
draft distribution q (the draft logits through the same transform as the target's p, with the
tokens drafted before it counted as generated), ``Sampler.verify`` applies the speculative
sampling rule (``speculative_accept``), so every emitted token is distributed exactly as p.
"""

from __future__ import annotations

import torch

from atom.engine.sequence import Sequence, TokenLogprob


class Sampler:
    def __init__(self, seed: int):
        self.seed = seed
        self._gens: dict[int, torch.Generator] = {}
        # proposals' own streams (never the verify stream: the draft token and the acceptance
        # draw must be independent), on the device of the drafter's logits
        self._draft_gens: dict[int, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits float32 [len(seqs), V] -> one token per sequence. When every sequence is
        ``plain_greedy`` the argmax runs where the logits are and only the token ids come to
        the host (not [len(seqs), V] floats)."""
        if all(plain_greedy(seq) for seq in seqs):
            return logits.argmax(-1).tolist()
        logits = logits.float().cpu()
        out = logits.argmax(-1).tolist()
        for i, seq in enumerate(seqs):
            p = seq.params
            raw = logits[i]
            row = adjust_logits(raw, seq)
            if p.greedy:
                if row is not raw:
                    out[i] = int(row.argmax())
                continue
            probs = sampling_probs(row, p)
            out[i] = int(torch.multinomial(probs, 1, generator=self._gen(seq)))
        return out

    def verify(
        self,
        row: torch.Tensor,
        seq: Sequence,
        draft: int | None,
        q: torch.Tensor | None = None,
    ) -> tuple[int, bool]:
        """One verify position: ``row`` (float32 [V], the target's logits for ``seq``'s next
        token, with every token accepted before it already in ``seq.tokens``), the draft
        proposed there (None past the drafts: the bonus position) and ``q``, the distribution
        the draft was sampled from (float32 [V] on the host, from ``propose``; None: a one-hot
        proposal, e.g. an argmax draft). Returns (token, the draft was accepted).

        Greedy: the draft is accepted when it is the argmax; otherwise the argmax is the token
        (``q`` is not read). Sampling: p is ``row`` through ``adjust_logits`` and
        ``sampling_probs``, and ``speculative_accept`` decides with the request's generator:
        accept with probability min(1, p(draft) / q(draft)), else sample normalize(max(0,
        p - q)); the bonus position samples p. The token is distributed exactly as p."""
        raw = row.float().cpu()
        adjusted = adjust_logits(raw, seq)
        if seq.params.greedy:
            token = int(adjusted.argmax())
            return token, token == draft
        probs = sampling_probs(adjusted, seq.params)
        return speculative_accept(probs, draft, q, self._gen(seq))

    def propose(
        self, row: torch.Tensor, seq: Sequence, ahead: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A sampling request's draft for the position after ``seq.tokens + ahead`` (``ahead``:
        the tokens drafted before it this step). ``row`` (float32 [V], the draft layer's logits
        there, on any device) goes through the transform the target's p goes through at that
        position (``adjust_logits`` with ``ahead`` counted as generated, then
        ``sampling_probs``), giving q, and the token is drawn from q with the request's
        proposal stream (``draft_generator``). Returns (token: int64 [1], q: float32 [V]),
        both on ``row``'s device (no host sync: the caller reads every row's token in one
        copy)."""
        q = sampling_probs(adjust_logits(row.float(), seq, ahead), seq.params)
        return torch.multinomial(q, 1, generator=self.draft_generator(seq, q.device)), q

    def draft_generator(self, seq: Sequence, device: torch.device) -> torch.Generator:
        """``seq``'s proposal stream on ``device``: seeded from the request's seed (or the
        engine's seed and seq_id) through ``DRAFT_SEED_SALT``, so proposals are reproducible
        and independent of the verify stream."""
        gen = self._draft_gens.get(seq.seq_id)
        if gen is None:
            seed = seq.params.seed if seq.params.seed is not None else self.seed + seq.seq_id
            gen = torch.Generator(device=device).manual_seed((seed + DRAFT_SEED_SALT) % 2**63)
            self._draft_gens[seq.seq_id] = gen
        return gen

    def _gen(self, seq: Sequence) -> torch.Generator:
        gen = self._gens.get(seq.seq_id)
        if gen is None:
            seed = seq.params.seed if seq.params.seed is not None else self.seed + seq.seq_id
            gen = self._gens[seq.seq_id] = torch.Generator().manual_seed(seed)
        return gen

    def forget(self, seq: Sequence) -> None:
        self._gens.pop(seq.seq_id, None)
        self._draft_gens.pop(seq.seq_id, None)


# added to a request's seed for its proposal stream (any constant that is not 0 works)
DRAFT_SEED_SALT = 0x5EED_D4A7_F000_0001


def speculative_accept(
    probs: torch.Tensor, draft: int | None, q: torch.Tensor | None, gen: torch.Generator
) -> tuple[int, bool]:
    """The speculative sampling rule (Leviathan et al. 2023, Chen et al. 2023) at one position:
    ``probs`` is the target's p (float32 [V], sums to 1), ``draft`` the proposed token (None:
    the bonus position, past the drafts), ``q`` the distribution it was drawn from (float32 [V]
    on ``probs``' device; None: one-hot at ``draft``). Returns (token, accepted): accept with
    probability min(1, p(draft) / q(draft)); on rejection sample normalize(max(0, p - q)), or
    p itself where that is 0 everywhere (q >= p up to rounding: a rejection then only follows
    rounding); the bonus position samples p. With ``draft`` ~ q the token is distributed as p,
    and the acceptance probability is sum_x min(p(x), q(x)).

    Draws from ``gen``: one uniform per draft, then one ``multinomial`` on rejection or at the
    bonus position (with q None exactly the draws of the one-hot rule before q existed)."""
    if draft is None:
        return int(torch.multinomial(probs, 1, generator=gen)), False
    u = float(torch.rand((), generator=gen))
    px = float(probs[draft])
    if q is None:
        if u < px:
            return draft, True
        residual = probs.clone()
        residual[draft] = 0.0
    else:
        if u * float(q[draft]) < px:  # u < p/q without dividing (q(draft) > 0 when drawn)
            return draft, True
        residual = torch.clamp(probs - q, min=0.0)
    if not float(residual.sum()) > 0.0:
        residual = probs
    return int(torch.multinomial(residual, 1, generator=gen)), False


def plain_greedy(seq: Sequence) -> bool:
    """Greedy on the raw logits from now on (``adjust_logits`` returns them unchanged for
    every later token: no penalty, ``min_tokens`` already met)."""
    p = seq.params
    return p.greedy and not p.penalized and len(seq.output) >= p.min_tokens


def sampling_probs(row: torch.Tensor, p) -> torch.Tensor:
    """float32 [V] logits (after ``adjust_logits``) -> the distribution sampling draws from:
    temperature, then top-k, then top-p."""
    row = row / p.temperature
    if p.top_k:
        kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, -1)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < p.top_p
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[order[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return probs


def adjust_logits(
    row: torch.Tensor, seq: Sequence, ahead: list[int] | tuple[int, ...] = ()
) -> torch.Tensor:
    """``row`` (float32 [V], the model's logits for the token after ``seq.tokens + ahead``, on
    any device) after min_tokens and the penalties, ``ahead`` (tokens drafted after
    ``seq.tokens``) counted as generated; ``row`` itself (not a copy) when none of them
    applies."""
    p = seq.params
    generated = seq.output + list(ahead)
    masked = len(generated) < p.min_tokens
    if not (masked or p.penalized):
        return row
    row, vocab, dev = row.clone(), row.numel(), row.device
    if masked:
        stops = list(p.stop_token_ids)
        if not p.ignore_eos and seq.eos_token_id is not None:
            stops.append(seq.eos_token_id)
        stops = [t for t in stops if 0 <= t < vocab]
        if stops:
            row[stops] = float("-inf")
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
        seen[torch.tensor(seq.tokens + list(ahead), dtype=torch.int64, device=dev)] = True
        r = p.repetition_penalty
        row = torch.where(seen, torch.where(row > 0, row / r, row * r), row)
    if generated and (p.frequency_penalty or p.presence_penalty):
        ids = torch.tensor(generated, dtype=torch.int64, device=dev)
        counts = torch.bincount(ids, minlength=vocab)
        counts = counts[:vocab].to(row.dtype)
        row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(row.dtype)
    return row


def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """For each row of ``logits`` ([n, V], raw) and its token: the token's log-probability,
    its rank and the ``k`` most likely alternatives (log-softmax in float32)."""
    if not token_ids:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, ids[:, None])
    ranks = ((lp > chosen).sum(-1) + 1).tolist()
    chosen = chosen[:, 0].tolist()
    if k:
        top_v, top_i = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(top_i.tolist(), top_v.tolist())]
    else:
        tops = [()] * len(token_ids)
    return [TokenLogprob(t, c, r, top) for t, c, r, top in zip(token_ids, chosen, ranks, tops)]


def needs_prompt_logits(seq: Sequence, start: int) -> bool:
    """A span of ``seq`` starting at ``start`` must return every token's logits: the request
    asks for prompt logprobs and some of them, from the span on, are not recorded yet."""
    return (
        seq.params.prompt_logprobs is not None
        and len(seq.prompt_logprobs) < seq.num_prompt - 1
        and start < seq.num_prompt - 1
    )


def record_prompt_logprobs(seq: Sequence, start: int, logits: torch.Tensor) -> None:
    """``logits`` [n, V] of positions start.. (each predicts the token after it): record the
    prompt tokens' logprobs not recorded yet (a recompute after preemption adds nothing)."""
    first = len(seq.prompt_logprobs) + 1  # the next prompt token without a logprob
    end = min(start + logits.shape[0], seq.num_prompt - 1) + 1
    if first - 1 < start or end <= first:
        return
    rows = logits[first - 1 - start : end - 1 - start]
    seq.prompt_logprobs += token_logprobs(rows, seq.tokens[first:end], seq.params.prompt_logprobs)
