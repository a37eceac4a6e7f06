"""The batch-invariant mode's one-launch reductions (atom/kernels/_invariant_reduce_triton.py)
and its attention and index kernels: the value of torch's expression, and a row's bits the
same whatever else is in the call. On CUDA, or on CPU with Triton's interpreter
(``TRITON_INTERPRET=1``; the interpreter's bfloat16 dot is wrong, so float32 there). Skipped
elsewhere (CI)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.runnable import DEVICE, needs_kernel

pytestmark = needs_kernel


def _r():
    from atom.kernels import _invariant_reduce_triton as r

    return r


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.fixture
def mode():
    from atom.kernels import invariant

    invariant.configure(True)
    yield invariant
    invariant.configure(False)


@pytest.mark.parametrize("n", [1, 3, 17, 300])
def test_a_last_dimension_sum_keeps_each_rows_bits(n):
    r = _r()
    x = _rand(70, n, seed=n)
    full = r.ordered_sum(x, -1)
    assert torch.allclose(full, x.double().sum(-1).float(), rtol=1e-5, atol=1e-4)
    for lo, hi in [(0, 1), (5, 6), (15, 33), (0, 70)]:
        assert torch.equal(r.ordered_sum(x[lo:hi], -1), full[lo:hi]), (lo, hi)
    shifted = torch.cat([_rand(9, n, seed=99), x])  # every row 9 places on
    assert torch.equal(r.ordered_sum(shifted, -1)[9:], full)


@pytest.mark.parametrize("shape,dim", [((6, 5, 300), 1), ((4, 700), 0), ((3, 8, 2, 33), 1)])
def test_a_middle_dimension_sum_adds_terms_in_order(shape, dim):
    r = _r()
    x = _rand(*shape, seed=len(shape))
    got = r.ordered_sum(x, dim)
    assert got.shape == x.sum(dim).shape
    want = x.select(dim, 0).clone()  # term 0 first, then each term in turn, float32
    for j in range(1, x.shape[dim]):
        want = want + x.select(dim, j)
    assert torch.equal(got, want)
    # a trailing batch of one (inner size 1) keeps the order: a column's bits in any call
    assert torch.equal(r.ordered_sum(x[..., :1], dim), got[..., :1])
    # a strided view (the reduced dim not innermost) sums the same bits
    assert torch.equal(r.ordered_sum(x.transpose(0, dim).contiguous().transpose(0, dim), dim), got)


def test_a_half_precision_sum_rounds_once():
    r = _r()
    x = _rand(40, 3, 64, dtype=torch.float16, seed=3)
    got = r.ordered_sum(x, 1)
    want = (x[:, 0].float() + x[:, 1].float() + x[:, 2].float()).half()
    assert got.dtype == torch.float16 and torch.equal(got, want)


def test_partials_are_added_in_range_order():
    r = _r()
    parts = _rand(5, 33, 70, seed=4)
    out = torch.empty(33, 70, dtype=torch.float16, device=DEVICE)
    r.add_partials(parts, out)
    total = parts[0]
    for s in range(1, 5):
        total = total + parts[s]
    assert torch.equal(out, total.half())


def test_the_modes_sum_goes_through_one_kernel_on_the_gpu(mode):
    """On CUDA ``invariant.sum`` is ``ordered_sum`` (keepdim kept); on CPU torch's own."""
    x = _rand(12, 7, 40, seed=5)
    got = mode.sum(x, 1, keepdim=True)
    assert got.shape == (12, 1, 40)
    if DEVICE == "cuda":
        assert torch.equal(got[:, 0], _r().ordered_sum(x, 1))
    else:
        assert torch.equal(got, x.sum(1, keepdim=True))


def test_the_modes_attention_kernel_keeps_a_rows_bits(mode):
    """``invariant_attention.sink_attention_rows`` through the kernel: each query's output
    equals its output in a call of other sizes, and torch's float32 expression to rounding."""
    from atom.kernels import invariant_attention as att
    from atom.kernels.attention import sink_attention_torch

    t, h, hd, nw, k = 9, 4, 32, 12, 70
    q = _rand(t, h, hd, seed=6)
    win_k = _rand(t, nw, hd, seed=7)
    win_mask = torch.rand(t, nw, generator=torch.Generator().manual_seed(8)) < 0.7
    win_mask[:, -1] = True  # its own key
    comp = _rand(t, k, hd, seed=9)
    valid = torch.rand(t, k, generator=torch.Generator().manual_seed(10)) < 0.6
    win_mask, valid = win_mask.to(DEVICE), valid.to(DEVICE)
    sink = _rand(h, seed=11)
    assert att._attention_kernel(q)
    y = att.sink_attention_rows(q, win_k, win_mask, comp, valid, sink, 0.2)
    want = sink_attention_torch(q, win_k, win_mask, comp, valid, sink, 0.2)
    assert (y - want).abs().max().item() < 1e-4
    for lo, hi in [(0, 1), (3, 5), (2, 9)]:
        part = att.sink_attention_rows(
            q[lo:hi], win_k[lo:hi], win_mask[lo:hi], comp[lo:hi], valid[lo:hi], sink, 0.2
        )
        assert torch.equal(part, y[lo:hi]), (lo, hi)
    # more (invalid) compressed rows, as a longer sequence in the batch brings, change no bit
    wide = torch.cat([comp, _rand(t, 50, hd, seed=12)], 1)
    wide_valid = torch.cat([valid, torch.zeros(t, 50, dtype=torch.bool, device=DEVICE)], 1)
    assert torch.equal(att.sink_attention_rows(q, win_k, win_mask, wide, wide_valid, sink, 0.2), y)


def test_the_modes_index_scores_keep_a_rows_bits(mode):
    """``invariant_attention.index_scores`` through the index kernel, one tile per query:
    per-query and shared keys, a row's scores independent of the batch and of the row count."""
    from atom.kernels import invariant_attention as att

    t, hi, d, r = 7, 8, 32, 90
    qi, w = _rand(t, hi, d, seed=13), _rand(t, hi, seed=14)
    keys = _rand(t, r, d, seed=15)
    s = att.index_scores(qi, w, keys)
    want = torch.einsum("th,thr->tr", w, torch.relu(torch.einsum("thd,trd->thr", qi, keys)))
    assert (s - want).abs().max().item() < 1e-3
    assert torch.equal(att.index_scores(qi[2:4], w[2:4], keys[2:4]), s[2:4])
    assert torch.equal(att.index_scores(qi, w, keys[:, :40])[:, :40], s[:, :40])
    shared = att.index_scores(qi, w, keys[0])
    assert torch.equal(att.index_scores(qi[3:], w[3:], keys[0]), shared[3:])
    want0 = torch.einsum("th,thr->tr", w, torch.relu(torch.einsum("thd,rd->thr", qi, keys[0])))
    assert (shared - want0).abs().max().item() < 1e-3
