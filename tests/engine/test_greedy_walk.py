"""The greedy accept walk on the device (``atom.engine.greedy_walk``): the walk and each draft
depth's input tokens against a plain Python walk, and an engine whose speculative steps walk on
the device against one that walks on the host: the same tokens, proposals, acceptance and
steps, for both families' draft layers, with drafts accepted and rejected at every length and
depths past the model's draft layers (eagerly, and through fake draft graphs)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from atom.engine.greedy_walk import GreedyWalk
from atom.engine.sequence import ScheduledSpan

from .test_speculative import FAMILIES, GREEDY, prompts_of, run, truth_of


def _spans(shape: list[tuple[int, list[int]]]) -> list[ScheduledSpan]:
    """(start, drafts) per span -> verify spans [start, start + 1 + len(drafts))."""
    return [
        ScheduledSpan(SimpleNamespace(slot=i), s, s + 1 + len(d), drafts=tuple(d))
        for i, (s, d) in enumerate(shape)
    ]


def _python_walk(best: list[int], spans) -> list[int]:
    out, lo = [], 0
    for sp in spans:
        n = 0
        while n < len(sp.drafts) and sp.drafts[n] == best[lo + n]:
            n += 1
        out.append(n)
        lo += sp.end - sp.start
    return out


def test_walk_and_depth_tokens_match_a_python_walk():
    rng = random.Random(0)
    vocab = 7
    for _ in range(200):
        starts = [rng.randint(0, 50) for _ in range(rng.randint(1, 5))]
        counts = [rng.randint(0, 4) for _ in starts]
        rows = sum(counts) + len(counts)
        gen = torch.Generator().manual_seed(rng.randrange(2**31))
        logits = torch.randn(rows, vocab, generator=gen)
        best = logits.argmax(-1).tolist()
        shape, lo = [], 0
        for s, c in zip(starts, counts):  # most drafts equal the argmax of the row before
            drafts = [
                best[lo + j] if rng.random() < 0.7 else rng.randrange(vocab) for j in range(c)
            ]
            shape.append((s, drafts))
            lo += c + 1
        spans = _spans(shape)
        walk = GreedyWalk.run(logits, spans)
        accepted = _python_walk(best, spans)
        assert walk.accepted.tolist() == accepted
        assert walk.best.tolist() == best
        lo = 0
        los = []
        for sp in spans:
            los.append(lo)
            lo += sp.end - sp.start
        assert walk.committed_rows.tolist() == [a + n for a, n in zip(los, accepted)]
        depth = 3
        chains = torch.tensor([[rng.randrange(vocab) for _ in range(depth)] for _ in spans])
        for d in range(1, depth + 1):
            got = walk.depth_tokens(d, chains[:, : d - 1] if d > 1 else None).tolist()
            for i in range(len(spans)):
                # tokens after this step: the committed best[lo .. lo + accepted], then the
                # chain; row r (position s + r) reads the token at s + r + d
                mine = best[los[i] : los[i] + accepted[i] + 1] + chains[i, : d - 1].tolist()
                for r in range(accepted[i] + 1):  # rows past the committed end: any token
                    assert got[los[i] + r] == mine[r + d - 1], (d, i, r)


def test_the_walk_refuses_logits_of_another_shape():
    spans = _spans([(3, [1, 2])])
    with pytest.raises(ValueError, match="logits hold 2 rows, the spans 3"):
        GreedyWalk.run(torch.zeros(2, 5), spans)


def _proposals(llm_kw: dict, device_walk: bool, prompts, **kw):
    """Run with the engine's device walk on or off; returns (llm, outputs, each step's
    proposals per request)."""
    seen: list[dict] = []

    def record(engine):
        engine.check_integrity()
        seen.append({tuple(s.prompt): list(s.draft) for s in engine.scheduler.running})

    from atom import LLM

    llm = LLM(llm_kw.pop("model"), **llm_kw)
    llm.engine.device_walk = device_walk
    if kw.get("truth") is not None:
        from .test_speculative import ScriptedDrafter

        llm.engine.drafter = ScriptedDrafter(llm.engine.drafter, kw["truth"], kw["wrong"])
    outs = llm.generate(prompts, GREEDY, on_step=record)
    return llm, outs, seen


@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("scripted", [False, True])
def test_device_walk_equals_host_walk(model, k, scripted):
    from .test_speculative import KW

    prompts = prompts_of([5, 17, 33, 40], seed=5)
    truth = None
    if scripted:
        _, plain = run(prompts, GREEDY, model=model)
        truth = truth_of(prompts, plain)
    arms = {}
    for on in (True, False):
        kw = {**KW, "model": model, "speculative_tokens": k}
        arms[on] = _proposals(kw, on, prompts, truth=truth, wrong=lambda p: p % 5 == 0)
    (dev, dev_out, dev_seen), (host, host_out, host_seen) = arms[True], arms[False]
    assert [o.token_ids for o in dev_out] == [o.token_ids for o in host_out]
    assert dev_seen == host_seen  # every step's proposals
    d, h = dev.engine.stats(), host.engine.stats()
    assert d["steps"] == h["steps"]
    d_spec, h_spec = d["speculative"], h["speculative"]
    assert d_spec.pop("device_walk_steps") > 0
    assert h_spec.pop("device_walk_steps") == 0
    assert d_spec == h_spec
    if scripted:
        assert 0 < d_spec["acceptance_rate"] < 1


@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize("k", [2, 3])
def test_device_walk_through_fake_draft_graphs_equals_host_walk(fake_engine_graphs, model, k):
    """The draft graphs take the committed end's rows as a device tensor (``logit_rows``) and
    the depths past the draft layers' positions as device shifts (``shift``; v4-tiny's one MTP
    layer at k = 2 and 3, v41-tiny-draft's two layers at k = 3): through fake graphs
    (``EagerBackend``) the device walk proposes what the host walk does."""
    from .test_speculative import KW

    prompts = prompts_of([40, 33, 47, 20], seed=6)
    _, plain = run(prompts, GREEDY, model=model)
    truth = truth_of(prompts, plain)
    got = {}
    for on in (True, False):
        kw = {**KW, "model": model, "speculative_tokens": k}
        llm, outs, seen = _proposals(kw, on, prompts, truth=truth, wrong=lambda p: p % 4 == 0)
        graphs = fake_engine_graphs[-1].span_graphs
        assert graphs.replays["draft"] > 10 and not graphs.failed, graphs.replays
        assert (llm.engine.stats()["speculative"]["device_walk_steps"] > 0) == on
        got[on] = ([o.token_ids for o in outs], seen)
    assert got[True] == got[False]
    assert got[True][0] == [o.token_ids for o in plain]
