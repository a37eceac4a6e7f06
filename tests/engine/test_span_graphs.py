"""Span graphs (speculative decoding's verify and draft forwards in CUDA graphs) on CPU.

``EagerBackend`` "captures" by keeping the function and "replays" it on the static buffers,
so everything but the CUDA graph itself runs here: the packed rows, a span's earlier positions
read from the batch instead of the rings, rewinds, padding rows, the dump block, the draft
cursors' host mirror. tests/gpu/test_speculative_cuda.py runs the engine with real graphs.
"""

from __future__ import annotations

import pytest
import torch

from atom import LLM, SamplingParams
from atom.model_api import Span
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.paged import StateMismatchError
from atom.models.deepseek_v41.presets import preset_config
from atom.models.deepseek_v41.span_graphs import ROW_FIELDS, pack_rows

from ..model.test_v41_rewind import (
    assert_close,
    assert_read_state_matches,
    continue_plainly,
    plain,
    runtime,
    speculative,
    tokens,
)
from .test_engine_oracle import assert_greedy_matches_oracle
from .test_speculative import GREEDY, KW, MODEL, prompts_of, truth_of
from .test_speculative import run as run_engine


def test_pack_rows_layout():
    """Two spans (2 and 1 rows) in a bucket of 4, history width 4 (k = 1), width 2."""
    spans = [Span(7, 9, 2, torch.tensor([5, 6, 8])), Span(3, 4, 0, torch.tensor([1]))]
    h, b = 4, 4
    host = pack_rows(torch.tensor([40, 41, 42]), spans, [8, 3], b, 2, h, 9, 99)
    nf = len(ROW_FIELDS)
    f = dict(zip(ROW_FIELDS, host[: nf * b].view(nf, b).tolist()))
    assert f["ids"] == [40, 41, 42, 0]
    assert f["pos"] == [7, 8, 3, 0] and f["slot"] == [2, 2, 0, 9]
    assert f["start"] == [7, 7, 3, 0] and f["first"] == [0, 0, 2, 3]
    assert f["span_slot"] == [2, 0, 9, 9] and f["span_end"] == [9, 4, 1, 1]
    assert f["span_last"] == [1, 2, 2, 3] and f["front"] == [9, 4, 1, 1]
    gram = host[nf * b : nf * b + 4 * b].view(b, 4).tolist()
    # span 0 (frontier 8, one past its start: a rewind): ids at 4, 5, 6 are old history
    # entries h - 8 + q of span 0 (after the 4 token ids), then its own rows
    assert gram[0] == [4 + 0 + 4 - 8 + 4, 4 + 4 - 8 + 5, 4 + 4 - 8 + 6, 0]
    assert gram[1] == [4 + 4 - 8 + 5, 4 + 4 - 8 + 6, 0, 1]
    assert gram[2] == [4 + 4 * 1 + 4 - 3 + 0, 4 + 4 + 4 - 3 + 1, 4 + 4 + 4 - 3 + 2, 2]
    hist = host[nf * b + 4 * b : nf * b + 4 * b + h * b].view(b, h).tolist()
    assert hist[0] == [4 + 4 - 8 + 5, 4 + 4 - 8 + 6, 0, 1]  # ids at 5..8, new frontier 9
    tables = host[(nf + 4 + h) * b :].view(b, 2).tolist()
    assert tables == [[5, 6], [5, 6], [1, 99], [99, 99]]


@pytest.fixture(scope="module")
def tiny():
    return DeepseekV41ForCausalLM(preset_config("v41-tiny")).init_weights(0)


@pytest.fixture(scope="module")
def tiny_draft():
    return DeepseekV41ForCausalLM(preset_config("v41-tiny-draft")).init_weights(0)


@pytest.mark.parametrize("k,seed,preset", [(1, 0, ""), (2, 1, "draft"), (3, 2, "")])
def test_verify_graphs_equal_plain_decoding_through_rewinds(tiny, tiny_draft, k, seed, preset):
    """Verify spans with right and wrong drafts (every length 1..k + 1, rewinds over rejected
    drafts) through fake graphs give plain decoding's logits and leave the state it leaves."""
    model = tiny_draft if preset else tiny
    seq = tokens(52, seed=10 + seed)
    ref_logits, ref = plain(model, seq, 5, k)
    rt = runtime(model, k, num_slots=1, graphs=True)
    [logits], [done] = speculative(rt, [seq], 5, k, seed, final=44)
    graphs = rt.span_graphs
    assert graphs.replays["verify"] >= 10 and not graphs.failed and rt.rewinds >= 3
    assert {key[1] for key in graphs.graphs} >= {2}  # n = 1 is fp32's MoE loop: eager
    assert_close(logits, ref_logits[:done])
    [tail] = continue_plainly(rt, [seq], [done])
    assert_close(tail, ref_logits[done:])
    assert_read_state_matches(rt, 0, ref, 0, 52)


def test_several_slots_rewinding_in_one_verify_graph(tiny):
    k = 3
    seqs = [tokens(n, seed=20 + n) for n in (40, 37, 45)]
    refs = [plain(tiny, q, 6, k) for q in seqs]
    rt = runtime(tiny, k, graphs=True)
    got, done = speculative(rt, seqs, 6, k, seed=5, final=30)
    assert rt.span_graphs.replays["verify"] >= 5 and rt.rewinds >= 6
    tails = continue_plainly(rt, seqs, done)
    for s, (ref_logits, ref) in enumerate(refs):
        assert_close(torch.cat([got[s], tails[s]]), ref_logits)
        assert_read_state_matches(rt, s, ref, 0, len(seqs[s]))
    pad = rt.slots.num_slots - 1  # padding rows wrote only the spare slot and block
    assert rt.slots.position(pad) == 0 and len(rt.slots.host_position) == pad + 1


def test_verify_graphs_refuse_as_the_eager_forward_does(tiny):
    rt = runtime(tiny, 2, num_slots=2, graphs=True)
    seq = tokens(20, seed=1)
    rt.forward_with_residual(seq[:10], [Span(0, 10, 0, torch.arange(6))], all_logits=True)
    before = rt.slots.data.clone()
    with pytest.raises(StateMismatchError):  # 3 behind the cursor with k = 2
        rt.forward_with_residual(seq[7:9], [Span(7, 9, 0, torch.arange(6))], all_logits=True)
    with pytest.raises(StateMismatchError):  # past the cursor
        rt.forward_with_residual(seq[11:13], [Span(11, 13, 0, torch.arange(6))])
    assert torch.equal(rt.slots.data, before) and not rt.span_graphs.graphs


def test_graph_counts_survive_a_rebind(tiny):
    """``graph_stats`` feeds Prometheus counters: binding again (new graphs) keeps the counts."""
    rt = runtime(tiny, 1, num_slots=2, graphs=True)
    seq = tokens(20, seed=2)
    spans = [Span(0, 8, 0, torch.arange(6)), Span(0, 9, 1, torch.arange(6, 12))]
    rt.forward_with_residual(torch.cat([seq[:8], seq[:9]]), spans, all_logits=True)
    spans = [Span(8, 10, 0, torch.arange(6)), Span(9, 11, 1, torch.arange(6, 12))]
    rt.forward_with_residual(torch.cat([seq[8:10], seq[9:11]]), spans, all_logits=True)
    before = rt.graph_stats()
    assert before["verify"] == {"captured": 1, "replays": 1, "failed": 0}
    rt.bind(rt.pool, rt.slot_bytes)
    after = rt.graph_stats()
    assert after["verify"] == {"captured": 0, "replays": 1, "failed": 0}
    assert after["decode"] == before["decode"] and after["draft"]["replays"] == 0


class FailingBackend:
    def __init__(self):
        self.fresh_pools = 0

    def capture(self, fn):
        raise RuntimeError("capture refused")

    def after_failure(self):
        self.fresh_pools += 1


def test_a_failed_capture_runs_eagerly_and_is_counted(tiny):
    eager, rt = runtime(tiny, 1, num_slots=2), runtime(tiny, 1, num_slots=2, graphs=True)
    rt.span_graphs.backend = backend = FailingBackend()
    seq = tokens(20, seed=4)
    spans = [Span(0, 8, 0, torch.arange(6)), Span(0, 9, 1, torch.arange(6, 12))]
    for _ in range(3):
        ids = torch.cat([seq[sp.start : sp.end] for sp in spans])
        want, got = (r.forward_with_residual(ids, spans, all_logits=True) for r in (eager, rt))
        for a, b in zip(want, got):
            assert_close(a, b)
        spans = [Span(sp.end, sp.end + 2, sp.slot, sp.block_table) for sp in spans]
    # one key tried once: recorded, a fresh pool asked for, then eager without trying again
    assert list(rt.span_graphs.failed) == [("verify", 4, 1)] and backend.fresh_pools == 1
    assert rt.graph_stats()["verify"] == {"captured": 0, "replays": 0, "failed": 1}


def test_draft_graphs_equal_the_eager_draft_layer(tiny_draft):
    """Both draft layers over spans of 1..k + 1 rows of two slots, each continuing where its
    chain left it or rewinding over rejected proposals: logits, streams, the layers' rings and
    cursors (device and host mirror) equal the eager layer's."""
    k = 2
    eager = runtime(tiny_draft, k, num_slots=2)
    fake = runtime(tiny_draft, k, num_slots=2, graphs=True)
    grad = []  # whether the draft layers' MoE ran with autograd on (on CUDA it then takes the
    # per-expert loop, whose host sync breaks a capture)
    hooks = [
        layer.mlp.register_forward_hook(lambda *a: grad.append(torch.is_grad_enabled()))
        for layer in tiny_draft.mtp
    ]
    for rt in (eager, fake):  # as the target's first forward does
        rt.slots.reset(0)
        rt.slots.reset(1)
    g = torch.Generator().manual_seed(3)
    c = tiny_draft.config
    starts = [0, 0]
    for step in range(14):
        spans, ids = [], []
        for slot in (0, 1):
            length = 6 if step == 0 else int(torch.randint(1, k + 2, (1,), generator=g))
            spans.append(Span(starts[slot], starts[slot] + length, slot, torch.arange(0)))
            ids.append(torch.randint(0, 320, (length,), generator=g))
        n = sum(sp.num_tokens for sp in spans)
        residual = torch.randn(n, c.hc_mult, c.hidden_size, generator=g)
        for layer in (0, 1):
            want = eager.draft_forward(torch.cat(ids), residual, spans, layer=layer)
            got = fake.draft_forward(torch.cat(ids), residual, spans, layer=layer)
            for a, b in zip(want, got):
                assert_close(a, b)
        for slot, sp in enumerate(spans):  # the next start: up to k back (rejected drafts)
            back = int(torch.randint(0, min(k, sp.num_tokens - 1) + 1, (1,), generator=g))
            starts[slot] = sp.end - back
    assert fake.span_graphs.replays["draft"] == 2 * 13  # the first span of 6 rows: eager
    layers = [c.num_hidden_layers, c.num_hidden_layers + 1]
    assert_close(eager.slots.window[:2, layers].float(), fake.slots.window[:2, layers].float())
    assert torch.equal(eager.slots.draft_cursor[:2], fake.slots.draft_cursor[:2])
    assert fake.slots.host_draft[:2] == fake.slots.draft_cursor[:2].tolist()
    for h in hooks:
        h.remove()
    assert len(grad) > 26 and not any(grad)  # every draft forward (graphs too) without autograd


@pytest.mark.parametrize("k", [1, 3])
def test_engine_with_drafts_in_fake_graphs_equals_plain_and_oracle(fake_engine_graphs, k):
    """Scripted drafts (a wrong one every 7 positions) under preemption, the verify and draft
    forwards in fake graphs: the plain engine's tokens, every one the oracle's."""
    prompts = prompts_of([40, 33, 47, 20, 38, 45], seed=3)
    tight = dict(num_blocks=16, max_num_seqs=6)
    _, plain_outs = run_engine(prompts, GREEDY, **tight)
    llm, spec = run_engine(prompts, GREEDY, k=k, truth=truth_of(prompts, plain_outs), **tight)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain_outs]
    graphs = fake_engine_graphs[-1].span_graphs
    assert graphs.replays["verify"] > 10 and graphs.replays["draft"] > 10, graphs.replays
    assert not graphs.failed
    assert llm.engine.stats()["preemptions"] > 0
    assert llm.engine.stats()["speculative"]["acceptance_rate"] > 0.5
    counts = llm.engine.stats()["cuda_graphs"]  # engine.stats() and /metrics say what replayed
    assert counts["verify"] == {
        "captured": sum(key[0] == "verify" for key in graphs.graphs),
        "replays": graphs.replays["verify"],
        "failed": 0,
    }
    assert counts["draft"]["replays"] == graphs.replays["draft"] and counts["decode"]["failed"] == 0
    text = llm.engine.metrics.render()
    assert f'atom_cuda_graph_replays_total{{kind="verify"}} {graphs.replays["verify"]}' in text
    assert 'atom_cuda_graph_capture_failures_total{kind="draft"} 0' in text
    for p, o in zip(prompts, spec):
        assert_greedy_matches_oracle(llm.engine.runtime.model, p, o.token_ids)


def test_engine_turns_span_graphs_off_with_cuda_graphs_off(fake_engine_graphs):
    llm = LLM(MODEL, speculative_tokens=2, cuda_graphs=False, **KW)
    rt = fake_engine_graphs[-1]
    rt.cuda_graphs = False  # (the fixture gave it graphs too): the debugging switch
    llm.generate(prompts_of([9, 20]), SamplingParams(max_tokens=8, ignore_eos=True))
    assert rt.span_graphs.replays == {"verify": 0, "draft": 0}
