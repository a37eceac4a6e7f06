"""The FP4 GEMM kernel (atom/kernels/_fp4_gemm_triton.py) against its torch expression
(atom/kernels/fp4_gemm.py): packed E2M1 codes with E8M0 scales per 32, dense and grouped, and a
row's bits independent of the other rows. On CUDA, or on CPU with Triton's interpreter
(``TRITON_INTERPRET=1``; float32 and float16 there: the interpreter's bfloat16 dot is wrong).
Skipped elsewhere (CI)."""

from __future__ import annotations

import pytest
import torch

from atom.models.common.formats import dequant_fp4
from tests.kernels.runnable import DEVICE, needs_kernel

pytestmark = needs_kernel

DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32, torch.float16]


@pytest.fixture(
    params=[(False, 1), (True, 1), (True, 2), (False, 3)],
    ids=["interleaved", "pairs", "pairs-split2", "interleaved-split3"],
)
def layout(request, monkeypatch):
    """Each test below with each K loop of the kernel (``Fp4Config.pairs``), and K split
    across programs (``split``: float32 partials added in order), as the one launch of every
    call (``BY_ROWS`` emptied: no choice by row count)."""
    from atom.kernels import _fp4_gemm_triton as kernel

    monkeypatch.setattr(kernel, "BY_ROWS", {})
    pairs, split = request.param
    for dtype, config in list(kernel.CONFIG.items()):
        monkeypatch.setitem(kernel.CONFIG, dtype, config._replace(pairs=pairs, split=split))
    return request.param


def _weights(g: int, n: int, k: int, seed: int):
    """Random codes (every one of the 16 appears) and scales near 2^0 (float16 range)."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (g, n, k // 2), generator=gen, dtype=torch.uint8)
    scale = torch.randint(122, 131, (g, n, k // 32), generator=gen, dtype=torch.uint8)
    return packed.to(DEVICE), scale.to(DEVICE)


def _rows(m: int, k: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(dtype).to(DEVICE)


def test_the_kernels_values_are_the_formats(layout):
    """Every code and a range of scales decode as ``dequant_fp4`` decodes them: one row of x
    that is a unit vector reads one column of the weight exactly."""
    from atom.kernels._fp4_gemm_triton import fp4_grouped_linear_triton

    packed, scale = _weights(1, 40, 64, seed=1)
    scale[0, :, 1] = torch.arange(100, 140, dtype=torch.uint8)  # far scales too (float32)
    scale[0, :2, 0] = torch.tensor([250, 3], dtype=torch.uint8)  # and the format's ends
    eye = torch.eye(64, dtype=torch.float32, device=DEVICE)
    ends = torch.tensor([64], device=DEVICE)
    got = fp4_grouped_linear_triton(eye, packed, scale, ends)  # [K, N]: the weight, transposed
    assert torch.equal(got.t(), dequant_fp4(packed[0], scale[0]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_rows_equal_the_torch_expression_and_their_group_alone(dtype, layout):
    from atom.kernels.fp4_gemm import fp4_grouped_linear, fp4_grouped_linear_torch

    packed, scale = _weights(4, 72, 160, seed=2)
    x = _rows(150, 160, dtype, seed=3)
    for sizes in [(10, 0, 140, 0), (64, 64, 1, 21), (1, 1, 1, 147)]:
        ends = torch.tensor(sizes, device=DEVICE).cumsum(0)
        y = fp4_grouped_linear(x, packed, scale, ends)
        want = fp4_grouped_linear_torch(x.double(), packed, scale, ends).float()
        tol = (1e-5 if dtype == torch.float32 else 0.02) * want.abs().max().item()
        assert (y.float() - want).abs().max().item() < tol, sizes
        start = 0
        for g, n in enumerate(sizes):  # a group's rows alone: the same bits
            alone = fp4_grouped_linear(
                x[start : start + n],
                packed[g : g + 1],
                scale[g : g + 1],
                torch.tensor([n], device=DEVICE),
            )
            assert torch.equal(y[start : start + n], alone), (sizes, g)
            start += n


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_dense_product_keeps_each_rows_bits(dtype, layout):
    from atom.kernels.fp4_gemm import dequantized, fp4_linear

    packed, scale = _weights(1, 50, 96, seed=4)
    x = _rows(70, 96, dtype, seed=5)
    y = fp4_linear(x, packed[0], scale[0])
    want = x.double() @ dequantized(packed[0], scale[0], torch.float64).T
    tol = (1e-5 if dtype == torch.float32 else 0.02) * want.abs().max().item()
    assert (y.double() - want).abs().max().item() < tol
    for lo, hi in [(0, 1), (5, 9), (63, 70)]:
        assert torch.equal(fp4_linear(x[lo:hi], packed[0], scale[0]), y[lo:hi]), (lo, hi)


def test_the_launch_follows_the_row_count_outside_the_batch_invariant_mode(monkeypatch):
    """By row count (``BY_ROWS``) in the default mode, ``CONFIG``'s for every count in the
    mode; the tile table is built for the launch's BM; a call at each launch gives the torch
    expression's values, and in the mode a row's bits whatever its call's row count."""
    from atom.kernels import _fp4_gemm_triton as kernel
    from atom.kernels import invariant_mode
    from atom.kernels.fp4_gemm import fp4_grouped_linear, fp4_grouped_linear_torch

    small, mid = kernel.Fp4Config(16, 32, 64, 4, 2, False, 2), kernel.Fp4Config(32, 32, 32, 4, 2)
    monkeypatch.setitem(kernel.BY_ROWS, torch.float32, ((4, small), (40, mid)))
    fixed = kernel.CONFIG[torch.float32]
    assert [kernel.launch_for(torch.float32, r) for r in (1, 4, 5, 40, 41)] == [
        small,
        small,
        mid,
        mid,
        fixed,
    ]
    packed, scale = _weights(2, 48, 128, seed=8)
    x = _rows(60, 128, torch.float32, seed=9)
    for rows in (3, 30, 60):  # one launch each
        ends = torch.tensor([rows // 2, rows], device=DEVICE)
        y = fp4_grouped_linear(x[:rows], packed, scale, ends)
        want = fp4_grouped_linear_torch(x[:rows].double(), packed, scale, ends).float()
        assert (y - want).abs().max().item() < 1e-5 * want.abs().max().item(), rows
    monkeypatch.setitem(invariant_mode.STATE, "on", True)
    assert {kernel.launch_for(torch.float32, r) for r in (1, 4, 5, 40, 41)} == {fixed}
    one = torch.tensor([1], device=DEVICE)
    alone = fp4_grouped_linear(x[:1], packed[:1], scale[:1], one)
    many = fp4_grouped_linear(x, packed[:1], scale[:1], torch.tensor([60], device=DEVICE))
    assert torch.equal(alone, many[:1])


def test_wrong_operand_shapes_are_refused_with_the_expected_ones():
    from atom.kernels._fp4_gemm_triton import fp4_grouped_linear_triton

    packed, scale = _weights(2, 8, 64, seed=6)
    x = _rows(4, 96, torch.float32, seed=7)
    with pytest.raises(ValueError, match=r"expected \[G, N, 48\] and \[G, N, 3\]"):
        fp4_grouped_linear_triton(x, packed, scale, torch.tensor([2, 4], device=DEVICE))


def test_the_moe_runs_its_fp4_experts_through_the_kernel_as_the_loop_does(monkeypatch, layout):
    """``MoE._fp4`` (the grouped kernel, no host sync) against the per-expert loop of the same
    FP4 experts (the torch expression), float32."""
    from atom.models.common import moe as moe_mod
    from tests.model.test_fp8_weights import build

    net, _ = build("v41-tiny-fp8", "fp8")
    net = net.to(DEVICE)
    moe = next(m for m in net.modules() if isinstance(m, moe_mod.MoE))
    x = _rows(37, net.config.hidden_size, torch.float32, seed=8)
    with torch.no_grad():
        idx, w = moe.route(x)
        assert moe.path(37, x) == "fp4"
        got = moe.mix(x, idx, w)
        monkeypatch.setattr(moe_mod, "fp4_usable", lambda t: False)
        from atom.kernels import fp4_gemm

        monkeypatch.setattr(fp4_gemm, "fp4_usable", lambda t: False)
        assert moe.path(37, x) == "loop"
        want = moe.mix(x, idx, w)
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()
