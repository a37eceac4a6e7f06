"""Decode graphs' host logic on CPU: buckets, padding, and the whole path with a fake capture.

``EagerBackend`` "captures" by keeping the function and "replays" by running it again on the
static buffers, so everything but the CUDA graph itself runs here: bucket and width choice,
the packed upload, padding rows in the spare slot and block, the mirror, the eager fallbacks.
tests/gpu/test_decode_graphs_cuda.py runs the same with real graphs.
"""

from __future__ import annotations

import pytest
import torch

from atom import LLM, SamplingParams
from atom.model_api import Span
from atom.models.deepseek_v41.decode_graphs import (
    EagerBackend,
    batch_buckets,
    pack_inputs,
    pick_bucket,
    width_bucket,
)
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.paged import StateMismatchError
from atom.models.deepseek_v41.presets import preset_config
from atom.models.deepseek_v41.runtime import V41Runtime

from .test_engine_oracle import assert_drained, assert_greedy_matches_oracle, run_checked
from .workloads import prefix_tree_prompts


def test_batch_buckets_and_pick():
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(1) == [1]
    # a bucket after every size where the path changes: 3 (grouped) never pads to 4 (dense)
    dense_from_4 = lambda n: "dense" if n * 2 >= 8 and n <= 64 else "grouped"  # noqa: E731
    assert batch_buckets(128, dense_from_4) == [1, 2, 3, 4, 8, 16, 32, 64, 128]
    assert [pick_bucket([1, 2, 3, 4, 8], n) for n in (1, 3, 4, 5, 8, 9)] == [1, 3, 4, 8, 8, None]


def test_width_buckets():
    assert [width_bucket(b) for b in range(1, 14)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16]
    assert width_bucket(17) == 24 and width_bucket(25) == 32 and width_bucket(4097) == 6144
    assert width_bucket(17, max_blocks=20) == 20
    assert width_bucket(21, max_blocks=20) is None


def test_pack_inputs_pads_with_spare_slot_and_block():
    spans = [Span(7, 8, 2, torch.tensor([5, 6, 9, 11])), Span(3, 4, 0, torch.tensor([1]))]
    host = pack_inputs(torch.tensor([40, 41]), spans, 4, 3, spare_slot=9, spare_block=99)
    meta, tables = host[:16].view(4, 4), host[16:].view(4, 3)
    assert meta.tolist() == [[40, 41, 0, 0], [7, 3, 0, 0], [2, 0, 9, 9], [8, 4, 1, 1]]
    assert tables.tolist() == [[5, 6, 9], [1, 99, 99], [99, 99, 99], [99, 99, 99]]
    dev = pack_inputs(None, [Span(7, 8, 2, torch.tensor([5], device="meta"))], 1, 2, 9, 99)
    assert dev.tolist() == [0, 7, 2, 8, 99, 99]  # device ids and tables are copied in later


def _runtime(graphs: bool, max_batch: int = 8, blocks: int = 40, slots: int = 6):
    model = DeepseekV41ForCausalLM(preset_config("v41-tiny")).init_weights(0)
    rt = V41Runtime(model, block_size=16)
    if graphs:
        assert rt.enable_decode_graphs(max_batch, backend=EagerBackend())
    spec = rt.spec
    pool = torch.zeros(spec.pool_shape(blocks + rt.reserved_blocks), dtype=spec.pool_dtype)
    rt.bind(pool, torch.zeros(slots + rt.reserved_slots, spec.state_bytes, dtype=torch.uint8))
    return rt


def test_cpu_runtime_has_no_graphs_unless_a_backend_is_given():
    model = DeepseekV41ForCausalLM(preset_config("v41-tiny")).init_weights(0)
    rt = V41Runtime(model, block_size=16)
    assert not rt.enable_decode_graphs(8)
    assert (rt.reserved_blocks, rt.reserved_slots, rt.cuda_graphs) == (0, 0, False)


def test_fake_graphs_equal_eager_forwards_and_state():
    """Decode batches of 1..6 sequences joining and leaving, at widths 1..4 blocks: logits
    and every real block and slot byte equal the eager forward's; only the spare slot and
    block differ. A span at 0, a batch past the largest bucket and fp32's n=1 (the MoE loop
    syncs) run eagerly."""
    eager, fake = _runtime(False), _runtime(True, max_batch=4)
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
        assert torch.allclose(want, got, atol=1e-5, rtol=0), step
        assert torch.equal(want.argmax(-1), got.argmax(-1))
        for k, i in enumerate(active):
            nxt[i], pos[i] = int(want[k].argmax()), pos[i] + 1
    graphs = fake.graphs
    assert graphs.buckets == [1, 2, 4] and not graphs.failed
    assert {b for b, _ in graphs.graphs} == {2, 4}  # 1: the fp32 MoE loop; 6 > 4: eager
    assert {w for _, w in graphs.graphs} >= {3, 4}
    assert graphs.replays == 24 - 3 * 3  # every step but [0], [5] and the batch of 6
    assert [fake.slots.position(i) for i in range(6)] == pos
    # rows rounded in other batch shapes: the logits' tolerance (with torch 2.13's CPU build a
    # PAGE row differed by 3.6e-6, past allclose's default absolute 1e-8)
    close = dict(atol=1e-5, rtol=1e-5)
    assert torch.allclose(
        eager.pool.view(torch.float32), fake.pool.view(torch.float32)[:40], **close
    )
    for name in ("cursor", "header"):
        assert torch.equal(getattr(eager.slots, name), getattr(fake.slots, name)[:6])
    for name in ("window", "comp_values", "comp_scores"):
        assert torch.allclose(getattr(eager.slots, name), getattr(fake.slots, name)[:6], **close)
    assert fake.slots.cursor[6, 0] == 1  # the padding rows' slot: one token at position 0
    # a new sequence's first token (start 0) resets its slot: eager
    replays = graphs.replays
    fake.forward(
        torch.tensor([7, 8]), [Span(0, 1, 0, tables[0]), Span(pos[1], pos[1] + 1, 1, tables[1])]
    )
    assert graphs.replays == replays and fake.slots.position(0) == 1
    # refused like the eager forward, before anything is written
    with pytest.raises(StateMismatchError):
        fake.forward(torch.tensor([1, 2]), [Span(5, 6, 2, tables[2]), Span(9, 10, 3, tables[3])])
    fake.cuda_graphs = False  # the debugging switch: eager from now on
    fake.forward(
        torch.tensor([1, 2]), [Span(1, 2, 0, tables[0]), Span(pos[1] + 1, pos[1] + 2, 1, tables[1])]
    )
    assert graphs.replays == replays


def test_engine_with_fake_graphs_matches_oracle_and_eager(fake_engine_graphs):
    """The oracle workload under pressure (chunks, hits, preemption) with fake graphs: the
    same tokens as the engine without them, every one predicted by the reference forward."""
    kw = dict(
        block_size=16,
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
    llm = LLM("v41-tiny", **kw)
    rt = fake_engine_graphs[0]
    assert llm.engine.runner.pool.shape[0] == 23 and llm.engine.runner.slot_bytes.shape[0] == 9
    outs = run_checked(llm, prompts, params)
    assert rt.graphs.replays > 0 and not rt.graphs.failed
    assert len({b for b, _ in rt.graphs.graphs}) >= 2
    assert llm.engine.stats()["preemptions"] > 0
    for prompt, out in zip(prompts, outs):
        assert_greedy_matches_oracle(rt.model, prompt, out.token_ids)
    assert_drained(llm)
    plain = LLM("v41-tiny", cuda_graphs=False, **kw)
    plain.engine.runtime.cuda_graphs = False  # (the fixture gave it graphs too)
    assert [o.token_ids for o in run_checked(plain, prompts, params)] == [o.token_ids for o in outs]
    assert fake_engine_graphs[1].graphs.replays == 0


def test_drafts_keep_graphs_on():
    """Drafts no longer turn graphs off: their verify and draft forwards replay span graphs
    (tests/engine/test_span_graphs.py)."""
    from types import SimpleNamespace

    from atom.builder import decode_graphs_wanted

    def cfg(device, k, graphs=True, invariant=False):
        return SimpleNamespace(
            device=device, speculative_tokens=k, cuda_graphs=graphs, batch_invariant=invariant
        )

    assert decode_graphs_wanted(cfg("cuda", 0)) is True
    assert decode_graphs_wanted(cfg("cuda:0", 2)) is True
    assert decode_graphs_wanted(cfg("cuda:0", 2, graphs=False)) is False
    # the batch-invariant mode: graphs where its MoE needs no host sync (Triton imports), with
    # drafts too (their replays' bits: tests/gpu/test_batch_invariant_cuda.py)
    import atom.kernels

    for importable in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(atom.kernels, "triton_importable", lambda i=importable: i)
            assert decode_graphs_wanted(cfg("cuda:0", 0, invariant=True)) is importable
            assert decode_graphs_wanted(cfg("cuda:0", 2, invariant=True)) is importable
