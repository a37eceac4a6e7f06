"""The Triton sinkhorn kernel against its torch expression: on CUDA, or on CPU under Triton's
interpreter (``TRITON_INTERPRET=1 pytest tests/kernels``: the mode must be set before Triton is
first imported). CI has neither: skipped there."""

import pytest
import torch

import atom.kernels.sinkhorn as sinkhorn_module
from atom.kernels.sinkhorn import hc_mix, hc_mix_torch, sinkhorn, sinkhorn_torch
from tests.kernels.runnable import needs_kernel

pytestmark = needs_kernel


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n", [1, 63, 64, 200])
def test_kernel_matches_torch_on_a_strided_slice(device, n):
    hc = 4
    mix = torch.randn(n, 2 * hc + hc * hc, device=device) * 3
    logits = mix[:, 2 * hc :]  # the layer passes a slice of its mix projection
    got = sinkhorn(logits, hc, 20, 1e-6)
    want = sinkhorn_torch(logits, hc, 20, 1e-6)
    assert got.shape == (n, hc, hc)
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5), (got - want).abs().max()
    assert torch.allclose(got.sum(1), torch.ones(n, hc, device=device), atol=1e-5)  # columns last


def test_gradients_take_the_torch_path(device):
    logits = torch.randn(5, 16, device=device, requires_grad=True)
    sinkhorn(logits, 4, 3, 1e-6).sum().backward()
    assert logits.grad is not None


def test_atom_triton_0_turns_the_kernel_off(device, monkeypatch):
    monkeypatch.setenv("ATOM_TRITON", "0")
    logits = torch.randn(8, 16, device=device)
    assert torch.equal(sinkhorn(logits, 4, 20, 1e-6), sinkhorn_torch(logits, 4, 20, 1e-6))


@pytest.mark.parametrize("n", [1, 5, 33])
def test_mix_kernel_matches_the_torch_expression(device, n, monkeypatch):
    """``hc_mix`` (one kernel: the mixer's scale, base, sigmoids and matrix) against
    ``hc_mix_torch``. On CUDA pre and post are torch's bits (libdevice's expf, IEEE division,
    no fused multiply-add) and C is the sinkhorn kernel's on torch's logits, bit for bit;
    Triton's interpreter takes numpy's exponential, so there within float32 rounding."""
    hc, iters, eps = 4, 20, 1e-6
    g = torch.Generator().manual_seed(n)
    mix = (torch.randn(n, (2 + hc) * hc, generator=g) * 3).to(device)
    scale = (torch.rand(3, generator=g) + 0.5).to(device)
    base = torch.randn((2 + hc) * hc, generator=g).to(device)
    with monkeypatch.context() as m:  # the kernel itself, no fallback to the torch expression
        m.setattr(sinkhorn_module, "hc_mix_torch", None)
        pre, post, c = hc_mix(mix, scale, base, hc, iters, eps)
    want = hc_mix_torch(mix, scale, base, hc, iters, eps)
    assert [t.shape for t in (pre, post, c)] == [(n, hc), (n, hc), (n, hc, hc)]
    if device == "cuda":
        assert torch.equal(pre, want[0]) and torch.equal(post, want[1])
        assert torch.equal(c, want[2])  # both through the sinkhorn kernel
    for got, ref in zip((pre, post, c), want):
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)
    assert torch.allclose(c.sum(1), torch.ones(n, hc, device=device), atol=1e-3)


def test_mix_falls_back_to_torch_when_off(device, monkeypatch):
    monkeypatch.setenv("ATOM_TRITON", "0")
    mix = torch.randn(3, 24, device=device)
    scale, base = torch.ones(3, device=device), torch.zeros(24, device=device)
    got = hc_mix(mix, scale, base, 4, 20, 1e-6)
    for a, b in zip(got, hc_mix_torch(mix, scale, base, 4, 20, 1e-6)):
        assert torch.equal(a, b)
