"""The FP8 block-scaled GEMM: the Triton kernel against its torch expression (on CUDA; CI has
no GPU), and the torch expression against what it stands for (everywhere): the input rounded
per block exactly as ``fp8_act_quant`` rounds it, times the dequantized weight."""

import pytest
import torch
import torch.nn.functional as F

from atom.kernels.fp8_gemm import check_fp8_operands, fp8_linear, fp8_linear_torch
from atom.models.common.formats import (
    dequant_fp8,
    fp8_act_quant,
    fp8_act_sim,
    fp8_weight_quant,
)
from tests.kernels.runnable import DEVICE, needs_kernel

CUDA = torch.cuda.is_available()


def _case(n, k, block, m, seed, device="cpu", dtype=torch.float32, spread=True):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    q, s = fp8_weight_quant(w, block)
    x = torch.randn(m, k, generator=gen)
    if spread:  # rows and blocks of very different magnitudes: every scale differs
        x = x * torch.exp2(
            torch.randint(-12, 12, (m, k // block[1]), generator=gen)
        ).repeat_interleave(block[1], 1)
    return x.to(device=device, dtype=dtype), q.to(device), s.to(device)


def test_weight_quantization_round_trips_and_is_idempotent():
    w = torch.randn(100, 96) * torch.linspace(0.01, 10, 96)
    for block in [(32, 32), (128, 128), (1, 32)]:
        q, s = fp8_weight_quant(w, block)
        assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
        assert s.shape == (-(-100 // block[0]), -(-96 // block[1]))
        assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two
        d = dequant_fp8(q, s, block)
        # E4M3 keeps 3 mantissa bits: within 1/16 of each block's scale-relative value
        assert ((d - w).abs() <= (dequant_fp8(torch.ones_like(q), s, block) * 32)).all()
        q2, s2 = fp8_weight_quant(d, block)
        assert torch.equal(dequant_fp8(q2, s2, block), d)


@pytest.mark.parametrize("block", [(32, 32), (128, 128)])
def test_torch_expression_is_the_rounded_input_times_the_dequantized_weight(block):
    x, q, s = _case(200, 256, block, 7, seed=1)
    got = fp8_linear_torch(x, q, s, block)
    xq, xs = fp8_act_quant(x, block[1])
    x_round = (xq.float().unflatten(-1, (-1, block[1])) * xs[..., None]).flatten(-2)
    assert torch.equal(x_round, fp8_act_sim(x, block[1]))
    want = F.linear(x_round, dequant_fp8(q, s, block))
    assert torch.equal(got, want)
    # and it differs from the unrounded product: the rounding is really applied
    assert not torch.equal(got, F.linear(x, dequant_fp8(q, s, block)))


def test_operands_are_checked_with_the_bad_shape_named():
    x, q, s = _case(64, 64, (32, 32), 2, seed=2)
    with pytest.raises(ValueError, match="needs scales \\[2, 2\\], got \\[2, 1\\]"):
        check_fp8_operands(x, q, s[:, :1], (32, 32))
    with pytest.raises(ValueError, match="in_features 64 is not a multiple of the FP8 block 48"):
        check_fp8_operands(x, q, s, (32, 48))
    with pytest.raises(ValueError, match="must be float8_e4m3fn"):
        check_fp8_operands(x, q.float(), s, (32, 32))


@needs_kernel
@pytest.mark.skipif(not CUDA, reason="FP8 dots need a CUDA GPU (sm89+)")
@pytest.mark.parametrize("block", [(32, 32), (128, 128)])
@pytest.mark.parametrize("m", [1, 5, 16, 33, 300, 600])
@pytest.mark.parametrize("n,k", [(96, 256), (1000, 512)])
def test_kernel_matches_the_torch_expression(block, m, n, k):
    x, q, s = _case(n, k, block, m, seed=m + n, device="cuda")
    with torch.no_grad():
        got = fp8_linear(x, q, s, block, torch.float32)
        want = fp8_linear_torch(x, q, s, block, torch.float32)
    # exact products of E4M3 values summed in float32 (the launch plan keeps tiles of <= 32
    # rows, whose FP8 dots keep float32 sums; the cuBLAS path above 64 rows as well)
    err = (got - want).abs().max() / want.abs().max()
    assert err < 2e-6, err
    # the quantization itself is bit-exact: a one-hot weight column reads the rounded input
    eye = torch.zeros(k, k, device="cuda")
    eye[torch.arange(k), torch.arange(k)] = 1.0
    qe, se = fp8_weight_quant(eye, block)
    with torch.no_grad():
        rounded = fp8_linear(x, qe, se, block, torch.float32)
    assert torch.equal(rounded, fp8_act_sim(x.float(), block[1]))
    assert torch.equal(fp8_linear(x, q, s, block, torch.float32), got)  # same bits every run


@needs_kernel
@pytest.mark.skipif(not CUDA, reason="FP8 dots need a CUDA GPU (sm89+)")
def test_kernel_in_bf16_and_a_row_does_not_depend_on_the_other_rows():
    block = (128, 128)
    x, q, s = _case(512, 1024, block, 16, seed=9, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        batch = fp8_linear(x, q, s, block)
        alone = fp8_linear(x[3:4], q, s, block)
        want = fp8_linear_torch(x, q, s, block)
    assert batch.dtype == torch.bfloat16
    assert torch.equal(batch[3:4], alone)  # same size class: same tiles, same sums
    assert ((batch.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-6).all()


@needs_kernel
@pytest.mark.skipif(not CUDA, reason="FP8 dots need a CUDA GPU (sm89+)")
@pytest.mark.parametrize(
    "config",
    [
        dict(QUANT_IN_KERNEL=False),
        dict(SPLIT=4),
        dict(SPLIT=3, QUANT_IN_KERNEL=False, BM=64, BN=128),
        dict(SPLIT=16, BM=16, BN=32, num_stages=6),
        dict(SPLIT=2, GROUP=4, BM=16, BN=32),
        dict(SPLIT=1, GROUP=4, BM=64, BN=64, QUANT_IN_KERNEL=False),
        dict(METHOD="dequant"),
    ],
)
def test_every_kernel_variant_computes_the_same(config):
    from atom.kernels._fp8_gemm_triton import fp8_act_quant_triton, fp8_linear_triton

    block = (32, 32)
    x, q, s = _case(700, 512, block, 37, seed=4, device="cuda")
    xq, xs = fp8_act_quant_triton(x, 32)
    wq, ws = fp8_act_quant(x, 32)
    assert torch.equal(xq.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(xs, ws)
    with torch.no_grad():
        got = fp8_linear_triton(x, q, s, block, torch.float32, config=config)
        want = fp8_linear_torch(x, q, s, block, torch.float32)
    assert ((got - want).abs().max() / want.abs().max()) < 5e-4
    again = fp8_linear_triton(x, q, s, block, torch.float32, config=config)
    assert torch.equal(got, again)


@needs_kernel
@pytest.mark.skipif(not CUDA, reason="FP8 dots need a CUDA GPU (sm89+)")
def test_the_launch_plan_is_a_function_of_the_size_class_and_fills_the_gpu_at_decode():
    from atom.kernels._fp8_gemm_triton import DEQUANT_M, SMALL_M, _sm_count, tile_config

    assert DEQUANT_M >= SMALL_M

    sms = _sm_count(0)
    for n, k, bk in [(4096, 8192, 128), (1280, 5120, 32), (32768, 1024, 128)]:
        small = tile_config(1, n, k, bk)
        assert all(tile_config(m, n, k, bk) == small for m in range(1, 17))
        tiles = -(-n // small["BN"]) * small["SPLIT"]
        assert tiles >= 2 * sms or k // bk // small["SPLIT"] < 8, (n, k, small)
        assert tile_config(DEQUANT_M + 1, n, k, bk) == dict(METHOD="dequant")
        assert max(tile_config(m, n, k, bk)["BM"] for m in range(1, SMALL_M + 1)) <= 32


@needs_kernel
@pytest.mark.parametrize("block", [(32, 32), (128, 128)])
@pytest.mark.parametrize(
    "cfg",
    [
        dict(BM=16, BN=32, KT=128, SPLIT=1),
        dict(BM=32, BN=64, KT=256, SPLIT=2),
        dict(BM=64, BN=16, KT=64, SPLIT=4),  # KT below a 128 block: one block a tile
    ],
)
def test_the_dq_kernel_is_the_rounded_input_times_the_dequantized_weight(block, cfg):
    """METHOD="dq": both operands dequantized in registers, bf16 dots of exact values summed
    in float32: the torch expression to float32 rounding. The reference rounds the input with
    ``fp8_act_quant_triton`` (under Triton's interpreter its E4M3 cast rounds otherwise than
    the GPU's, which equals ``fp8_act_quant``: test_every_kernel_variant_computes_the_same)."""
    from atom.kernels._fp8_gemm_triton import fp8_act_quant_triton, fp8_linear_triton

    for n, k, m in [(96, 256, 5), (200, 512, 33), (130, 1280, 1)]:
        x, q, s = _case(n, k, block, m, seed=n + m, device=DEVICE)
        xq, xs = fp8_act_quant_triton(x, block[1])
        x_round = (xq.float().unflatten(-1, (-1, block[1])) * xs[..., None]).flatten(-2)
        want = F.linear(x_round, dequant_fp8(q, s, block))
        config = dict(METHOD="dq", num_warps=4, num_stages=1 if DEVICE == "cpu" else 3, **cfg)
        with torch.no_grad():
            got = fp8_linear_triton(x, q, s, block, torch.float32, config=config)
        assert ((got - want).abs().max() / want.abs().max()) < 2e-6, (n, k, m)
        assert torch.equal(fp8_linear_triton(x, q, s, block, torch.float32, config=config), got)


@pytest.mark.skipif(not CUDA, reason="the GPU's E4M3 cast (the interpreter's rounds otherwise)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [32, 128])
def test_the_one_kernel_input_rounding_is_the_torch_expression_bit_for_bit(dtype, block):
    """``fp8_act_round`` (the FP4 experts' input rounding on CUDA) = ``fp8_act_sim``, bits and
    dtype, for rows and blocks of very different magnitudes; a row alone gives its bits."""
    from atom.kernels.fp8_gemm import fp8_act_round

    x, _, _ = _case(64, 512, (block, block), 37, seed=block, device="cuda", dtype=dtype)
    got = fp8_act_round(x, block)
    assert got.dtype == dtype and torch.equal(got, fp8_act_sim(x, block))
    assert torch.equal(fp8_act_round(x[5:6], block), got[5:6])
    assert not torch.equal(got, x)  # it rounded
