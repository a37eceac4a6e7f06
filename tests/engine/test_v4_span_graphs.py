"""V4 span graphs (verify forwards of speculative decoding in CUDA graphs) on CPU, with a fake
capture (``EagerBackend``): the packed rows, a span's earlier positions read from the batch,
rewinds over rejected drafts, padding rows in the spare slot and block all run here.
tests/gpu/test_v4_graphs_cuda.py runs the engine with real graphs.
"""

from __future__ import annotations

import pytest
import torch

from atom.model_api import Span
from atom.models.common.graphs import EagerBackend
from atom.models.deepseek_v4.model import DeepseekV4ForCausalLM
from atom.models.deepseek_v4.presets import preset_config
from atom.models.deepseek_v4.runtime import V4Runtime
from atom.models.deepseek_v4.span_graphs import ROW_FIELDS, pack_rows

from .test_engine_oracle import assert_greedy_matches_oracle
from .test_speculative import GREEDY, prompts_of, truth_of
from .test_speculative import run as run_engine

BLOCK = 16


@pytest.fixture(scope="module")
def v4_tiny():
    return DeepseekV4ForCausalLM(preset_config("v4-tiny")).init_weights(0)


def _runtime(model, k: int, graphs: bool, slots: int = 4, blocks: int = 24):
    rt = V4Runtime(model, block_size=BLOCK, speculative_tokens=k)
    if graphs:
        assert rt.enable_decode_graphs(4, backend=EagerBackend())
    spec = rt.spec
    pool = torch.zeros(spec.pool_shape(blocks + rt.reserved_blocks), dtype=spec.pool_dtype)
    rt.bind(pool, torch.zeros(slots + rt.reserved_slots, spec.state_bytes, dtype=torch.uint8))
    return rt


def test_pack_rows_layout():
    """Two spans (2 rows and 1) in a bucket of 4, width 2: row fields, then tables."""
    spans = [Span(5, 7, 1, torch.tensor([3])), Span(9, 10, 0, torch.tensor([4, 6]))]
    got = pack_rows(torch.tensor([11, 12, 13]), spans, 4, 2, spare_slot=9, spare_block=8)
    nf = len(ROW_FIELDS)
    f = dict(zip(ROW_FIELDS, got[: nf * 4].view(nf, 4).tolist()))
    assert f == {
        "ids": [11, 12, 13, 0],
        "pos": [5, 6, 9, 0],
        "slot": [1, 1, 0, 9],
        "start": [5, 5, 9, 0],
        "end": [7, 7, 10, 1],
        "first": [0, 0, 2, 3],
        "last": [1, 2, 3, 3],
    }
    assert got[nf * 4 :].view(4, 2).tolist() == [[3, 8], [3, 8], [4, 6], [8, 8]]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_verify_graphs_equal_the_eager_forward_through_rewinds(v4_tiny, k):
    """Two sequences verifying drafts (wrong drafts, so every verify rewinds the next one):
    the fake graphs' logits, residuals, cursors, rings, overlap fields and PAGE bytes equal
    the eager runtime's; the padding rows wrote only the spare slot."""
    eager, fake = _runtime(v4_tiny, k, False), _runtime(v4_tiny, k, True)
    g = torch.Generator().manual_seed(k)
    seqs = [torch.randint(0, 300, (70,), generator=g) for _ in range(2)]
    tables = [torch.arange(5 * i, 5 * i + 5) for i in range(2)]
    pos = [19, 26]
    for rt in (eager, fake):
        rt.forward(
            torch.cat([s[:p] for s, p in zip(seqs, pos)]),
            [Span(0, p, i, tables[i]) for i, p in enumerate(pos)],
        )
    for step in range(12):
        n = [1 + (step + i) % (k + 1) for i in range(2)]  # every span length 1 .. k + 1
        spans = [Span(p, p + m, i, tables[i]) for i, (p, m) in enumerate(zip(pos, n))]
        ids = torch.cat([s[p : p + m] for s, p, m in zip(seqs, pos, n)])
        want = eager.forward_with_residual(ids, spans, all_logits=True)
        got = fake.forward_with_residual(ids, spans, all_logits=True)
        for a, b in zip(want, got):
            assert (a - b).abs().max().item() < 1e-4, step
        pos = [p + 1 for p in pos]  # accept nothing: the next verify starts one further
    assert fake.span_graphs.replays["verify"] >= 10 and not fake.span_graphs.failed
    real = eager.slots.num_slots
    assert torch.equal(eager.slots.cursor, fake.slots.cursor[:real])
    for name, field in eager.slots.fields.items():  # rings, overlap fields, header
        theirs = fake.slots.fields[name][:real]
        assert torch.allclose(field.float(), theirs.float(), atol=1e-4), name
    for layer, plane in eager.kv.main.items():  # every real PAGE block
        assert torch.allclose(
            plane.float(), fake.kv.main[layer][: plane.shape[0]].float(), atol=1e-4
        )
    stats = fake.graph_stats()["verify"]
    assert stats["replays"] == fake.span_graphs.replays["verify"] and stats["failed"] == 0


def test_draft_graphs_equal_the_eager_draft_layer(v4_tiny):
    """MTP draft forwards (chained: one over a verify span's rows, then one row per span)
    through fake graphs give the eager draft layer's logits, streams, ring and cursors."""
    k = 3
    eager, fake = _runtime(v4_tiny, k, False), _runtime(v4_tiny, k, True)
    g = torch.Generator().manual_seed(9)
    seqs = [torch.randint(0, 300, (60,), generator=g) for _ in range(2)]
    tables = [torch.arange(5 * i, 5 * i + 5) for i in range(2)]
    outs = []
    for rt in (eager, fake):
        spans = [Span(0, 20, 0, tables[0]), Span(0, 25, 1, tables[1])]
        ids = torch.cat([seqs[0][:20], seqs[1][:25]])
        _, res = rt.forward_with_residual(ids, spans, all_logits=True)
        got = []
        draft = [Span(0, 20, 0, tables[0]), Span(0, 25, 1, tables[1])]  # the prompt's rows
        nxt = torch.cat([seqs[0][1:21], seqs[1][1:26]])
        got.append(rt.draft_forward(nxt, res, draft))
        rows = [Span(20, 23, 0, tables[0]), Span(25, 26, 1, tables[1])]  # verify-sized
        nxt = torch.cat([seqs[0][21:24], seqs[1][26:27]])
        got.append(rt.draft_forward(nxt, got[-1][1][torch.tensor([17, 18, 19, 44])], rows))
        outs.append(got)
    for (a_logits, a_x), (b_logits, b_x) in zip(*outs):
        assert (a_logits - b_logits).abs().max() < 1e-4 and (a_x - b_x).abs().max() < 1e-4
    assert fake.span_graphs.replays["draft"] >= 1 and not fake.span_graphs.failed
    real = eager.slots.num_slots
    assert torch.equal(eager.slots.draft_cursor, fake.slots.draft_cursor[:real])
    assert fake.slots.host_draft[:real] == eager.slots.draft_cursor.tolist()
    assert torch.allclose(eager.slots.window.float(), fake.slots.window[:real].float(), atol=1e-4)


@pytest.mark.parametrize("k", [1, 3])
def test_engine_with_v4_drafts_in_fake_graphs_equals_plain_and_oracle(fake_engine_graphs, k):
    """v4-tiny's MTP block with scripted drafts (a wrong one every 7 positions) under
    preemption, verify forwards in fake graphs: the plain engine's tokens, the oracle's."""
    prompts = prompts_of([40, 33, 47, 20, 38, 45], seed=3)
    tight = dict(num_blocks=16, max_num_seqs=6, model="v4-tiny")
    _, plain = run_engine(prompts, GREEDY, **tight)
    llm, spec = run_engine(prompts, GREEDY, k=k, truth=truth_of(prompts, plain), **tight)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    graphs = fake_engine_graphs[-1].span_graphs
    assert graphs.replays["verify"] > 10 and graphs.replays["draft"] > 10, graphs.replays
    assert not graphs.failed
    counts = llm.engine.stats()["cuda_graphs"]
    assert counts["verify"]["replays"] == graphs.replays["verify"]
    assert counts["draft"]["replays"] == graphs.replays["draft"]
    assert llm.engine.stats()["speculative"]["acceptance_rate"] > 0.5
    for p, o in zip(prompts, spec):
        assert_greedy_matches_oracle(llm.engine.runtime.model, p, o.token_ids)
