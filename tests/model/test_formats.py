"""atom.models.common.formats on hand-worked cases: each expected value below was worked out by
hand from the format's definition (E4M3: 3 mantissa bits, subnormal step 2^-9, max 448; E2M1:
magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6), never by calling a copy of the function under test."""

import pytest
import torch

from atom.models.common import formats
from atom.models.common.formats import (
    FP4_VALUES,
    dequant_fp4,
    dequant_fp8,
    dequant_fp8_blocks,
    e8m0_to_float,
    fp4_act_sim,
    fp4_shapes,
    fp8_act_quant,
    fp8_act_sim,
    fp8_linear_sim,
    fp8_scale_shape,
    fp8_sim,
    pow2_scale,
    round_fp4,
    ue8m0_scale,
    unpack_fp4,
)
from atom.models.deepseek_v4 import checkpoint_formats, quant

F32 = torch.float32


def t(values, dtype=F32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def pad(values, n: int) -> torch.Tensor:
    """values followed by +0.0 up to n elements, float32."""
    return torch.cat([t(values), torch.zeros(n - len(values))])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values and equal signs of zero (torch.equal treats -0.0 == 0.0)."""
    return torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))


# --- ue8m0_scale --------------------------------------------------------------------------------


def test_ue8m0_scale_hand_cases():
    # 448 * float32(1/448) rounds to exactly 1.0 (a power of two, mantissa 0) -> 2^0.
    # 448 + 2^-15 (the next float32) gives y just above 1 -> 2^1.
    # 3 / 448 = 0.0067 lies in (2^-8, 2^-7] -> 2^-7.  224 -> y = 0.5 exactly -> 0.5.
    amax = t([448.0, 448.0 + 2**-15, 3.0, 224.0, 1e-4])
    # 1e-4 / 448 = 2.23e-7 lies in (2^-23 = 1.19e-7, 2^-22 = 2.38e-7].
    assert torch.equal(ue8m0_scale(amax, 448.0), t([1.0, 2.0, 2**-7, 0.5, 2**-22]))
    # top 6: 6 -> 1, 3 -> 0.5, 6.5 -> 2, 6 * 2^-126 -> 2^-126 (the FP4 floor stays normal).
    assert torch.equal(
        ue8m0_scale(t([6.0, 3.0, 6.5, 6 * 2**-126]), 6.0), t([1.0, 0.5, 2.0, 2**-126])
    )


def test_ue8m0_scale_is_one_step_above_where_log2_rounds_down():
    # amax = 448 * 2^-10 + one float32 ulp (2^-25). y = amax * float32(1/448) is
    # 2^-10 * (1 + 2^-23): above 2^-10, so the power of two at or above it is 2^-9.
    # V4's rule divides (same y) but float32 log2(y) rounds to exactly -10.0 (the true value
    # -10 + 1.7e-7 is under half of that float32's ulp, 9.5e-7), so ceil keeps 2^-10.
    amax = t([0.4375 + 2**-25])
    y = amax * torch.tensor(1 / 448, dtype=F32)
    assert y.item() == 2**-10 * (1 + 2**-23)
    assert ue8m0_scale(amax, 448.0).item() == 2**-9
    assert pow2_scale(amax, 448.0).item() == 2**-10  # smaller than y: the log2 off-by-one
    # The same near 6 * 2^-9 for the FP4 top.
    amax6 = t([6 * 2**-9 + 2**-29])
    assert ue8m0_scale(amax6, 6.0).item() == 2**-8
    assert pow2_scale(amax6, 6.0).item() == 2**-9


@pytest.mark.parametrize("top", [448.0, 6.0])
def test_ue8m0_scale_sweep(top):
    # Log-uniform amax over 2^-30 .. 2^12 (float32, exact ratios checked in float64).
    amax = torch.exp2(torch.linspace(-30.0, 12.0, 20001))
    s = ue8m0_scale(amax, top).double()
    ratio = amax.double() / top
    mantissa, _ = torch.frexp(s)
    assert torch.all(mantissa == 0.5)  # each a power of two
    # At or above amax / top and less than twice it (float32 rounding of y allowed for).
    assert torch.all(s >= ratio * (1 - 2**-22))
    assert torch.all(s / 2 < ratio * (1 + 2**-22))
    # Away from powers of two (relative distance > 1e-6) V4's log2 rule agrees.
    frac = torch.log2(ratio) - torch.round(torch.log2(ratio))
    far = frac.abs() > 1e-5  # float32 log2 near -30 has ulp 1.9e-6
    assert far.sum() > 19000
    assert torch.equal(s[far].float(), pow2_scale(amax, top)[far])


# --- FP8 activations ---------------------------------------------------------------------------


def test_fp8_act_quant_and_sim_hand_block():
    # Block 0: amax 224 -> s = 0.5, so x / s = 2x, rounded to E4M3 (3 mantissa bits):
    #   224 -> 448 (the top, exact); 220 -> 440 -> 448 (step 32 in [256, 512), 440 is nearer
    #   448 than 416); 100 -> 200, a tie of 192 (mantissa 100b) and 208 (101b) -> even 192;
    #   1.3 -> 2.6 -> 2.5 (step 0.25); -3.1 -> -6.2 -> -6.0 (step 0.5);
    #   -1e-3 -> -0.002 -> -2^-9 (the smallest subnormal, 0.00195); 2^-12 -> 2^-11 -> 0.
    # Block 1: amax 3e-6 is under the 1e-4 floor, so s = ue8m0(1e-4) = 2^-22 (not 2^-27):
    #   3e-6 / 2^-22 = 12.58 -> 13 (step 1 in [8, 16)); 1e-9 / 2^-22 = 0.0042, 2.15 subnormal
    #   steps of 2^-9 -> 2 steps = 2^-8.
    x = torch.cat(
        [
            pad([224.0, 220.0, 100.0, 1.3, -3.1, -1e-3, 2**-12], 32),
            pad([3e-6, 1e-9], 32),
        ]
    )[None]
    q, s = fp8_act_quant(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (1, 64)
    assert s.dtype == F32 and torch.equal(s, t([[0.5, 2**-22]]))
    want_q = torch.cat(
        [pad([448.0, 448.0, 192.0, 2.5, -6.0, -(2**-9), 0.0], 32), pad([13.0, 2**-8], 32)]
    )[None]
    assert torch.equal(q.float(), want_q)

    y = fp8_act_sim(x)
    want = torch.cat(
        [
            pad([224.0, 224.0, 96.0, 1.25, -3.0, -(2**-10), 0.0], 32),
            pad([13 * 2**-22, 2**-30], 32),
        ]
    )[None]
    assert y.dtype == F32 and torch.equal(y, want)
    # x's dtype is kept (-3.1 is -3.09375 in bfloat16, still -> -6.1875 -> -6.0).
    xb = pad([224.0, 220.0, 100.0, -3.1], 32).to(torch.bfloat16)
    yb = fp8_act_sim(xb)
    assert yb.dtype == torch.bfloat16
    assert torch.equal(yb.float(), pad([224.0, 224.0, 96.0, -3.0], 32))


def test_fp8_act_sim_zero_block_and_block_size():
    # An all-zero block has amax 0 -> floored at 1e-4, so zeros come back (no 0/0).
    assert same_bits(fp8_act_sim(torch.zeros(2, 32)), torch.zeros(2, 32))
    # -0.0 keeps its sign through E4M3.
    assert torch.signbit(fp8_act_sim(pad([-0.0, 1.0], 32))[0])
    # block=16 gives each half its own scale: [16, 1] -> s = 2^-4 for the first half
    # (16 / 448 in (2^-5, 2^-4]) and 2^-8 for the second (1 / 448 in (2^-9, 2^-8]).
    x = torch.cat([pad([16.0], 16), pad([1.0], 16)])
    _, s = fp8_act_quant(x, block=16)
    assert torch.equal(s, t([2**-4, 2**-8]))
    with pytest.raises(ValueError, match="multiple of the block"):
        fp8_act_sim(torch.zeros(40))


def test_v4_fp8_sim_keeps_its_log2_scale():
    # The block whose amax is 0.4375 + 2^-25 (see above): V4 scales by 2^-10, V4.1 by 2^-9.
    # The two grids differ only among subnormals: x = 1.25 * 2^-19 is 1.25 * 2^-9 under
    # s = 2^-10 (-> 1 step of 2^-9 -> 2^-19) but 0.625 * 2^-9 under s = 2^-9 (-> 2^-18).
    x = pad([0.4375 + 2**-25, 1.25 * 2**-19], 64)
    assert fp8_sim(x)[1].item() == 2**-19
    assert fp8_act_sim(x)[1].item() == 2**-18
    # The amax itself: 448 + 2^-15 is clamped to 448 under V4; 224.0000153 -> 224 under V4.1.
    assert fp8_sim(x)[0].item() == fp8_act_sim(x)[0].item() == 0.4375


# --- FP4 activations ---------------------------------------------------------------------------


def test_round_fp4_ties():
    v = t([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -2.5, 0.3, 5.1, 7.0])
    assert torch.equal(round_fp4(v), t([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -2.0, 0.5, 6.0, 6.0]))


def test_fp4_act_sim_e8m0_hand_block():
    # amax 3 -> s = ue8m0(3, 6) = 0.5, so x / s = 2x exactly. Ties x = tie * 0.5:
    # 0.125 (0.25 -> 0), 0.375 (0.75 -> 1), 0.625 (1.25 -> 1), 0.875 (1.75 -> 2),
    # 1.25 (2.5 -> 2), 1.75 (3.5 -> 4), 2.5 (5 -> 4), -1.25 (-2.5 -> -2);
    # 3 (6 -> 6), 1.1 (2.2 -> 2), -0.1 (-0.2 -> -0), -0.0 (-> -0), 0.0 (-> +0).
    x = pad([0.125, 0.375, 0.625, 0.875, 1.25, 1.75, 2.5, -1.25, 3.0, 1.1, -0.1, -0.0, 0.0], 32)
    want = pad([0.0, 0.5, 0.5, 1.0, 1.0, 2.0, 2.0, -1.0, 3.0, 1.0, -0.0, -0.0, 0.0], 32)
    y = fp4_act_sim(x, 32, "e8m0")
    assert y.dtype == F32 and same_bits(y, want)
    assert torch.equal(torch.signbit(y)[10:13], torch.tensor([True, True, False]))
    # All zeros: amax floored at 6 * 2^-126, zeros come back.
    assert same_bits(fp4_act_sim(torch.zeros(32), 32, "e8m0"), torch.zeros(32))


def test_fp4_act_sim_e4m3_hand_block():
    # amax 1.8 -> amax / 6 = 0.3, in [0.25, 0.5) where E4M3 steps by 2^-5: 0.28125 (0.01875
    # away) or 0.3125 (0.0125 away) -> s = 0.3125 = 5/16. Ties x = tie * 5/16 divide exactly.
    s = 0.3125
    x = t(
        [1.8, 0.25 * s, 0.75 * s, 1.25 * s, 1.75 * s, 2.5 * s, 3.5 * s, 5.0 * s, -2.5 * s]
        + [-0.0, -0.05, 0.0, 1.0, -1.2, 0.5, 0.1]
    )
    # 1.8 / s = 5.76 -> 6; ties as listed; -0.05 / s = -0.16 -> -0; 1.0 / s = 3.2 -> 3;
    # -1.2 / s = -3.84 -> -4; 0.5 / s = 1.6 -> 1.5; 0.1 / s = 0.32 -> 0.5.
    r = t([6, 0, 1, 1, 2, 2, 4, 4, -2] + [-0.0, -0.0, 0.0, 3, -4, 1.5, 0.5])
    y = fp4_act_sim(x, 16, "e4m3")
    assert same_bits(y, r * s)
    assert y[0].item() == 1.875


def test_fp4_act_sim_e4m3_floor_and_saturation():
    # amax 0.004 is under 6 * 2^-9 = 0.0117 -> s = 2^-9 (E4M3's smallest subnormal; without
    # the floor 0.004 / 6 would round to an E4M3 scale of 0). 0.004 * 512 = 2.05 -> 2;
    # 1e-4 * 512 = 0.05 -> 0.
    y = fp4_act_sim(pad([0.004, 1e-4], 16), 16, "e4m3")
    assert same_bits(y, pad([2 * 2**-9, 0.0], 16))
    # amax 6000 -> 6000 / 6 = 1000, clamped to 448 before the cast (E4M3's max; no NaN):
    # 6000 / 448 = 13.4 -> clamped to 6 -> 2688; 448 -> 1 -> 448; -700 -> -1.56 -> -1.5 -> -672.
    y = fp4_act_sim(pad([6000.0, 448.0, -700.0], 16), 16, "e4m3")
    assert torch.equal(y, pad([2688.0, 448.0, -672.0], 16))


def test_fp4_act_sim_dtype_and_errors():
    x = pad([3.0, 0.875], 32).to(torch.bfloat16)
    y = fp4_act_sim(x, 32, "e8m0")
    assert y.dtype == torch.bfloat16 and torch.equal(y.float(), pad([3.0, 1.0], 32))
    with pytest.raises(ValueError, match="scale_fmt"):
        fp4_act_sim(torch.zeros(32), 32, "e5m2")
    with pytest.raises(ValueError, match="multiple of the block"):
        fp4_act_sim(torch.zeros(24), 16, "e4m3")


# --- FP8 GEMM ----------------------------------------------------------------------------------


def test_fp8_linear_sim_hand_product():
    # x rounds as in the hand block above (s = 0.5): [224, 100, 1.3] -> [224, 96, 1.25].
    x = pad([224.0, 100.0, 1.3], 32)[None]
    w = torch.zeros(2, 32)
    w[0, :3] = t([1.0, 1.0, 1.0])
    w[1, :3] = t([0.5, -1.0, 4.0])
    # Row 0: 224 + 96 + 1.25 = 321.25 (unrounded x would give 325.3).
    # Row 1: 112 - 96 + 5 = 21.
    y = fp8_linear_sim(x, w)
    assert y.dtype == F32 and torch.equal(y, t([[321.25, 21.0]]))


# --- stored weights ----------------------------------------------------------------------------


def test_fp8_scale_shape():
    assert fp8_scale_shape((40, 70), (32, 32)) == (2, 3)
    assert fp8_scale_shape((300, 129)) == (3, 2)  # V4's 128 x 128 default
    assert fp8_scale_shape((64, 64), (32, 32)) == (2, 2)


def _block_map_40x70() -> torch.Tensor:
    """Multipliers of the [2, 3] scales below, spread over [40, 70] by hand."""
    m = torch.empty(40, 70)
    m[:32, :32], m[:32, 32:64], m[:32, 64:] = 1.0, 2.0, 0.5
    m[32:, :32], m[32:, 32:64], m[32:, 64:] = 8.0, 2**-7, 1.0
    return m


@pytest.mark.parametrize("scale_kind", ["e8m0fnu", "uint8", "float32"])
def test_dequant_fp8_32x32_blocks_partial(scale_kind):
    # Exponent bytes b mean 2^(b - 127): 127 -> 1, 128 -> 2, 126 -> 0.5, 130 -> 8, 120 -> 2^-7.
    exps = torch.tensor([[127, 128, 126], [130, 120, 127]], dtype=torch.uint8)
    scale = {
        "e8m0fnu": exps.view(torch.float8_e8m0fnu),
        "uint8": exps,
        "float32": t([[1.0, 2.0, 0.5], [8.0, 2**-7, 1.0]]),
    }[scale_kind]
    w = torch.ones(40, 70)
    w[35, 65] = -1.5  # block (1, 2): x1
    w[33, 33] = 0.75  # block (1, 1): x2^-7
    w[31, 63] = 448.0  # block (0, 1): x2
    weight = w.to(torch.float8_e4m3fn)
    want = _block_map_40x70()
    want[35, 65], want[33, 33], want[31, 63] = -1.5, 0.75 * 2**-7, 896.0
    for got in (dequant_fp8_blocks(weight, scale, (32, 32)), dequant_fp8(weight, scale, (32, 32))):
        assert got.dtype == F32 and got.shape == (40, 70)
        assert torch.equal(got, want)


def test_dequant_fp8_scale_shape_checked():
    weight = torch.ones(40, 70).to(torch.float8_e4m3fn)
    # V4's default 128 x 128 blocks want a [1, 1] scale, not the [2, 3] of 32 x 32 blocks.
    with pytest.raises(ValueError, match=r"needs a scale of shape \[1, 1\], got \[2, 3\]"):
        dequant_fp8(weight, torch.ones(2, 3))
    assert torch.equal(dequant_fp8(weight, t([[4.0]])), torch.full((40, 70), 4.0))


def test_e8m0_to_float():
    b = torch.tensor([0, 1, 126, 127, 128, 254], dtype=torch.uint8)
    want = t([2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127])
    assert torch.equal(e8m0_to_float(b), want)
    assert torch.equal(e8m0_to_float(b.view(torch.float8_e8m0fnu)), want)
    assert torch.equal(e8m0_to_float(t([0.25, 3.0])), t([0.25, 3.0]))


def test_fp4_nibble_order():
    # Byte 0x3A: low nibble 0xA = sign 1, code 2 (-1.0) is element 0; high 0x3 = code 3 (1.5)
    # is element 1. Byte 0xF0 (-16 as int8): low 0x0 -> 0.0, high 0xF -> sign 1, code 7 (-6).
    packed = torch.tensor([[0x3A, -16]], dtype=torch.int8)
    assert torch.equal(unpack_fp4(packed), t([[-1.0, 1.5, 0.0, -6.0]]))
    assert torch.equal(unpack_fp4(packed.view(torch.uint8)), t([[-1.0, 1.5, 0.0, -6.0]]))
    # group 2: scale bytes 128 (x2) for elements 0-1, 126 (x0.5) for 2-3.
    scale = torch.tensor([[128, 126]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert torch.equal(dequant_fp4(packed, scale, group=2), t([[-2.0, 3.0, 0.0, -3.0]]))
    assert fp4_shapes((8, 64)) == ((8, 32), (8, 2))
    assert fp4_shapes((8, 64), group=16) == ((8, 32), (8, 4))


# --- the V4 modules re-export ------------------------------------------------------------------


def test_v4_modules_reexport_the_same_objects():
    for name in ("FP8_MAX", "FP4_MAX", "FP4_VALUES", "fp8_sim", "round_fp4", "fp4_sim"):
        assert getattr(quant, name) is getattr(formats, name), name
    assert quant.hadamard is formats.hadamard
    names = (
        "e8m0_to_float",
        "dequant_fp8",
        "fp8_scale_shape",
        "fp4_shapes",
        "unpack_fp4",
        "dequant_fp4",
        "FP4_VALUES",
        "FP8_TILE",
        "FP4_GROUP",
    )
    for name in names:
        assert getattr(checkpoint_formats, name) is getattr(formats, name), name
    assert FP4_VALUES == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    assert formats.FP8_TILE == 128 and formats.FP4_GROUP == 32
