"""The Triton RMSNorm and mHC kernels against their torch expressions: on CUDA, or on CPU under
Triton's interpreter (``TRITON_INTERPRET=1 pytest tests/kernels``). Skipped elsewhere."""

import pytest
import torch

from atom.kernels.norm import (
    hc_post,
    hc_post_torch,
    hc_pre,
    hc_pre_torch,
    rms_norm,
    rms_norm_torch,
)
from tests.kernels.runnable import needs_kernel

pytestmark = needs_kernel


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _close(got, want, dtype):
    tol = {torch.float32: 2e-5, torch.bfloat16: 1e-2}[dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    err = ((got.float() - want.float()).abs() / (want.float().abs() + 1)).max().item()
    assert err <= tol, err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,cols,weighted", [(1, 64, True), (37, 5120, True), (5, 20480, False)])
def test_rms_norm_matches_torch(device, dtype, n, cols, weighted):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, cols, generator=g) * 3).to(device, dtype)
    w = (torch.rand(cols, generator=g) + 0.5).to(device, dtype) if weighted else None
    _close(rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6), dtype)


def test_rms_norm_of_a_strided_view_and_tiny_eps(device):
    x = torch.randn(6, 4, 96, device=device)
    view = x[:, 1]  # rows of a larger tensor
    _close(rms_norm(view, None, 1e-20), rms_norm_torch(view, None, 1e-20), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,d", [(1, 64), (9, 1000), (3, 5120)])
def test_hc_pre_and_post_match_torch(device, dtype, n, d):
    g = torch.Generator().manual_seed(d)
    x = torch.randn(n, 4, d, generator=g).to(device, dtype)
    out = torch.randn(n, d, generator=g).to(device, dtype)
    pre = torch.rand(n, 4, generator=g).to(device)
    post = 2 * torch.rand(n, 4, generator=g).to(device)
    c = torch.softmax(torch.randn(n, 4, 4, generator=g), -1).to(device)
    _close(hc_pre(x, pre), hc_pre_torch(x, pre), dtype)
    _close(hc_post(x, out, post, c), hc_post_torch(x, out, post, c), dtype)


def test_atom_triton_0_turns_the_kernels_off(device, monkeypatch):
    monkeypatch.setenv("ATOM_TRITON", "0")
    x = torch.randn(3, 4, 32, device=device)
    pre = torch.rand(3, 4, device=device)
    assert torch.equal(hc_pre(x, pre), hc_pre_torch(x, pre))
    assert torch.equal(rms_norm(x, None, 1e-6), rms_norm_torch(x, None, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_into_float32_is_the_norm_of_the_float32_copy(device, dtype):
    """``out_dtype=float32`` (mHC's mixers: a bf16 stream normed in float32) gives the bits of
    norming ``x.float()``, without that copy."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(7, 4 * 96, generator=g) * 2).to(device, dtype)
    got = rms_norm(x, None, 1e-6, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    assert torch.equal(got, rms_norm(x.float(), None, 1e-6))
    assert torch.equal(
        rms_norm_torch(x, None, 1e-6, torch.float32), rms_norm_torch(x.float(), None, 1e-6)
    )
