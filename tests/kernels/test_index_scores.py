"""The index-score kernel against its torch expression (on CUDA, or on CPU under Triton's
interpreter; CI has neither), and the torch expression against the indexer's own scores
(everywhere): what the kernel computes is what ``Indexer.scores`` and ``mask_invisible``
compute for each query."""

import pytest
import torch

from atom.kernels.index_scores import (
    index_scores_torch,
    index_scores_usable,
    tiled_index_scores,
)
from atom.models.deepseek_v41.attention import Indexer, mask_invisible
from atom.models.deepseek_v41.presets import preset_config
from tests.kernels.runnable import DEVICE, needs_kernel


def _case(device, tiles, per_tile, heads, d, seqs, rows, gen):
    """Queries and head weights of ``tiles`` tiles, keys of ``seqs`` sequences, each tile's
    sequence, and each query's visible rows (one sees none, one sees all)."""
    p = tiles * per_tile
    qi = torch.randn(p, heads, d, generator=gen)
    w = torch.randn(p, heads, generator=gen)
    keys = torch.randn(seqs, rows, d, generator=gen)
    tile_keys = torch.randint(0, seqs, (tiles,), generator=gen)
    visible = torch.randint(0, rows + 1, (p,), generator=gen)
    visible[0], visible[-1] = 0, rows
    return [x.to(device) for x in (qi, w, keys, tile_keys, visible)]


def _assert_scores_match(got, want, rtol):
    assert got.shape == want.shape
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))  # the same rows hidden
    finite = torch.isfinite(want)
    scale = want[finite].abs().max() if finite.any() else torch.tensor(1.0)
    err = (got[finite] - want[finite]).abs().max() if finite.any() else torch.tensor(0.0)
    assert err <= rtol * scale, f"max |kernel - torch| = {err} at scale {scale}"


@needs_kernel
@pytest.mark.parametrize("precision", ["ieee", "tf32x3"])
@pytest.mark.parametrize(
    "tiles,per_tile,rows", [(3, 1, 37), (2, 5, 130), (2, 64, 200), (1, 70, 64), (2, 16, 0)]
)
def test_kernel_matches_the_torch_expression(precision, tiles, per_tile, rows):
    gen = torch.Generator().manual_seed(tiles * 1000 + per_tile + rows)
    args = _case(DEVICE, tiles, per_tile, 4, 32, 3, rows, gen)
    with torch.no_grad():
        got = tiled_index_scores(*args, precision=precision)
        want = index_scores_torch(*args)
    _assert_scores_match(got.cpu(), want.cpu(), 1e-5)
    if rows:
        assert torch.isneginf(got[0]).all() and torch.isfinite(got[-1]).all()


def test_torch_expression_is_the_indexers_scores():
    """Per query, the expression equals ``Indexer.scores`` over that query's keys with
    ``mask_invisible`` applied (what the layer's selection ranks), on CPU."""
    cfg = preset_config("v41-tiny")
    ix = Indexer(cfg, owner=True, dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    qi, w, keys, tile_keys, visible = _case("cpu", 3, 4, ix.heads, ix.dim, 2, 29, gen)
    want = mask_invisible(ix.scores(qi, w, keys[tile_keys].repeat_interleave(4, 0)), visible)
    got = index_scores_torch(qi, w, keys, tile_keys, visible)
    _assert_scores_match(got, want, 1e-6)


def test_index_scores_kernel_switches(kernels_on, monkeypatch):
    qi = torch.zeros(2, 4, 32)
    assert index_scores_usable(qi)
    assert not index_scores_usable(torch.zeros(2, 4, 24))  # D not a power of two
    monkeypatch.setenv("ATOM_TRITON_OFF", "index_scores")
    assert not index_scores_usable(qi)
    monkeypatch.delenv("ATOM_TRITON_OFF")
    assert not index_scores_usable(torch.zeros(2, 4, 32, requires_grad=True))


@pytest.fixture
def invariant_on():
    from atom.kernels import invariant

    invariant.configure(True)
    yield
    invariant.configure(False)


@needs_kernel
@pytest.mark.parametrize("heads", [4, 64])
def test_in_the_mode_a_query_has_the_same_bits_in_any_tile(invariant_on, heads):
    """The batch-invariant mode's kernel (one query at a time, its heads one product): a
    query's scores equal the torch expression, and their bits do not depend on the tile it
    is in, on how many queries share the tile, or on its place there (a decode row is a tile
    of its own; a prefill query shares one)."""
    gen = torch.Generator().manual_seed(heads)
    qi, w, keys, tile_keys, visible = _case(DEVICE, 2, 40, heads, 32, 3, 150, gen)
    with torch.no_grad():
        tiled = tiled_index_scores(qi, w, keys, tile_keys, visible)
        _assert_scores_match(
            tiled.cpu(), index_scores_torch(qi, w, keys, tile_keys, visible).cpu(), 1e-5
        )
        alone_keys = tile_keys.repeat_interleave(40)  # every query a tile of its own
        alone = tiled_index_scores(qi, w, keys, alone_keys, visible)
        assert torch.equal(alone, tiled)
        part = tiled_index_scores(qi[45:52], w[45:52], keys, tile_keys[1:], visible[45:52])
        assert torch.equal(part, tiled[45:52])
