"""The SwiGLU kernel against its torch expression: the same bits on CUDA (under Triton's
interpreter, whose exp is numpy's, within one step of the output dtype); the MoE through it.
Skipped where no kernel can run."""

import pytest
import torch

import atom.kernels.swiglu as swiglu_module
from atom.kernels.swiglu import swiglu, swiglu_torch
from tests.kernels.runnable import DEVICE, needs_kernel, refuse_fallback

pytestmark = needs_kernel


@pytest.fixture(autouse=True)
def no_fallback(monkeypatch):
    """The kernel may not fall back to its torch expression here."""
    refuse_fallback(monkeypatch, swiglu_module, "swiglu_torch", "swiglu")


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-equal on CUDA; interpreted, within one step of the dtype (numpy's exp, and the
    interpreter's float32-to-bfloat16 cast truncates)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.is_cuda:
        assert torch.equal(got, want)
        return
    step = want.float().abs().clamp(min=1e-30) * (
        2.0**-7 if want.dtype == torch.bfloat16 else 2.0**-20
    )
    assert ((got.float() - want.float()).abs() <= step).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,cols,weighted", [(1, 8, False), (7, 200, True), (33, 1536, True)])
def test_the_kernel_computes_the_torch_expression(dtype, rows, cols, weighted):
    g_ = torch.Generator().manual_seed(rows * cols)
    g = (torch.randn(rows, cols, generator=g_) * 6).to(dtype).to(DEVICE)
    u = (torch.randn(rows, cols, generator=g_) * 6).to(dtype).to(DEVICE)
    g[0, :3] = torch.tensor([30.0, -30.0, 10.0])  # past the limit both ways, and at it
    u[0, :3] = torch.tensor([-30.0, 30.0, -10.0])
    w = torch.rand(rows, 1, generator=g_).to(DEVICE) if weighted else None
    _same(swiglu(g, u, 10.0, dtype, w), swiglu_torch(g, u, 10.0, dtype, w))


def test_weights_in_expert_order_and_strided_inputs():
    """The grouped path's weights: row i takes weight order[i] of the flattened [N, top_k]
    weights; g and u as column slices of one [R, 2I] tensor."""
    g_ = torch.Generator().manual_seed(3)
    gu = (torch.randn(12, 2 * 96, generator=g_) * 4).to(torch.bfloat16).to(DEVICE)
    g, u = gu[:, :96], gu[:, 96:]
    w = torch.rand(6, 2, generator=g_).to(DEVICE)
    order = torch.randperm(12, generator=g_).to(DEVICE)
    got = swiglu(g, u, 7.0, torch.bfloat16, w, order)
    _same(got, swiglu_torch(g, u, 7.0, torch.bfloat16, w, order))
    want_row = swiglu_torch(g[5:6], u[5:6], 7.0, torch.bfloat16, w.flatten()[order[5]].view(1, 1))
    _same(got[5:6], want_row)


def test_nan_stays_nan_as_torch_clamps_it():
    g = torch.tensor([[float("nan"), 1.0]], device=DEVICE)
    u = torch.tensor([[1.0, float("nan")]], device=DEVICE)
    got = swiglu(g, u, 10.0, torch.float32)
    assert torch.isnan(got).all()


def test_the_moe_through_the_kernel_matches_it_through_torch(monkeypatch):
    """A MoE layer (shared expert and routed experts, each path it takes here) gives the same
    output with the kernel as with the torch expression."""
    from atom.models.common.moe import MoE
    from atom.models.deepseek_v41.presets import preset_config

    monkeypatch.setattr(swiglu_module, "swiglu_torch", swiglu_torch)
    calls = []
    kernel = swiglu_module.swiglu
    import atom.models.common.moe as moe_module

    monkeypatch.setattr(moe_module, "swiglu", lambda *a: calls.append(1) or kernel(*a))
    torch.manual_seed(0)
    cfg = preset_config("v41-tiny")
    moe = MoE(cfg, torch.float32).to(DEVICE)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(9, cfg.hidden_size, device=DEVICE)
    with torch.no_grad():
        got = moe(x)
        assert calls  # the kernel's entry point ran
        monkeypatch.setenv("ATOM_TRITON_ON", "")
        want = moe(x)
    if got.is_cuda:
        assert torch.equal(got, want)
    else:  # numpy's exp, through the down projection's sums
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
