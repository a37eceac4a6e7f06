"""V4 decode with CUDA graphs (``deepseek_v4.decode_graphs``): the same logits, state and
greedy tokens as the eager forward, and no host sync in a replayed step. Skipped without a GPU;
tests/engine/test_v4_decode_graphs.py runs the host logic on CPU with a fake capture.
"""

from __future__ import annotations

import pytest
import torch

from atom import LLM, SamplingParams
from atom.model_api import Span
from atom.models.deepseek_v4.model import DeepseekV4ForCausalLM
from atom.models.deepseek_v4.presets import preset_config
from atom.models.deepseek_v4.runtime import V4Runtime

from .test_decode_graphs_cuda import assert_same_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _bound(dtype, graphs: bool, blocks=48, slots=8):
    kv = "fp32" if dtype == torch.float32 else "bf16"
    model = DeepseekV4ForCausalLM(
        preset_config("v4-mini"), dtype=dtype, kv_dtype=kv, index_dtype=kv, device="cuda"
    )
    rt = V4Runtime(model.init_weights(0), block_size=256)
    if graphs:
        assert rt.enable_decode_graphs(slots)
    spec = rt.spec
    pool = torch.zeros(
        spec.pool_shape(blocks + rt.reserved_blocks), dtype=spec.pool_dtype, device="cuda"
    )
    slot_bytes = torch.zeros(
        slots + rt.reserved_slots, spec.state_bytes, dtype=torch.uint8, device="cuda"
    )
    rt.bind(pool, slot_bytes)
    return rt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v4_graph_logits_and_state_equal_eager(dtype):
    """Two runtimes of the same weights, one replaying graphs: decode batches of 2..8
    sequences joining and leaving across CSA (4) and HCA (128) group completions and a block
    boundary: logits within rounding, argmax equal except at near-ties, the same cursors and
    PAGE rows and state close after every step. Each step starts both from the eager state
    (copied into the graphed runtime), so what is compared is one step's arithmetic: left to
    run apart, a rounding difference of 1e-6 flips a near-tied top-k pick some steps later and
    the two runs then decode different states (seen in fp32 at step 21 of 30)."""
    eager, graphed = _bound(dtype, False), _bound(dtype, True)
    g = torch.Generator().manual_seed(0)
    lens = [300, 511, 250, 700, 90, 1000, 256, 5]
    tables = [torch.arange(6 * i, 6 * i + 6) for i in range(8)]  # host tables, as the engine
    prompts = [torch.randint(0, 300, (n,), generator=g) for n in lens]
    for rt in (eager, graphed):
        rt.forward(torch.cat(prompts), [Span(0, n, i, tables[i]) for i, n in enumerate(lens)])
    pos, nxt = list(lens), torch.zeros(8, dtype=torch.int64)
    batches = [[0, 1], [0, 1, 2], list(range(8)), [3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6], [7, 0]]
    tol = 1e-3 if dtype == torch.float32 else 0.25
    steps = 30
    for step in range(steps):
        active = batches[step % len(batches)]
        ids = nxt[active]
        spans = [Span(pos[i], pos[i] + 1, i, tables[i]) for i in active]
        want, got = eager.forward(ids, spans), graphed.forward(ids, spans)
        diff = (want - got).abs().max().item()
        assert diff < tol, (step, diff)
        top2 = want.topk(2, -1).values
        differ = want.argmax(-1) != got.argmax(-1)  # only where rounding decides a near-tie
        assert (top2[differ, 0] - top2[differ, 1] <= 2 * diff).all(), (step, diff)
        nxt[active] = want.argmax(-1).cpu()
        for i in active:
            pos[i] += 1
        assert torch.equal(eager.slots.cursor, graphed.slots.cursor[:8])
        for layer, plane in eager.kv.main.items():
            theirs = graphed.kv.main[layer][:48]
            assert torch.allclose(plane.float(), theirs.float(), atol=tol), (step, layer)
        graphed.pool[:48].copy_(eager.pool)  # PAGE bytes, slot bytes, live scratch
        graphed.slots.data[:8].copy_(eager.slots.data)
        graphed.slots.scratch[:8].copy_(eager.slots.scratch)
    graphs = graphed.graphs
    moe = graphed.model.layers[0].ffn
    probe = torch.empty(0, dtype=dtype, device="cuda")
    with torch.no_grad():  # as the forwards run (with autograd on, the MoE loops)
        paths = [moe.path(len(batches[s % len(batches)]), probe) for s in range(steps)]
    replayed = sum(p != "loop" for p in paths)  # fp32 batches the MoE loops over run eagerly
    assert graphs.replays == replayed > 0 and not graphs.failed, graphs.failed
    assert graphed.slots.host_position[:8] == pos


def test_v4_graph_decode_step_makes_no_host_sync():
    """Graph decode forwards (batch 1 and 4) under ``torch.cuda.set_sync_debug_mode("error")``,
    where any synchronizing call raises; the first round (unchecked) captures the graphs."""
    rt = _bound(torch.bfloat16, True)
    tables = [torch.arange(6 * i, 6 * i + 6) for i in range(4)]
    ids = torch.randint(0, 300, (4 * 300,), generator=torch.Generator().manual_seed(1))
    rt.forward(ids, [Span(0, 300, i, tables[i]) for i in range(4)])
    pos = [300] * 4
    for checked in (False, True):
        for batch in (1, 4):
            spans = [Span(pos[i], pos[i] + 1, i, tables[i]) for i in range(batch)]
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if checked else 0)
            try:
                rt.forward(torch.zeros(batch, dtype=torch.int64), spans)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            for i in range(batch):
                pos[i] += 1
    assert rt.graphs.replays == 4 and not rt.graphs.failed, rt.graphs.failed


def test_v4_engine_with_graphs_decodes_what_it_does_without():
    """v4-mini bf16, 12 sequences of different lengths finishing at different steps: graphs
    replayed at several buckets, the greedy tokens of the engine without graphs (bf16 rounds
    other batch shapes otherwise: parting only at near-ties)."""
    kw = dict(
        block_size=256,
        num_blocks=64,
        max_num_seqs=12,
        max_num_batched_tokens=1024,
        device="cuda",
        dtype="bfloat16",
    )
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in range(90, 1290, 100)]
    params = [SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True, logprobs=5) for i in range(12)]
    graphed = LLM("v4-mini", **kw)
    outs = graphed.generate(prompts, params)
    stats = graphed.engine.runtime.graph_stats()["decode"]
    assert stats["replays"] > 0 and stats["failed"] == 0 and stats["captured"] >= 3, stats
    graphed.shutdown()
    plain = LLM("v4-mini", cuda_graphs=False, **kw)
    assert plain.engine.runtime.graphs is None
    base = plain.generate(prompts, params)
    plain.shutdown()
    assert_same_greedy(outs, base, eps=0.125, most=len(prompts) // 2)


def test_v4_engine_with_drafts_replays_verify_graphs_and_decodes_what_it_does_without():
    """v4-mini bf16 with its (random) MTP block at k = 2: verify forwards replay span graphs,
    none fails, and the greedy tokens are those of the engine without graphs (up to bf16
    near-ties), which are those of plain decoding without drafts."""
    kw = dict(
        block_size=256,
        num_blocks=48,
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        device="cuda",
        dtype="bfloat16",
    )
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in range(100, 900, 100)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True, logprobs=5) for _ in prompts]
    graphed = LLM("v4-mini", speculative_tokens=2, **kw)
    outs = graphed.generate(prompts, params)
    stats = graphed.engine.runtime.graph_stats()["verify"]
    assert stats["replays"] > 0 and stats["failed"] == 0, stats
    graphed.shutdown()
    eager = LLM("v4-mini", speculative_tokens=2, cuda_graphs=False, **kw)
    base = eager.generate(prompts, params)
    eager.shutdown()
    assert_same_greedy(outs, base, eps=0.125, most=len(prompts) // 2)
