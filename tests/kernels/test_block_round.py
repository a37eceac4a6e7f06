"""The block-rounding kernel against its torch expression (V4's ``fp8_sim`` / ``fp4_sim``,
with an unrounded tail): the same bits on CUDA and under Triton's interpreter; V4's attention
through it. Skipped where no kernel can run."""

import pytest
import torch

import atom.kernels.block_round as block_round_module
from atom.kernels.block_round import block_round, block_round_torch
from tests.kernels.runnable import DEVICE, needs_kernel, refuse_fallback

pytestmark = needs_kernel


@pytest.fixture(autouse=True)
def no_fallback(monkeypatch):
    """The kernel may not fall back to its torch expression here."""
    refuse_fallback(monkeypatch, block_round_module, "block_round_torch", "block_round")


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)
    # -0.0 and +0.0 compare equal: the sign bits too
    assert torch.equal(torch.signbit(got), torch.signbit(want))


def _values(shape, seed: int, dtype) -> torch.Tensor:
    """Normal values over a wide range of block magnitudes, with zeros, negative zeros and the
    E2M1 ties scattered in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape, generator=g))
    x.view(-1)[::17] = 0.0
    x.view(-1)[5::23] = -0.0
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "fmt,block,shape,cols",
    [
        ("fp8", 64, (5, 512), 448),  # V4-Flash's window KV: 448 NoPE dims, 64 RoPE dims
        ("fp8", 64, (3, 128), 64),
        ("fp8", 64, (7, 256), None),
        ("fp4", 32, (4, 8, 128), None),  # index queries [N, heads, D]
        ("fp4", 32, (9, 64), None),
    ],
)
def test_the_kernel_computes_the_torch_expression(dtype, fmt, block, shape, cols):
    x = _values(shape, sum(shape) + block, dtype)
    _same(block_round(x, fmt, block, cols), block_round_torch(x, fmt, block, cols))


def test_the_e2m1_ties_and_the_scale_edges():
    """One block whose scale is exactly 1 (amax 6): every E2M1 midpoint and its neighbours
    round as ``round_fp4`` rounds them, signs (zeros included) as torch.sign gives them; one
    all-zero block (the amax floor); one block whose amax sits one ulp above 448 * 2^-10,
    where float32 log2 rounds down to -10."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]
    near = [v + d for v in ties for d in (-(2**-20), 2**-20)]
    row = torch.tensor(ties + [-v for v in ties] + near[:16], dtype=torch.float32)
    x = torch.stack([row, torch.zeros(32), torch.full((32,), 1e-3)])
    x[2, 0] = 0.4375 + 2**-25
    x = x.to(DEVICE)
    _same(block_round(x, "fp4", 32), block_round_torch(x, "fp4", 32))
    _same(block_round(x, "fp8", 32), block_round_torch(x, "fp8", 32))


def test_strided_rows_and_bad_arguments():
    """A column slice of a wider tensor (row stride not D) rounds as its contiguous copy; a
    format or a column count the rounding cannot take is refused with the value."""
    x = _values((6, 192), 3, torch.bfloat16)
    part = x[:, 64:]
    _same(block_round(part, "fp8", 64, 64), block_round_torch(part.contiguous(), "fp8", 64, 64))
    with pytest.raises(ValueError, match="'fp6'"):
        block_round(part, "fp6", 64)
    with pytest.raises(ValueError, match="100"):
        block_round(part, "fp8", 64, 100)


def test_v4_attention_through_the_kernel_matches_it_through_torch(monkeypatch):
    """V4's window KV, compressed rows and index queries (v4-tiny with both roundings on and
    64-wide FP8 blocks) give the same bits through the kernel as through torch."""
    from atom.models.deepseek_v4.model import DeepseekV4ForCausalLM
    from atom.models.deepseek_v4.presets import preset_config
    from atom.models.deepseek_v4.reference import reference_forward
    from tests.model.test_paged_vs_reference import tokens

    monkeypatch.setattr(block_round_module, "block_round_torch", block_round_torch)
    cfg = preset_config(
        "v4-tiny", head_dim=80, kv_fp8_sim=True, index_fp4_sim=True, index_head_dim=32
    )
    model = DeepseekV4ForCausalLM(cfg).init_weights(1).to(DEVICE)
    ids = tokens(40, seed=2)
    calls = []
    kernel = block_round_module.block_round
    import atom.models.deepseek_v4.attention as attention_module

    def counted(*args):
        calls.append(args[1])
        return kernel(*args)

    monkeypatch.setattr(attention_module, "block_round", counted)
    with torch.no_grad():
        got = reference_forward(model, ids)
    monkeypatch.setenv("ATOM_TRITON_OFF", "block_round")
    with torch.no_grad():
        want = reference_forward(model, ids)
    assert {"fp8", "fp4"} <= set(calls)
    assert torch.equal(got, want)
