"""The router kernel against its torch expression: the same expert ids (ties to the smaller id),
weights to float32 rounding; on CUDA or under Triton's interpreter. Skipped elsewhere."""

import pytest
import torch

import atom.kernels.route as route_module
from atom.kernels.route import route, route_torch
from tests.kernels.runnable import DEVICE, needs_kernel, refuse_fallback

pytestmark = needs_kernel


@pytest.fixture(autouse=True)
def no_fallback(monkeypatch):
    """The kernel may not fall back to its torch expression here."""
    refuse_fallback(monkeypatch, route_module, "route_torch", "route")


@pytest.mark.parametrize("n,experts,top_k", [(1, 16, 2), (9, 64, 6), (33, 256, 8), (4, 8, 1)])
def test_router_kernel_picks_torchs_experts_with_torchs_weights(n, experts, top_k):
    g = torch.Generator().manual_seed(n * experts)
    logits = (torch.randn(n, experts, generator=g) * 4).to(DEVICE)
    logits[0, :4] = 30.0  # above softplus's threshold, and tied
    bias = (torch.randn(experts, generator=g) * 0.1).to(DEVICE)
    idx, w = route(logits, bias, 1.5, top_k, 2.5)
    want_idx, want_w = route_torch(logits, bias, 1.5, top_k, 2.5)
    assert idx.dtype == torch.int64 and idx.shape == (n, top_k)
    assert torch.equal(idx, want_idx)
    assert torch.allclose(w, want_w, rtol=2e-6, atol=1e-7)
    if top_k > 1:
        assert torch.allclose(w.sum(-1), torch.full((n,), 2.5, device=DEVICE))


@pytest.mark.parametrize("top_k", [1, 4])
def test_v4s_rule_divides_by_the_sum_alone_whatever_k(top_k):
    """V4's router (eps 0, normalized also at k = 1): torch's experts, weights to float32
    rounding, each row's weights summing to the scale (1.0 each at k = 1)."""
    g = torch.Generator().manual_seed(top_k)
    logits = (torch.randn(7, 32, generator=g) * 4).to(DEVICE)
    bias = (torch.randn(32, generator=g) * 0.1).to(DEVICE)
    idx, w = route(logits, bias, 1.0, top_k, 1.5, 0.0, True)
    want_idx, want_w = route_torch(logits, bias, 1.0, top_k, 1.5, 0.0, True)
    assert torch.equal(idx, want_idx)
    assert torch.allclose(w, want_w, rtol=2e-6, atol=1e-7)
    assert torch.allclose(w.sum(-1), torch.full((7,), 1.5, device=DEVICE))


def test_ties_go_to_the_smaller_expert_id():
    """Equal biased scores everywhere: the first k ids, in order, in every row."""
    logits = torch.zeros(5, 32, device=DEVICE)
    bias = torch.zeros(32, device=DEVICE)
    idx, w = route(logits, bias, 1.0, 6, 1.0)
    assert torch.equal(idx, torch.arange(6, device=DEVICE).expand(5, -1))
    assert torch.allclose(w, torch.full((5, 6), 1 / 6, device=DEVICE))
