"""The batch-invariant mode's sync-free MoE path ("fixed": grouped GEMMs of the fixed kernel,
each token's slots added in slot order): the loop's function, and a token's output bits are
the same alone and inside any batch. On CUDA or Triton's interpreter (float32 there);
skipped elsewhere (CI)."""

from __future__ import annotations

import pytest
import torch

from atom.kernels import invariant
from atom.models.common.moe import MoE
from atom.models.deepseek_v41.presets import preset_config
from tests.kernels.runnable import DEVICE, needs_kernel

pytestmark = needs_kernel


@pytest.fixture
def moe(kernels_on):
    config = preset_config("v41-tiny")
    torch.manual_seed(0)
    m = MoE(config, torch.float32).to(DEVICE)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(std=0.05)
    invariant.configure(True)
    return m


def test_fixed_path_is_the_loops_function_and_batch_invariant(moe, monkeypatch):
    x = torch.randn(40, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(1))
    x = x.to(DEVICE)
    with torch.no_grad():
        assert moe.path(40, x) == "fixed"
        fixed = moe(x)
        for lo, hi in [(0, 1), (3, 4), (7, 30), (39, 40)]:
            assert torch.equal(moe(x[lo:hi]), fixed[lo:hi]), (lo, hi)
        monkeypatch.setattr(moe, "_fixed_usable", lambda x: False)
        assert moe.path(40, x) == "loop"
        loop = moe(x)
    assert torch.allclose(fixed, loop, atol=1e-5, rtol=1e-5)
