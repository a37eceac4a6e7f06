"""One engine step with speculative decoding (``speculative_tokens`` k >= 1).

Order, and why:

1. the target forward, with residuals: prefill chunks in one forward (last-token logits), the
   verify spans ``[n - 1, n + j)`` (a decode position plus its j <= k drafts) and spans that
   need prompt logprobs in another (every token's logits);
2. tokens: a prefill chunk's last token is sampled as without drafts; a verify span walks its
   positions: each draft is accepted or the position's own token is taken and the walk stops
   (``Sampler.verify``: greedy compares with the argmax; sampling applies the speculative
   sampling rule with the q each draft was drawn from, one-hot for argmax drafts); after every
   accepted draft the bonus position is sampled. A stop token or a length limit ends the walk
   too. Tokens are appended as they are decided (penalties of the next position see them),
   each one's logprobs recorded before it;
3. the committed end of each span: ``start +`` the tokens appended (a verify span's positions
   past it ran on rejected drafts; the model re-runs them on the next forward, which may start
   up to k positions behind its slot's cursor);
4. the draft layers over every committed span (``Drafter``), proposing the next k tokens of
   each sequence that continues: a greedy request's argmax, a sampling request's tokens drawn
   from q (kept with them in ``seq.draft``, a ``Proposal``, for the next step's verify);
5. images: a span ending on a block boundary stores its image only if its end is committed,
   i.e. every draft was accepted (the scheduler cuts a verify span at the next boundary, so a
   boundary is never inside one), and only now, after the draft layers, so that the image holds
   them at the boundary too; otherwise the PENDING image is dropped;
6. commit (blocks published up to the committed end only: draft rows are never a hit), then
   timings, metrics and finished requests.

Steps 2-4 run on the device when every span is a decode span of a plain greedy request
without logprobs (``greedy_walk``, ``Drafter.propose_device``): the host reads the walk and
every proposal in one copy, then applies stops and length limits (``_device_walk``); the same
tokens and proposals as the host walk (``_host_walk``), which every other step takes.
"""

from __future__ import annotations

import time

import torch

from atom.engine import greedy_walk
from atom.engine.drafter import DraftItem, proposal_q
from atom.engine.sampler import (
    needs_prompt_logits,
    plain_greedy,
    record_prompt_logprobs,
    token_logprobs,
)


def speculative_step(engine, out) -> list:
    """Run ``out`` (a SchedulerOutput with spans) as one speculative step; returns the
    sequences that finished."""
    spans, runner = out.spans, engine.runner
    on_device = (
        engine.device_walk
        and hasattr(engine.drafter, "propose_device")
        and greedy_walk.eligible(spans)
    )
    full = [
        i
        for i, sp in enumerate(spans)
        if on_device or sp.drafts or needs_prompt_logits(sp.seq, sp.start)
    ]
    try:
        logits = runner.execute(spans, full, residual=True, images=False)
    except Exception:
        for sp in spans:
            engine.scheduler.abandon(sp)
        raise
    engine.steps += 1
    engine.scheduler.while_forward()  # before the walk waits for the forward
    if on_device:  # (every span ran in the one all-logits forward: runner.step_logits)
        new, stops, ends, proposals = _device_walk(engine, spans)
    else:
        new, stops, ends, proposals = _host_walk(engine, spans, logits, full)
    for sp in spans:
        sp.seq.draft = proposals.get(sp.seq.seq_id, [])
    runner.store_images([sp for sp, end in zip(spans, ends) if end == sp.end])
    for sp, end in zip(spans, ends):
        engine.scheduler.commit(sp, end)
    engine.scheduler.after_step([sp.seq for sp in spans])
    now, finished = time.perf_counter(), []
    for i, count in new.items():
        seq = spans[i].seq
        for _ in range(count):
            engine.token_emitted(seq, now)
        if i in stops:
            engine._finish(seq, stops[i])
            finished.append(seq)
    return finished


def _host_walk(engine, spans, logits, full):
    """Steps 2-4 on the host: (tokens appended per span index, stop reasons, committed ends,
    proposals by seq_id)."""
    runner, sampler = engine.runner, engine.sampler
    for i in full:
        sp = spans[i]
        if not sp.drafts:
            record_prompt_logprobs(sp.seq, sp.start, runner.span_logits[i])
    new: dict[int, int] = {}  # span index -> tokens appended
    stops: dict[int, str] = {}
    plain = [i for i, sp in enumerate(spans) if sp.samples and not sp.drafts]
    picked = sampler.sample(logits[plain], [spans[i].seq for i in plain])
    for i, tok in zip(plain, picked):
        _append(spans[i].seq, logits[i : i + 1], tok)
        new[i] = 1
        reason = engine._stop_reason(spans[i].seq)
        if reason:
            stops[i] = reason
    stats = engine.spec_stats
    drafted = [i for i, sp in enumerate(spans) if sp.drafts]
    # greedy spans without logprobs need only each row's argmax (computed where the logits
    # are); the others' rows come to the host in one copy, not one per span or row
    best = {
        i for i in drafted if plain_greedy(spans[i].seq) and spans[i].seq.params.logprobs is None
    }
    host = _rows(runner, sorted(best), lambda x: x.argmax(-1).tolist())
    host.update(_rows(runner, [i for i in drafted if i not in host], lambda x: x.float().cpu()))
    qs = _draft_q(spans, drafted)
    for i in drafted:
        sp = spans[i]
        seq, rows, q = sp.seq, host[i], qs[i]
        new[i], accepted = 0, 0
        for j in range(len(sp.drafts) + 1):
            draft = sp.drafts[j] if j < len(sp.drafts) else None
            if i in best:  # rows: each position's argmax
                tok, ok = rows[j], rows[j] == draft
            else:
                tok, ok = sampler.verify(rows[j], seq, draft, q[j] if draft is not None else None)
            _append(seq, rows[j : j + 1], tok)  # (the row is read only for logprobs)
            new[i] += 1
            accepted += ok
            reason = engine._stop_reason(seq)
            if reason:
                stops[i] = reason
                break
            if not ok:
                break
        stats.observe(len(sp.drafts), accepted)
    ends = [sp.start + new[i] if sp.drafts else sp.end for i, sp in enumerate(spans)]
    items = []
    for i, sp in enumerate(spans):
        proposing = i in new and i not in stops
        items.append(
            DraftItem(
                sp.seq,
                sp.start,
                ends[i],
                runner.span_residual[i][: ends[i] - sp.start],
                _want(engine, sp.seq) if proposing else 0,
            )
        )
    return new, stops, ends, engine.drafter.propose(items)


def _device_walk(engine, spans):
    """Steps 2-4 with the walk and the draft layers' depths on the device (``greedy_walk``;
    every span a plain greedy decode span) and one host copy of the walk and the proposals;
    returns what ``_host_walk`` does."""
    runner, drafter = engine.runner, engine.drafter
    walk = greedy_walk.GreedyWalk.run(runner.step_logits, spans)
    drafts = drafter.propose_device(walk, runner.step_residual)
    engine.spec_stats.walked_on_device()
    b = len(spans)
    host = torch.cat([walk.accepted, walk.best, drafts.chains.reshape(-1)]).tolist()
    accepted, best, flat = host[:b], host[b : b + walk.best.numel()], host[b + walk.best.numel() :]
    depth = drafts.chains.shape[1]
    new: dict[int, int] = {}
    stops: dict[int, str] = {}
    at = 0
    for i, sp in enumerate(spans):
        seq, new[i], ok_count = sp.seq, 0, 0
        for j in range(accepted[i] + 1):
            seq.tokens.append(best[at + j])
            new[i] += 1
            ok_count += j < accepted[i]
            reason = engine._stop_reason(seq)
            if reason:
                stops[i] = reason
                break
        if sp.drafts:
            engine.spec_stats.observe(len(sp.drafts), ok_count)
        at += sp.end - sp.start
    ends = [sp.start + new[i] for i, sp in enumerate(spans)]
    items = [
        DraftItem(sp.seq, sp.start, ends[i], None, 0 if i in stops else _want(engine, sp.seq))
        for i, sp in enumerate(spans)
    ]
    chains_host = [flat[i * depth : (i + 1) * depth] for i in range(b)]
    return new, stops, ends, drafter.finish_device(items, drafts, chains_host, accepted)


def _want(engine, seq) -> int:
    """Proposals a continuing sequence gets: k, fewer near its length limit."""
    return max(0, min(engine.config.speculative_tokens, seq.max_tokens - len(seq.output) - 1))


def _rows(runner, spans: list[int], fetch) -> dict:
    """``fetch`` (a tensor [rows, V] -> what the walk reads) of the given spans' logits, in
    one call for all of them; split back by span."""
    if not spans:
        return {}
    got = fetch(torch.cat([runner.span_logits[i] for i in spans]))
    out, lo = {}, 0
    for i in spans:
        n = runner.span_logits[i].shape[0]
        out[i] = got[lo : lo + n]
        lo += n
    return out


def _draft_q(spans, drafted: list[int]) -> dict:
    """The host copy of q for each drafted span whose drafts were sampled (their
    ``Proposal``'s rows, one per draft the span verifies; the span's drafts are a prefix of
    ``seq.draft``), in one copy for all of them; a span with one-hot drafts gets None rows."""
    sampled = [i for i in drafted if proposal_q(spans[i].seq.draft) is not None]
    out: dict = {i: [None] * len(spans[i].drafts) for i in drafted}
    if not sampled:
        return out
    rows = [proposal_q(spans[i].seq.draft)[: len(spans[i].drafts)] for i in sampled]
    got = torch.cat(rows).float().cpu()
    lo = 0
    for i, r in zip(sampled, rows):
        out[i] = got[lo : lo + r.shape[0]]
        lo += r.shape[0]
    return out


def _append(seq, row, token: int) -> None:
    """Append one decided token, its logprobs recorded first (as the plain step does)."""
    if seq.params.logprobs is not None:
        seq.logprobs += token_logprobs(row, [token], seq.params.logprobs)
    seq.tokens.append(token)
