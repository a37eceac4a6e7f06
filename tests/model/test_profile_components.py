"""benchmarks.profile_components on CPU (v41-mini, 2 sequences of 20 tokens): every
component's range is found once per call, nested ranges are attributed to the outermost of
their label, and instrumenting is undone (the model's functions are the originals again)."""

import torch
from torch.profiler import ProfilerActivity, profile

from atom.model_api import Span
from atom.models.deepseek_v41 import engram, paged_attention, paged_decode
from benchmarks import profile_components as pc
from benchmarks.common import bound_runtime


def test_ranges_are_counted_once_per_call_and_instrumenting_is_undone():
    originals = (
        engram.Engram.forward,
        paged_attention.decode_attention,
        paged_decode._complete_groups,
    )
    rt = bound_runtime("v41-mini", torch.float32, "cpu", 2, 2)
    cfg = rt.model.config
    tables = [torch.tensor([0]), torch.tensor([1])]
    ids = torch.randint(0, cfg.vocab_size, (2 * 20,), generator=torch.Generator().manual_seed(0))
    rt.forward(ids, [Span(0, 20, 0, tables[0]), Span(0, 20, 1, tables[1])])
    labels = [label for _, _, label in pc._components()]
    restore = pc.instrument()
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            rt.forward(
                torch.tensor([1, 2]), [Span(20, 21, 0, tables[0]), Span(20, 21, 1, tables[1])]
            )
    finally:
        restore()
    rows, total_us, _ = pc.breakdown(prof, labels, cuda=False)
    layers_n = cfg.num_hidden_layers
    assert rows["layer"][2] == layers_n
    assert rows["attention (decode, all)"][2] == layers_n
    assert rows["engram"][2] == len(cfg.engram_layer_ids)
    assert rows["mhc mixes (mix, sinkhorn)"][2] == 2 * layers_n  # no head mixer (published)
    assert rows["mhc collapse"][2] == 2 * layers_n + 1  # + the head's
    assert 0 < rows["layer"][0] <= total_us  # CPU: host time of the ranges
    now = (engram.Engram.forward, paged_attention.decode_attention, paged_decode._complete_groups)
    assert now == originals
