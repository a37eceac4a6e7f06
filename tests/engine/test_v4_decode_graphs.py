"""V4 decode graphs' host logic on CPU with a fake capture (``EagerBackend``: "replay" re-runs
the captured function on the static buffers), so buckets, widths, padding rows in the spare
slot and block, the packed upload and the fixed-shape batch all run here.
tests/gpu/test_v4_cuda.py runs the same with real graphs.
"""

from __future__ import annotations

import pytest
import torch

from atom import LLM, SamplingParams
from atom.model_api import Span
from atom.models.common.graphs import EagerBackend
from atom.models.deepseek_v4.model import DeepseekV4ForCausalLM
from atom.models.deepseek_v4.paged import StateMismatchError
from atom.models.deepseek_v4.presets import preset_config
from atom.models.deepseek_v4.runtime import V4Runtime

from .test_engine_oracle import assert_drained, run_checked
from .workloads import prefix_tree_prompts

BLOCK = 16


def _runtime(graphs: bool, max_batch: int = 4, blocks: int = 40, slots: int = 6):
    model = DeepseekV4ForCausalLM(preset_config("v4-tiny")).init_weights(0)
    rt = V4Runtime(model, block_size=BLOCK)
    if graphs:
        assert rt.enable_decode_graphs(max_batch, backend=EagerBackend())
    spec = rt.spec
    pool = torch.zeros(spec.pool_shape(blocks + rt.reserved_blocks), dtype=spec.pool_dtype)
    rt.bind(pool, torch.zeros(slots + rt.reserved_slots, spec.state_bytes, dtype=torch.uint8))
    return rt


def test_cpu_runtime_has_no_graphs_unless_a_backend_is_given():
    rt = V4Runtime(DeepseekV4ForCausalLM(preset_config("v4-tiny")), block_size=BLOCK)
    assert not rt.enable_decode_graphs(8)
    assert (rt.reserved_blocks, rt.reserved_slots, rt.cuda_graphs, rt.graph_stats()) == (
        0,
        0,
        False,
        {},
    )


def test_fake_graphs_equal_eager_forwards_and_state():
    """Decode batches of 1..6 sequences joining and leaving, across group completions of both
    ratios (4 and 8) and block boundaries: logits, cursors, window rings, overlap fields and
    every real PAGE block equal the eager forward's within rounding; the padding rows wrote
    only the spare slot. n=1 (the fp32 MoE loop syncs) and a batch past the largest bucket
    run eagerly."""
    eager, fake = _runtime(False), _runtime(True)
    g = torch.Generator().manual_seed(0)
    lens = [5, 17, 40, 33, 2, 60]
    tables = [torch.arange(6 * i, 6 * i + 6) for i in range(6)]
    prompts = [torch.randint(0, 300, (n,), generator=g) for n in lens]
    for rt in (eager, fake):
        rt.forward(torch.cat(prompts), [Span(0, n, i, tables[i]) for i, n in enumerate(lens)])
    pos, nxt = list(lens), [0] * 6
    batches = [[0], [1, 2], [0, 1, 2], [2, 3, 4, 5], [0, 1, 2, 3, 4, 5], [5], [1, 3, 4], [0, 2]]
    for step in range(24):
        active = batches[step % len(batches)]
        ids = torch.tensor([nxt[i] for i in active])
        spans = [Span(pos[i], pos[i] + 1, i, tables[i]) for i in active]
        want, got = eager.forward(ids, spans), fake.forward(ids, spans)
        assert torch.allclose(want, got, atol=1e-5, rtol=0), (step, (want - got).abs().max())
        assert torch.equal(want.argmax(-1), got.argmax(-1))
        for k, i in enumerate(active):
            nxt[i], pos[i] = int(want[k].argmax()), pos[i] + 1
    graphs = fake.graphs
    assert graphs.buckets == [1, 2, 4] and not graphs.failed
    assert {b for b, _ in graphs.graphs} == {2, 4}  # 1: the fp32 MoE loop; 6 > 4: eager
    assert {w for _, w in graphs.graphs} >= {3, 4}
    assert graphs.replays == 24 - 3 * 3  # every step but [0], [5] and the batch of 6
    assert fake.graph_stats()["decode"] == {
        "captured": len(graphs.graphs),
        "replays": 15,
        "failed": 0,
    }
    assert [fake.slots.position(i) for i in range(6)] == pos == fake.slots.host_position[:6]
    close = dict(atol=1e-5, rtol=1e-5)
    assert torch.allclose(
        eager.pool.view(torch.float32), fake.pool.view(torch.float32)[:40], **close
    )
    for name, view in eager.slots.fields.items():
        other = fake.slots.fields[name][:6]
        if view.dtype == torch.int64:
            assert torch.equal(view, other), name
        else:
            assert torch.allclose(view, other, **close), name
    assert fake.slots.cursor[6, 0] == 1  # the padding rows' slot: one token at position 0
    # a new sequence's first token (start 0) resets its slot: eager
    replays = graphs.replays
    fake.forward(
        torch.tensor([7, 8]), [Span(0, 1, 0, tables[0]), Span(pos[1], pos[1] + 1, 1, tables[1])]
    )
    assert graphs.replays == replays and fake.slots.position(0) == 1
    with pytest.raises(StateMismatchError):  # refused like the eager forward
        fake.forward(torch.tensor([1, 2]), [Span(5, 6, 2, tables[2]), Span(9, 10, 3, tables[3])])
    fake.cuda_graphs = False  # the debugging switch: eager from now on
    fake.forward(
        torch.tensor([1, 2]), [Span(1, 2, 0, tables[0]), Span(pos[1] + 1, pos[1] + 2, 1, tables[1])]
    )
    assert graphs.replays == replays


def test_engine_with_fake_graphs_equals_the_engine_without(fake_engine_graphs):
    """The engine under pressure (chunks, prefix hits, preemption) on v4-tiny with fake
    graphs: the same greedy tokens as without them, and graphs replayed at several buckets."""
    kw = dict(
        block_size=BLOCK,
        num_blocks=22,
        max_num_seqs=8,
        max_num_batched_tokens=40,
        dtype="float32",
        kv_dtype="fp32",
        index_dtype="fp32",
        device="cpu",
    )
    prompts = prefix_tree_prompts(24, 16, 1)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    llm = LLM("v4-tiny", **kw)
    rt = fake_engine_graphs[0]
    assert llm.engine.runner.pool.shape[0] == 23 and llm.engine.runner.slot_bytes.shape[0] == 9
    outs = run_checked(llm, prompts, params)
    assert rt.graphs.replays > 0 and not rt.graphs.failed
    assert len({b for b, _ in rt.graphs.graphs}) >= 2
    assert llm.engine.stats()["preemptions"] > 0
    assert_drained(llm)
    plain = LLM("v4-tiny", cuda_graphs=False, **kw)
    plain.engine.runtime.cuda_graphs = False  # (the fixture gave it graphs too)
    assert [o.token_ids for o in run_checked(plain, prompts, params)] == [o.token_ids for o in outs]
    assert fake_engine_graphs[1].graphs.replays == 0
