"""Decode CUDA graphs (#14 item 3): the same greedy tokens with graphs as without, no host
sync in a decode forward. Skipped without a GPU (tests/engine/test_decode_graphs.py runs the
host logic on CPU with a fake capture)."""

from __future__ import annotations

import pytest
import torch

from atom import LLM, SamplingParams
from atom.model_api import Span
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.presets import preset_config
from atom.models.deepseek_v41.runtime import V41Runtime
from tests.engine.test_engine_oracle import assert_drained, run_checked
from tests.engine.workloads import prefix_tree_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def assert_same_greedy(graphed, plain, eps: float, most: int = 0):
    """Every sequence's tokens equal, or they part at a near-tie of the eager engine: the
    graphed engine takes another of its top tokens (as many as the outputs' logprobs list)
    within ``eps`` (logprob) of the best.
    Two evaluations of another batch shape differ by rounding, which decides such a tie
    (tests/model/ties.py); at most ``most`` sequences may part so."""
    parted = []
    for k, (g, p) in enumerate(zip(graphed, plain)):
        j = next((j for j, (a, b) in enumerate(zip(g.token_ids, p.token_ids)) if a != b), None)
        if j is None:
            assert g.token_ids == p.token_ids
            continue
        top = p.logprobs[j].top
        (first, lp1), (second, lp2) = top[:2]
        # the graphed engine took another of the eager engine's best tokens, within ``eps`` of
        # the best (at an exact tie the logprobs may list either first: the eager pick need
        # not be ``first``; with more than 2 logprobs, a three-way near-tie is seen too)
        other = {t for t, lp in top if lp1 - lp < eps} - {p.token_ids[j]}
        assert g.token_ids[j] in other, (
            f"sequence {k} parts at output {j}: graphs {g.token_ids[j]}, eager {first} "
            f"(top-2 gap {lp1 - lp2:.3g}, second {second}; listed "
            f"{[(t, round(lp1 - lp, 3)) for t, lp in top]} as (token, gap to the best))"
        )
        parted.append((k, j, lp1 - lp2))
    assert len(parted) <= most, parted


def _engine_pair(model: str, prompts, params, **kw):
    """(outputs with graphs, outputs without, the graphs) of two engines of one config."""
    with_graphs = LLM(model, device="cuda", **kw)
    graphs = with_graphs.engine.runtime.graphs
    assert graphs is not None and with_graphs.engine.runtime.cuda_graphs
    outs = run_checked(with_graphs, prompts, params)
    assert_drained(with_graphs)
    stats = with_graphs.engine.stats()
    eager = LLM(model, device="cuda", cuda_graphs=False, **kw)
    assert eager.engine.runtime.graphs is None
    plain = run_checked(eager, prompts, params)
    return outs, plain, graphs, stats


def test_tiny_fp32_oracle_workload_same_tokens_with_graphs():
    """The engine-oracle workload (prefix trees under pressure: chunks, hits, preemption,
    batches joining and leaving) on v41-tiny fp32: the same greedy tokens with and without
    graphs (``assert_same_greedy``), several buckets replayed (fp32's batch of 1 runs
    eagerly: its MoE loop syncs)."""
    kw = dict(
        block_size=16,
        num_blocks=22,
        max_num_seqs=8,
        max_num_batched_tokens=40,
        dtype="float32",
        kv_dtype="fp32",
        index_dtype="fp32",
    )
    prompts = prefix_tree_prompts(24, 16, 1)  # tests/engine's oracle workload with preemption
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2)
    outs, plain, graphs, stats = _engine_pair("v41-tiny", prompts, params, **kw)
    assert not graphs.failed, graphs.failed
    assert graphs.replays > 0 and len({b for b, _ in graphs.graphs}) >= 2, graphs.graphs.keys()
    assert stats["preemptions"] > 0
    assert_same_greedy(outs, plain, eps=1e-4, most=2)


def test_mini_bf16_same_tokens_with_graphs():
    """v41-mini bf16 (fp8 index rows), 16 sequences of different lengths finishing at
    different steps: batches from 16 down to 1, buckets 1..16 (1 and 2 on grouped MoE, 4+
    dense), widths growing past block boundaries."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in range(40, 1000, 60)]
    params = [
        SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True, logprobs=5)
        for i in range(len(prompts))
    ]
    kw = dict(num_blocks=96, max_num_seqs=16, max_num_batched_tokens=1024, dtype="bfloat16")
    outs, plain, graphs, _ = _engine_pair("v41-mini", prompts, params, **kw)
    assert not graphs.failed, graphs.failed
    assert len({b for b, _ in graphs.graphs}) >= 4, graphs.graphs.keys()
    # bf16 CUDA runs are not bitwise repeatable: at 113b4b5 this test passed and then parted at
    # a top-2 gap of 0.094 on the next run of the same code (0.05 had been enough until then),
    # and at 0f18f34 at a three-way near-tie (5 logprobs list it)
    assert_same_greedy(outs, plain, eps=0.125, most=len(prompts) // 2)


def _bound(dtype, graphs: bool, blocks=48, slots=8):
    cfg = preset_config("v41-mini")
    kv = "fp32" if dtype == torch.float32 else "bf16"
    model = DeepseekV41ForCausalLM(cfg, dtype=dtype, kv_dtype=kv, index_dtype="fp8", device="cuda")
    rt = V41Runtime(model.init_weights(0), block_size=256)
    if graphs:
        rt.enable_decode_graphs(slots)
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
def test_graph_logits_and_state_equal_eager(dtype):
    """Two runtimes of the same weights, one replaying graphs: decode batches 2..8 joining
    and leaving (device block tables and token ids, as the benchmarks pass them): logits
    within rounding, the same argmax, the same cursors and every real PAGE block close."""
    eager, graphed = _bound(dtype, False), _bound(dtype, True)
    g = torch.Generator().manual_seed(0)
    lens = [300, 511, 512, 700, 90, 1000, 256, 5]
    tables = [torch.arange(6 * i, 6 * i + 6, device="cuda") for i in range(8)]
    prompts = [torch.randint(0, 256, (n,), generator=g) for n in lens]
    for rt in (eager, graphed):
        rt.forward(torch.cat(prompts), [Span(0, n, i, tables[i]) for i, n in enumerate(lens)])
    pos, nxt = list(lens), torch.zeros(8, dtype=torch.int64, device="cuda")
    batches = [[0, 1], [0, 1, 2], list(range(8)), [3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6], [7, 0]]
    tol = 1e-3 if dtype == torch.float32 else 0.25
    for step in range(30):
        active = batches[step % len(batches)]
        ids = nxt[active]
        spans = [Span(pos[i], pos[i] + 1, i, tables[i]) for i in active]
        want, got = eager.forward(ids, spans), graphed.forward(ids, spans)
        diff = (want - got).abs().max().item()
        assert diff < tol, (step, diff)
        top2 = want.topk(2, -1).values
        differ = want.argmax(-1) != got.argmax(-1)  # only where rounding decides a near-tie
        assert (top2[differ, 0] - top2[differ, 1] <= 2 * diff).all(), (step, diff)
        nxt[active] = want.argmax(-1)
        for i in active:
            pos[i] += 1
    # fp32: batches under 4 run the MoE loop (a host sync per layer): eager
    replayed = sum(
        dtype == torch.bfloat16 or len(batches[step % len(batches)]) >= 4 for step in range(30)
    )
    assert graphed.graphs.replays == replayed and not graphed.graphs.failed, graphed.graphs.failed
    assert torch.equal(eager.slots.cursor, graphed.slots.cursor[:8])
    main = eager.kv.main[2].float(), graphed.kv.main[2][:48].float()
    assert torch.allclose(*main, atol=tol)


def test_graph_decode_step_makes_no_host_sync():
    """Graph decode forwards (batch 1: grouped MoE; batch 4: dense) under
    ``torch.cuda.set_sync_debug_mode("error")``, where any synchronizing call raises; the
    first round (no check) builds what forwards cache and captures the graphs."""
    rt = _bound(torch.bfloat16, True)
    tables = [torch.arange(6 * i, 6 * i + 6) for i in range(4)]  # host tables, as the engine
    ids = torch.randint(0, 256, (4 * 300,), generator=torch.Generator().manual_seed(1))
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
