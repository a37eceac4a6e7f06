"""The RoPE kernel against its torch expression: the same bits (the kernel rounds each product
and sum as torch's separate element-wise kernels do), on CUDA or under Triton's interpreter
(``TRITON_INTERPRET=1 pytest tests/kernels``). Skipped elsewhere."""

import pytest
import torch

import atom.kernels.rope as rope_module
from atom.kernels.rope import rope_, rope_torch_
from atom.models.common.rope import InterleavedRope, Rope
from tests.kernels.runnable import DEVICE, needs_kernel

pytestmark = needs_kernel


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-equal; except bfloat16 under Triton's interpreter, whose float32-to-bfloat16 cast
    truncates where CUDA's rounds to nearest: there within one bfloat16 step of each other."""
    if got.is_cuda or got.dtype != torch.bfloat16:
        assert torch.equal(got, want)
        return
    step = want.float().abs().clamp(min=1e-30) * 2.0**-7
    assert ((got.float() - want.float()).abs() <= step).all()


def _cs(n: int, dim: int, gen: torch.Generator, rope: Rope | None = None):
    positions = torch.randint(0, 100_000, (n,), generator=gen)
    if rope is None:
        rope = InterleavedRope(dim, 10000.0, None)
    cos, sin = rope.cos_sin(positions.to(DEVICE))
    return cos, sin


@pytest.fixture
def kernel_only(monkeypatch):
    """``rope_`` may not fall back to the torch expression (this module's own name for it,
    imported before the patch, stays callable)."""

    def refuse(*args, **kwargs):
        raise AssertionError("rope_ fell back to the torch expression")

    monkeypatch.setattr(rope_module, "rope_torch_", refuse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("shape,dim", [((5, 8, 192), 64), ((3, 96), 64), ((1, 64, 512), 64)])
def test_rope_kernel_equals_the_torch_expression_bit_for_bit(
    kernel_only, dtype, interleaved, inverse, shape, dim
):
    gen = torch.Generator().manual_seed(sum(shape) + dim)
    x = (torch.randn(shape, generator=gen) * 4).to(DEVICE, dtype)
    cos, sin = _cs(shape[0], dim, gen)
    want = rope_torch_(x.clone(), cos, sin, dim, inverse, interleaved)
    got = x.clone()
    out = rope_(got, cos, sin, dim, inverse, interleaved)
    assert out is got  # in place
    _same(got, want)
    assert torch.equal(got[..., :-dim], x[..., :-dim])  # the unrotated features untouched
    assert not torch.equal(got[..., -dim:], x[..., -dim:])


def test_rope_kernel_rotates_a_strided_view_in_place(kernel_only):
    """A view of a larger tensor (a head slice: rows not contiguous) is written where it lies;
    its neighbours stay as they were."""
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(4, 6, 128, generator=gen).to(DEVICE)
    cos, sin = _cs(4, 64, gen)
    want = base.clone()
    rope_torch_(want[:, 1:4], cos, sin, 64)
    got = base.clone()
    rope_(got[:, 1:4], cos, sin, 64)
    assert torch.equal(got, want)


def test_rope_inverse_undoes_the_rotation_and_yarn_scaling_matches():
    """Through the classes: a YaRN-scaled rope, forward then inverse, close to the input; each
    the same bits as the torch expression."""
    scaling = {"factor": 16, "original_max_position_embeddings": 4096}
    rope = InterleavedRope(64, 10000.0, scaling)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 4, 128, generator=gen).to(DEVICE)
    cs = _cs(9, 64, gen, rope)
    turned = rope.apply(x, cs)
    assert torch.equal(turned, rope_torch_(x.clone(), *cs, 64))
    back = rope.apply(turned, cs, inverse=True)
    assert torch.allclose(back, x, atol=1e-5)


def test_atom_triton_off_rope_runs_the_torch_expression(monkeypatch):
    """``--triton-off rope`` (here its override) selects the torch expression: same bits."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(6, 2, 64, generator=gen).to(DEVICE, torch.bfloat16)
    cos, sin = _cs(6, 64, gen)
    on = rope_(x.clone(), cos, sin, 64)
    monkeypatch.setenv("ATOM_TRITON_OFF", "rope")
    off = rope_(x.clone(), cos, sin, 64)
    assert torch.equal(off, rope_torch_(x.clone(), cos, sin, 64))
    _same(on, off)
