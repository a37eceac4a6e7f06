"""The MoE combine kernel against its torch expression (on CUDA, or on CPU under Triton's
interpreter; CI has neither), and the torch expression against the per-expert loop's sums
(everywhere)."""

import pytest
import torch

import atom.kernels
from atom.kernels.moe_combine import moe_combine, moe_combine_torch, moe_combine_usable
from tests.kernels.runnable import DEVICE, needs_kernel


def _case(device, n, k, d, experts, dtype, gen):
    """Routed outputs sorted by expert as the grouped GEMMs leave them, with their order."""
    idx = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(n)])
    order = torch.argsort(idx.flatten(), stable=True)
    y = torch.randn(n * k, d, generator=gen).to(dtype)
    shared = torch.randn(n, d, generator=gen).to(dtype)
    return [t.to(device) for t in (shared, y, order)]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,d", [(1, 2, 64), (37, 2, 1500), (300, 6, 256), (5, 1, 2048)])
def test_kernel_matches_the_torch_expression(monkeypatch, dtype, n, k, d):
    gen = torch.Generator().manual_seed(n * 10 + k)
    args = _case(DEVICE, n, k, d, 8, dtype, gen)
    with torch.no_grad():
        assert moe_combine_usable(args[1])
        got = moe_combine(*args)
        want = moe_combine_torch(*args)
    assert got.dtype == torch.float32 and got.shape == (n, d)
    # the same additions in the same order (torch may group longer sums otherwise)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-6), (got - want).abs().max()
    assert torch.equal(moe_combine(*args), got)  # no atomics: the same bits every run


def test_torch_expression_sums_each_tokens_experts():
    """Row i of y is token order[i] // k's output of slot order[i] % k: the expression is the
    shared output plus each token's slots (what the per-expert loop adds up)."""
    gen = torch.Generator().manual_seed(5)
    n, k, d = 9, 3, 16
    shared, y, order = _case("cpu", n, k, d, 6, torch.float32, gen)
    want = shared.clone()
    for i, p in enumerate(order.tolist()):
        t, s = divmod(p, k)
        want[t] += y[i]
    got = moe_combine_torch(shared, y, order)
    assert torch.allclose(got, want, atol=1e-5)


def test_rows_must_divide_into_tokens():
    shared, y = torch.zeros(3, 4), torch.zeros(7, 4)
    with pytest.raises(ValueError, match="7 rows, not a multiple of the 3 tokens"):
        moe_combine_torch(shared, y, torch.arange(7))


def test_moe_combine_switches(kernels_on, monkeypatch):
    y = torch.zeros(4, 8)
    assert moe_combine_usable(y)  # on by default
    monkeypatch.setattr(atom.kernels, "OPT_IN", frozenset({"moe_combine"}))
    assert not moe_combine_usable(y)  # were it opt-in: off until named
    monkeypatch.setenv("ATOM_TRITON_ON", "moe_combine")
    assert moe_combine_usable(y)
    monkeypatch.setenv("ATOM_TRITON_OFF", "moe_combine")
    assert not moe_combine_usable(y)
    monkeypatch.delenv("ATOM_TRITON_OFF")
    assert not moe_combine_usable(torch.zeros(4, 8, requires_grad=True))
