"""Compiled glue (``EngineConfig.compile_glue``, atom/models/common/glue_compile.py) on CPU:
regions run compiled only inside graph captures (here ``EagerBackend``'s, whose replays run
the captured function again, compiled as a CUDA graph's kernels would be), compute what the
eager code computes (float32, within rounding), compile once per region rather than once per
layer, and leave every forward outside a capture bit for bit as it was. tests/gpu/
test_glue_compile_cuda.py runs the same with real graphs and counts the kernels."""

from __future__ import annotations

import pytest
import torch

from atom.config import EngineConfig
from atom.model_api import Span
from atom.models.common import glue_compile
from atom.models.deepseek_v41.runtime import V41Runtime
from tests.engine.test_decode_graphs import _runtime as decode_runtime


@pytest.fixture
def glue_on():
    glue_compile.configure(True)
    yield glue_compile.STATS
    glue_compile.configure(False)
    glue_compile.reset()


def _runtime(graphs: bool) -> V41Runtime:
    return decode_runtime(graphs, max_batch=4, blocks=24, slots=4)


def test_the_switch_is_refused_with_the_batch_invariant_mode():
    with pytest.raises(ValueError, match="compile_glue=true with batch_invariant=true"):
        EngineConfig(model="v41-tiny", compile_glue=True, batch_invariant=True)
    assert EngineConfig(model="v41-tiny", compile_glue="true").compile_glue is True


def test_outside_a_capture_a_region_is_the_function_itself(glue_on):
    """Switch on, no capture: nothing compiles and the forward's bits are those of the switch
    off (prefill and eager decode)."""
    calls = dict(glue_on.calls)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 300, (37,), generator=g)
    table = torch.arange(6)
    outs = []
    for on in (True, False):
        glue_compile.configure(on)
        rt = _runtime(False)
        first = rt.forward(prompt, [Span(0, 37, 0, table)])
        step = rt.forward(torch.tensor([5]), [Span(37, 38, 0, table)])
        outs.append((first, step, rt.pool.clone()))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert glue_on.calls == calls


def test_fake_graphs_with_compiled_glue_equal_eager_and_compile_per_region_not_per_layer(
    glue_on,
):
    """Decode steps at batch 2 and 3 (buckets 2 and 4) and widths 1 to 3 through fake graphs
    with the glue compiled: logits and state equal the eager runtime's within float32
    rounding, the greedy tokens equal; every region ran compiled, and the compiles are a
    handful per region, not one per layer and shape."""
    from torch._dynamo.utils import counters

    graphs0 = counters["stats"]["unique_graphs"]
    eager, fake = _runtime(False), _runtime(True)
    layers = len(fake.model.model.layers)
    # the warm-up: the smallest and largest bucket a graph replays (fp32 batch 1 takes the
    # MoE's syncing loop: it runs eagerly and is not captured)
    assert sorted(fake.graphs.graphs) == [(2, 1), (4, 1)], sorted(fake.graphs.graphs)
    g = torch.Generator().manual_seed(0)
    lens = [5, 17, 30]
    tables = [torch.arange(6 * i, 6 * i + 6) for i in range(3)]
    prompts = [torch.randint(0, 300, (n,), generator=g) for n in lens]
    for rt in (eager, fake):
        rt.forward(torch.cat(prompts), [Span(0, n, i, tables[i]) for i, n in enumerate(lens)])
    pos, nxt = list(lens), [0] * 3
    replays = fake.graphs.replays
    for step in range(12):
        active = [0, 1, 2] if step % 3 else [1, 2]
        ids = torch.tensor([nxt[i] for i in active])
        spans = [Span(pos[i], pos[i] + 1, i, tables[i]) for i in active]
        want, got = eager.forward(ids, spans), fake.forward(ids, spans)
        assert torch.allclose(want, got, atol=1e-4, rtol=1e-4), (step, (want - got).abs().max())
        assert torch.equal(want.argmax(-1), got.argmax(-1)), step
        for k, i in enumerate(active):
            nxt[i], pos[i] = int(want[k].argmax()), pos[i] + 1
    assert fake.graphs.replays == replays + 12 and not fake.graphs.failed
    close = dict(atol=1e-4, rtol=1e-4)
    assert torch.allclose(
        eager.pool.view(torch.float32), fake.pool.view(torch.float32)[:24], **close
    )
    for name in ("window", "comp_values", "comp_scores"):
        assert torch.allclose(getattr(eager.slots, name), getattr(fake.slots, name)[:4], **close)
    assert not glue_on.disabled, glue_on.disabled
    regions = {name for name in glue_on.calls}
    assert {r.rsplit(".", 2)[-2] + "." + r.rsplit(".", 1)[-1] for r in regions} >= {
        "HcMixer.mixes",
        "MoE.route",
        "CSA2Attention.queries",
        "CSA2Attention.window_kv",
        "CSA2Attention._output_projection",
    }
    compiled = counters["stats"]["unique_graphs"] - graphs0
    # per region: batch 1 (specialized), the dynamic batch, the layer kinds (ratio, mode, with
    # or without candidates): 28 for 8 regions here (torch 2.13 CPU); a region specialized on
    # its layer (an index read from the module) adds one per layer (at 1198eef, 65)
    assert 0 < compiled <= 5 * len(regions) < layers * len(regions), (compiled, layers)


@pytest.mark.parametrize("model", ["v41-tiny", "v4-tiny"])
def test_an_engine_with_compiled_glue_decodes_the_tokens_it_decodes_without(
    model, fake_engine_graphs
):
    """``compile_glue`` through the engine (fake graphs): the same greedy tokens as the engine
    without it, its decode steps replayed, nothing failed; the switch is the config's."""
    from atom import LLM, SamplingParams

    kw = dict(block_size=16, num_blocks=40, max_num_seqs=4, max_num_batched_tokens=64)
    kw |= dict(dtype="float32", kv_dtype="fp32", index_dtype="fp32", device="cpu")
    prompts = [[(7 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate((9, 30, 47))]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    outs = []
    glue_compile.reset()
    try:
        for on in (False, True):
            llm = LLM(model, compile_glue=on, **kw)
            assert glue_compile.enabled() is on
            outs.append([o.token_ids for o in llm.generate(prompts, params)])
            graphs = fake_engine_graphs[-1].graphs
            assert graphs.replays > 0 and not graphs.failed, graphs.failed
            # no graph of a bucket that takes the MoE's syncing loop (never replayed; on
            # CUDA its capture fails: the warm-up captured one at 81437f4)
            loops = [k for k in graphs.graphs if graphs._path(k[0]) == "loop"]
            assert loops == [], loops
            llm.shutdown()
    finally:
        glue_compile.configure(False)
    assert outs[0] == outs[1]
    assert not glue_compile.STATS.disabled
    attention = {"v41-tiny": "CSA2Attention", "v4-tiny": "V4Attention"}[model]
    ran = {
        name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1] for name in glue_compile.STATS.calls
    }
    assert {f"{attention}.queries", f"{attention}.window_kv", "HcMixer.mixes"} <= ran, ran


def test_a_region_that_fails_to_compile_runs_eagerly_and_the_capture_is_made_again(
    glue_on, monkeypatch
):
    """The router's compiled version raises (as a compile error would): the warm-up's capture
    is made again without it, no graph fails, the router runs eagerly from then on, and the
    graphs' steps equal the eager runtime's."""
    glue_compile.reset()
    real = glue_compile.compile_region

    def failing_router(fn):
        if fn.__qualname__ != "MoE.route":
            return real(fn)

        def raises(*a, **k):
            raise NotImplementedError("a compile failure, on cue")

        return raises

    monkeypatch.setattr(glue_compile, "compile_region", failing_router)
    eager, fake = _runtime(False), _runtime(True)
    assert sorted(fake.graphs.graphs) == [(2, 1), (4, 1)]  # the warm-up, captured again
    assert not fake.graphs.failed, fake.graphs.failed
    assert list(glue_on.disabled) == ["atom.models.common.moe.MoE.route"]
    assert "atom.models.common.moe.MoE.route" not in glue_on.calls
    assert glue_on.calls["atom.models.common.mhc.HcMixer.mixes"] > 0  # the others compiled
    tables, prompt = [torch.arange(6), torch.arange(6, 12)], torch.arange(1, 30)
    for rt in (eager, fake):
        rt.forward(torch.cat([prompt, prompt]), [Span(0, 29, i, tables[i]) for i in (0, 1)])
    ids, spans = torch.tensor([3, 4]), [Span(29, 30, i, tables[i]) for i in (0, 1)]
    replays = fake.graphs.replays
    want, got = (rt.forward(ids, spans) for rt in (eager, fake))
    assert fake.graphs.replays == replays + 1  # the step ran in the graph, router eager
    assert torch.allclose(want, got, atol=1e-4, rtol=1e-4)
