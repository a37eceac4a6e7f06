"""The MoE's grouped-GEMM path on CUDA (bf16, sm90+): the same math as the per-expert loop,
and the same bits on every run (each token's expert outputs are summed in slot order, not
with atomics)."""

from __future__ import annotations

import pytest
import torch

from atom.models.common.moe import _GROUPED_MM, MoE, _grouped_mm_usable
from atom.models.deepseek_v41.presets import preset_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _moe():
    cfg = preset_config("v41-mini")
    torch.manual_seed(0)
    moe = MoE(cfg, torch.bfloat16).to("cuda")
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.02)
    return moe, cfg


@torch.no_grad()
@pytest.mark.parametrize("off", ["moe_combine", ""])
def test_grouped_path_matches_the_loop_and_repeats_bit_for_bit(monkeypatch, off):
    monkeypatch.setenv("ATOM_TRITON_OFF", off)  # the torch expression, or the kernel
    moe, cfg = _moe()
    x = torch.randn(300, cfg.hidden_size, device="cuda").to(torch.bfloat16)
    if not _grouped_mm_usable(x):
        pytest.skip("torch._grouped_mm needs sm90+ here")
    assert moe.path(x.shape[0], x) == "grouped"
    idx, w = moe.route(x)
    monkeypatch.setitem(_GROUPED_MM, "failed", None)
    runs = [moe.mix(x, idx, w) for _ in range(5)]
    assert _GROUPED_MM["failed"] is None  # the grouped path ran (a failure falls back silently)
    assert all(torch.equal(r, runs[0]) for r in runs[1:])  # no atomics: the same bits
    monkeypatch.setenv("ATOM_GROUPED_MM", "0")
    assert moe.path(x.shape[0], x) == "loop"
    loop = moe.mix(x, idx, w)
    err = (runs[0].float() - loop.float()).abs().max() / loop.float().abs().max()
    assert err < 1e-2, err  # bf16 GEMMs of other shapes: roundings apart
