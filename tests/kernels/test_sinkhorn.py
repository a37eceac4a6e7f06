"""The Triton sinkhorn kernel against its torch expression: on CUDA, or on CPU under Triton's
interpreter (``TRITON_INTERPRET=1 pytest tests/kernels``: the mode must be set before Triton is
first imported). CI has neither: skipped there."""

import pytest
import torch

from atom.kernels.sinkhorn import sinkhorn, sinkhorn_torch
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
