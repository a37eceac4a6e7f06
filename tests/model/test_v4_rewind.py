"""V4 state rewinds over rejected drafts (``speculative_tokens`` k >= 1): a forward may start
up to k positions before the furthest position written, and then computes exactly what the
oracle computes, whatever the rejected positions wrote (window rings of window + k rows,
partial rings of r + k rows, overlap fields keeping several groups: ``deepseek_v4.geometry``).
"""

from __future__ import annotations

import pytest
import torch

from atom.model_api import Span
from atom.models.deepseek_v4.paged import StateMismatchError
from atom.models.deepseek_v4.reference import reference_forward

from .test_v4_paged import Harness, one_thread_fixture, tokens, v4_tiny_fixture  # noqa: F401

ATOL = 1e-4


def _verify_like(h, seq, plan, slot, table):
    """Run ``plan`` [(start, end, drafts wrong)]: a span with wrong drafts keeps its first
    token (the committed one) and replaces the others; returns the worst difference from the
    oracle over the spans without wrong drafts."""
    ref = reference_forward(h.rt.model, seq)
    worst = 0.0
    for s, e, wrong in plan:
        ids = torch.tensor(seq[s:e])
        if wrong:
            ids[1:] = (ids[1:] + 7) % 300
        out = h.rt.model.forward_paged(ids, [Span(s, e, slot, table)], h.rt.kv, h.rt.slots, True)
        if not wrong:
            worst = max(worst, (out - ref[s:e]).abs().max().item())
    return worst


@pytest.mark.parametrize("k", [1, 2, 4, 5])
@pytest.mark.parametrize("s0", [20, 21, 23, 25, 31])
def test_rejected_drafts_leave_nothing_behind(v4_tiny, k, s0):
    """A verify span of k + 1 tokens (wrong drafts), a rewind to the next position (a decode
    token), another verify completing up to two CSA groups and an HCA group with wrong
    tokens, then a chunk from the last committed position: every committed logit equals the
    oracle's, at starts on and off every group grid."""
    h = Harness(v4_tiny, speculative_tokens=k)
    seq = tokens(80, seed=s0)
    plan = [
        (0, s0, False),
        (s0, s0 + k + 1, True),
        (s0 + 1, s0 + 2, False),
        (s0 + 2, s0 + 3 + k, True),
        (s0 + 3, 70, False),
    ]
    assert _verify_like(h, seq, plan, slot=1, table=h.blocks(5)) < ATOL


def test_a_start_further_back_than_k_is_refused(v4_tiny):
    h = Harness(v4_tiny, speculative_tokens=2)
    table, seq = h.blocks(4), tokens(40, seed=5)
    m, kv, slots = h.rt.model, h.rt.kv, h.rt.slots
    m.forward_paged(torch.tensor(seq[:20]), [Span(0, 20, 0, table)], kv, slots)
    m.forward_paged(torch.tensor(seq[20:23]), [Span(20, 23, 0, table)], kv, slots)
    m.forward_paged(torch.tensor(seq[21:22]), [Span(21, 22, 0, table)], kv, slots)  # 23 - 2
    with pytest.raises(StateMismatchError, match="written to 23; a forward may start at most 2"):
        m.forward_paged(torch.tensor(seq[20:21]), [Span(20, 21, 0, table)], kv, slots)
    with pytest.raises(StateMismatchError, match="state is at 22, forward starts at 23"):
        m.forward_paged(torch.tensor(seq[23:24]), [Span(23, 24, 0, table)], kv, slots)


def test_without_speculation_the_layout_is_unchanged(v4_tiny):
    """k = 0 keeps one overlap entry (stored without its axis) and r partial rows."""
    geo = Harness(v4_tiny).rt.geometry
    assert geo.overlap_entries == 1 and geo.partial_rows(4) == 4
    assert dict((f.name, f.shape) for f in geo.state_fields)["csa_overlap_kv"][1] == 4
    spec = Harness(v4_tiny, speculative_tokens=5).rt.geometry
    assert spec.overlap_entries == 3 and spec.partial_rows(4) == 9 and spec.window_rows == 13


def test_verify_spans_run_as_decode_rows_beside_other_spans(v4_tiny, monkeypatch):
    """With k >= 1, spans past 0 of at most k + 1 tokens (verify spans) run as rows of the
    decode batch (fixed shapes: what graphs capture), beside a one-token span and a prefill
    chunk of another sequence; each row's logits equal the oracle's."""
    import atom.models.deepseek_v4.paged_attention as v4_attention

    rows, chunks = [], []
    real_decode, real_prefill = v4_attention.decode_core, v4_attention.prefill_attention
    monkeypatch.setattr(
        v4_attention, "decode_core", lambda *a: rows.append(a[1].shape[0]) or real_decode(*a)
    )
    monkeypatch.setattr(
        v4_attention,
        "prefill_attention",
        lambda *a: chunks.append(a[1].shape[0]) or real_prefill(*a),
    )
    k = 3
    h = Harness(v4_tiny, speculative_tokens=k)
    seqs = [tokens(60, seed=70 + i) for i in range(3)]
    tables = [h.blocks(4) for _ in seqs]
    starts = [27, 22, 0]
    for i, s in enumerate(starts[:2]):
        h.rt.forward(torch.tensor(seqs[i][:s]), [Span(0, s, i, tables[i])])
    spans = [Span(27, 31, 0, tables[0]), Span(22, 23, 1, tables[1]), Span(0, 20, 2, tables[2])]
    ids = torch.tensor(seqs[0][27:31] + seqs[1][22:23] + seqs[2][:20])
    rows.clear(), chunks.clear()
    out = h.rt.model.forward_paged(ids, spans, h.rt.kv, h.rt.slots, all_logits=True)
    layers = len(v4_tiny.layers)
    assert rows == [5] * layers and chunks == [25] * layers  # 4 + 1 rows; the forward's tokens
    for (lo, hi), seq, sp in zip([(0, 4), (4, 5), (5, 25)], seqs, spans):
        ref = reference_forward(v4_tiny, seq[: sp.end])
        assert (out[lo:hi] - ref[sp.start : sp.end]).abs().max().item() < ATOL
