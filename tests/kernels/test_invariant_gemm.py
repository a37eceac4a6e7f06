"""The batch-invariant mode's GEMM kernel (atom/kernels/_invariant_gemm_triton.py): a row's
output bits depend only on that row and its weight, never on how many rows share the call,
where the row sits, or (grouped) how the other rows are grouped. On CUDA, or on CPU with
Triton's interpreter (``TRITON_INTERPRET=1``, float32 and float16: the interpreter's bfloat16
dot is wrong). Skipped elsewhere (CI)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.runnable import DEVICE, needs_kernel

pytestmark = needs_kernel

DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32, torch.float16]


def _k():
    from atom.kernels import _invariant_gemm_triton as k

    return k


def _rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_has_the_same_bits_in_any_call(dtype):
    k = _k()
    w = _rand(70, 45, dtype=dtype, seed=1)
    x = _rand(130, 45, dtype=dtype, seed=2)
    y = k.invariant_linear(x, w)
    want = (x.double() @ w.double().T).float()
    tol = 1e-4 if dtype == torch.float32 else 0.05 * want.abs().max().item()
    assert (y.float() - want).abs().max().item() < tol
    for lo, hi in [(0, 1), (5, 8), (63, 65), (100, 130)]:  # fewer rows, other tile positions
        assert torch.equal(k.invariant_linear(x[lo:hi], w), y[lo:hi]), (lo, hi)
    shifted = torch.cat([_rand(17, 45, dtype=dtype, seed=3), x])  # every row 17 places on
    assert torch.equal(k.invariant_linear(shifted, w)[17:], y)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_split_k_call_keeps_every_rows_bits(dtype):
    """A long K splits into ranges (``splits``: by the weight's shape alone); the partials are
    added in range order, so a row's bits still do not depend on the other rows."""
    k = _k()
    w = _rand(70, 1200, dtype=dtype, seed=11)
    x = _rand(100, 1200, dtype=dtype, seed=12)
    assert k.splits(70, 1200, dtype, x.device) > 1
    y = k.invariant_linear(x, w)
    want = (x.double() @ w.double().T).float()
    tol = 1e-3 if dtype == torch.float32 else 0.05 * want.abs().max().item()
    assert (y.float() - want).abs().max().item() < tol
    for lo, hi in [(0, 1), (30, 31), (2, 99)]:
        assert torch.equal(k.invariant_linear(x[lo:hi], w), y[lo:hi]), (lo, hi)
    ends = torch.tensor([1, 40, 100], device=DEVICE)
    grouped = k.invariant_grouped_linear(x, w[None].expand(3, -1, -1), ends)
    assert torch.equal(grouped, y)  # the same weight in every group: the dense call's bits


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_rows_equal_their_group_alone(dtype):
    """Each group's rows equal the dense call of its weight, bit for bit, for groupings with
    empty groups and groups smaller and larger than a tile."""
    k = _k()
    w = _rand(4, 40, 24, dtype=dtype, seed=4)
    x = _rand(150, 24, dtype=dtype, seed=5)
    for sizes in [(10, 0, 140, 0), (0, 0, 0, 150), (64, 64, 1, 21), (1, 1, 1, 147)]:
        ends = torch.tensor(sizes, device=DEVICE).cumsum(0)
        y = k.invariant_grouped_linear(x, w, ends)
        start = 0
        for g, n in enumerate(sizes):
            alone = k.invariant_linear(x[start : start + n], w[g])
            assert torch.equal(y[start : start + n], alone), (sizes, g)
            start += n


def test_group_tiles_cover_every_row_once():
    k = _k()
    bm = k.CONFIG[torch.float32][0]
    for sizes in [(0,), (5,), (bm, bm + 1, 0, 3), (0, 0, 2 * bm)]:
        ends = torch.tensor(sizes).cumsum(0)
        rows = int(ends[-1])
        group, first = k.group_tiles(ends.to(DEVICE), rows, torch.float32)
        seen = []
        for g, f in zip(group.tolist(), first.tolist()):
            if g < 0:
                continue
            end = int(ends[g])
            assert f < end and (g == 0 or f >= int(ends[g - 1]))
            seen.extend(range(f, min(f + bm, end)))
        assert sorted(seen) == list(range(rows)), sizes


@pytest.mark.parametrize("dtype", DTYPES)
def test_bmm_entries_equal_their_own_call(dtype):
    k = _k()
    a = _rand(6, 5, 16, dtype=dtype, seed=6)
    b = _rand(6, 16, 9, dtype=dtype, seed=7)
    y = k.invariant_bmm(a, b)
    for i in range(6):
        assert torch.equal(y[i], k.invariant_linear(a[i], b[i].T.contiguous())), i
    assert torch.equal(k.invariant_bmm(a[2:3], b[2:3]), y[2:3])  # a batch of one
    want = torch.bmm(a.double(), b.double()).float()
    assert (y.float() - want).abs().max().item() < (1e-4 if dtype == torch.float32 else 0.1)


@pytest.mark.skipif(DEVICE != "cuda", reason="bench-size shapes on the GPU")
@pytest.mark.parametrize("n,kdim", [(1024, 5120), (1536, 16384)])
def test_bench_shapes_row_zero_is_the_same_for_every_m(n, kdim):
    """The shapes where cuBLAS's bf16 GEMM gives another row 0 as M grows (from M = 16-256)."""
    k = _k()
    w = _rand(n, kdim, dtype=torch.bfloat16, seed=8)
    x = _rand(4096, kdim, dtype=torch.bfloat16, seed=9)
    first = k.invariant_linear(x[:1], w)
    for m in (2, 16, 32, 64, 256, 1024, 4096):
        assert torch.equal(k.invariant_linear(x[:m], w)[:1], first), m


@pytest.mark.skipif(DEVICE != "cuda", reason="torch's CUDA reductions split rows by the batch")
@pytest.mark.parametrize("n", [8, 5120])
def test_the_modes_sums_are_the_same_bits_in_any_batch(n):
    """``invariant.sum`` / ``mean`` (short dims added in order, long ones through the kernel)."""
    from atom.kernels import invariant

    invariant.configure(True)
    x = _rand(2048, n, dtype=torch.float32, seed=10)
    full, avg = invariant.sum(x, -1), invariant.mean(x, -1, keepdim=True)
    assert torch.allclose(full, x.double().sum(-1).float(), rtol=1e-5, atol=1e-3)
    for m in (1, 3, 64, 1000):
        assert torch.equal(invariant.sum(x[:m], -1), full[:m]), m
        assert torch.equal(invariant.mean(x[:m], -1, keepdim=True), avg[:m]), m
    cols = x.t().contiguous()  # the reduced dim first: terms added one by one, in order
    by_cols = invariant.sum(cols, 0)
    assert torch.allclose(by_cols, full, rtol=1e-5, atol=1e-3)
    for m in (1, 3, 64, 1000):  # its batch dimension trailing, 1 included
        assert torch.equal(invariant.sum(cols[:, :m].contiguous(), 0), by_cols[:m]), m


def test_a_shape_of_its_own_configuration_keeps_every_rows_bits(monkeypatch):
    """``SHAPE_CONFIG``: one weight shape at other tiles (and so another split of K) than the
    dtype's; still one configuration for every M, so a row's bits do not depend on M."""
    k = _k()
    dtype = DTYPES[0]
    w = _rand(70, 1200, dtype=dtype, seed=21)
    x = _rand(100, 1200, dtype=dtype, seed=22)
    default = k.invariant_linear(x, w)
    bm, bn, bk, warps, stages = k.CONFIG[dtype]
    monkeypatch.setitem(k.SHAPE_CONFIG, (dtype, 70, 1200), (bn // 2, bk * 2, warps, stages))
    assert k._config(dtype, 70, 1200) == (bm, bn // 2, bk * 2, warps, stages)
    assert k._config(dtype, 71, 1200) == k.CONFIG[dtype]
    y = k.invariant_linear(x, w)
    assert (y.float() - default.float()).abs().max().item() < 1e-3
    for lo, hi in [(0, 1), (30, 31), (2, 99)]:
        assert torch.equal(k.invariant_linear(x[lo:hi], w), y[lo:hi]), (lo, hi)


# prefill tiles to try: (BM, BN, warps, stages), each over a shape's own BK and split of K
PREFILL_TILES = [(128, 128, 4, 3), (128, 128, 8, 3), (128, 256, 8, 3), (64, 256, 8, 4)]


@pytest.mark.skipif(DEVICE != "cuda", reason="bench-size shapes on the GPU")
@pytest.mark.parametrize("tile", PREFILL_TILES)
@pytest.mark.parametrize("n,kdim", [(2304, 5120), (5120, 2304), (32768, 1280), (4096, 1280)])
def test_a_prefill_tile_keeps_every_rows_bits(monkeypatch, tile, n, kdim):
    """``PREFILL_CONFIG``: a call of many rows runs at another tile (same BK, same split of K)
    and still gives every row the bits a decode-shaped call gives it."""
    k = _k()
    dtype = torch.bfloat16
    w = _rand(n, kdim, dtype=dtype, seed=31)
    x = _rand(1024, kdim, dtype=dtype, seed=32)
    monkeypatch.setattr(k, "PREFILL_ROWS", 256)
    monkeypatch.setitem(k.PREFILL_CONFIG, (dtype, n, kdim), tile)
    if not k.fits(k._config(dtype, n, kdim, 1024), torch.device(DEVICE)):
        pytest.skip(f"{tile} at BK {k._config(dtype, n, kdim)[2]} exceeds shared memory")
    assert k._config(dtype, n, kdim, 1024)[:2] == tile[:2]
    assert k._config(dtype, n, kdim, 1024)[2] == k._config(dtype, n, kdim, 1)[2]
    full = k.invariant_linear(x, w)
    for lo, hi in [(0, 1), (0, 16), (500, 516), (1008, 1024)]:
        assert torch.equal(k.invariant_linear(x[lo:hi], w), full[lo:hi]), (lo, hi)


@pytest.mark.skipif(DEVICE != "cuda", reason="the shipped prefill tiles are bf16, GPU shapes")
def test_every_shipped_prefill_tile_keeps_every_rows_bits():
    k = _k()
    for (dtype, n, kdim), tile in sorted(k.PREFILL_CONFIG.items(), key=lambda e: e[0][1:]):
        w = _rand(n, kdim, dtype=dtype, seed=41)
        x = _rand(k.PREFILL_ROWS + 40, kdim, dtype=dtype, seed=42)
        assert k._config(dtype, n, kdim, x.shape[0])[:2] == tile[:2]
        full = k.invariant_linear(x, w)
        for lo, hi in [(0, 1), (0, 16), (k.PREFILL_ROWS - 8, k.PREFILL_ROWS + 40)]:
            assert torch.equal(k.invariant_linear(x[lo:hi], w), full[lo:hi]), (n, kdim, lo, hi)
