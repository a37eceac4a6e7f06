"""Engram's lookup kernel against its torch expression (on CUDA, or on CPU under Triton's
interpreter; CI has neither), and the stacked tables it reads (everywhere)."""

import pytest
import torch

from atom.kernels.engram import engram_rows_torch
from atom.models.deepseek_v41.layers import ENGRAM_HASH_MASK, Engram
from atom.models.deepseek_v41.presets import preset_config
from tests.kernels.runnable import DEVICE, needs_kernel


def _engram(device, dtype=torch.float32, **overrides):
    cfg = preset_config("v41-mini", **overrides)
    torch.manual_seed(0)
    e = Engram(cfg, 4, dtype).to(device)
    with torch.no_grad():
        for t in e.tables:
            t.weight.normal_()
    return e, cfg


def _cid(n, vocab, device, gen):
    """Compressed ids with -1 (before the sequence) in the leading positions of some rows."""
    cid = torch.randint(0, vocab, (n, 4), generator=gen)
    starts = torch.randint(0, 5, (n,), generator=gen)
    cid[torch.arange(4)[None, :] < starts[:, None]] = -1
    return cid.to(device)


def _torch_rows(e, cid):
    weights = [t.weight for t in e.tables]
    return engram_rows_torch(
        cid, weights, e.orders, e.heads, e.multipliers, e.sizes, ENGRAM_HASH_MASK
    )


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 37, 300])
def test_kernel_rows_equal_the_torch_rows(dtype, n):
    e, cfg = _engram(DEVICE, dtype)
    cid = _cid(n, cfg.engram_vocab_size, DEVICE, torch.Generator().manual_seed(n))
    with torch.no_grad():
        got = e.rows(cid)
        want = _torch_rows(e, cid)
    assert got.shape == (n, len(e.tables) * e.de)
    assert torch.equal(got, want)  # a gather: the same bits
    assert (want == 0).any()  # some grams reached before the sequence start


@needs_kernel
def test_kernel_sees_weights_loaded_after_stacking():
    e, cfg = _engram(DEVICE)
    cid = _cid(64, cfg.engram_vocab_size, DEVICE, torch.Generator().manual_seed(1))
    with torch.no_grad():
        e.rows(cid)
        e.tables[3].weight.add_(1.0)  # a load writes into the parameter
        assert torch.equal(e.rows(cid), _torch_rows(e, cid))
        e.tables[5].weight.data = e.tables[5].weight.data.clone() * 2  # a replaced tensor
        assert torch.equal(e.rows(cid), _torch_rows(e, cid))


def test_stacking_makes_the_tables_views_of_one_tensor():
    e, _ = _engram("cpu")
    before = [t.weight.detach().clone() for t in e.tables]
    table, meta = e._stacked([t.weight for t in e.tables])
    assert table.shape == (sum(e.sizes), e.de)
    assert meta[1].tolist() == e.sizes and meta[3].tolist() == [
        n for n in e.orders for _ in range(e.heads)
    ]
    for t, b, old in zip(e.tables, meta[2].tolist(), before):
        assert t.weight.data_ptr() == table[b].data_ptr()
        assert torch.equal(t.weight, old)
    with torch.no_grad():
        e.tables[2].weight[0].fill_(7.0)
    assert (table[int(meta[2, 2])] == 7.0).all()


def test_rows_keep_autograd_on_the_torch_path(kernels_on):
    """Where the kernel would run, a table that wants gradients still takes torch."""
    e, cfg = _engram("cpu")
    cid = _cid(8, cfg.engram_vocab_size, "cpu", torch.Generator().manual_seed(2))
    e.rows(cid).sum().backward()
    assert e.tables[0].weight.grad is not None
