"""The number formats DeepSeek-V4 and V4.1 use: stored weights decoded, and roundings simulated.

Everything here works on CPU or GPU tensors in float32 and reproduces a format's rounding
exactly (round to the format and back), so a reference forward and a kernel-shaped path that
use the same function see bit-identical values.

**Stored weights** (safetensors as published), decoded to float32:

* FP8: ``float8_e4m3fn`` values with one E8M0 scale per weight block, scale tensor
  ``[ceil(out/bo), ceil(in/bi)]`` for ``block = (bo, bi)``; value = e4m3 * 2^(s - 127).
  V4 ships 128 x 128 blocks (``FP8_TILE``), V4.1-Flash 32 x 32.
* FP4 routed experts: bytes holding two E2M1 codes each, element 2j in the low nibble and
  2j+1 in the high nibble (``[out, in/2]``), one E8M0 scale per ``FP4_GROUP`` = 32 inputs
  (``[out, in/32]``). A code's bit 3 is the sign, bits 0-2 index ``FP4_VALUES``.
* E8M0 scales are exponent bytes (``float8_e8m0fnu``; a numeric cast would destroy them, so
  they are read as uint8). A scale stored as float is taken as the multiplier itself.

**V4's simulated quantization** (what V4 was trained with): ``fp8_sim`` (blocks of 64, NoPE
dims of window KV and compressed rows) and ``fp4_sim`` (blocks of 32, the indexer's q and k
after ``hadamard``). Their power-of-two scale is ``pow2_scale``: exp2(ceil(log2(amax / top))).

**V4.1's published inference roundings**: ``ue8m0_scale`` (the scale built from float32 bits,
as the published kernels compute it), ``fp8_act_sim`` / ``fp8_act_quant`` (blocks of 32: window
KV over the whole vector, RoPE dims included, and every FP8/FP4 linear's input),
``fp4_act_sim`` (E8M0 scales in blocks of 32 for the indexer's q and k, E4M3 scales in blocks
of 16 for compressed KV rows) and ``fp8_linear_sim`` (a block-scaled FP8 GEMM).

The two scale rules differ: ``pow2_scale`` divides and takes a float32 log2, which rounds
values just above a power of two down onto it (and so picks a scale one step too small);
``ue8m0_scale`` multiplies by float32(1/top) and reads the exponent bits. They agree away from
powers of two; V4's functions keep ``pow2_scale`` because V4's results are pinned by tests.
"""

from __future__ import annotations

import math

import torch

from atom.kernels import invariant

FP8_MAX = 448.0
FP4_MAX = 6.0
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # E2M1 magnitudes, by code 0..7

FP8_TILE = 128  # V4's FP8 weight block side (the default of dequant_fp8 / fp8_scale_shape)
FP4_GROUP = 32  # inputs per E8M0 scale of a packed FP4 weight

# Floors on a block's amax, so an all-zero block gets a finite, non-zero scale.
FP8_ACT_AMAX_MIN = 1e-4
FP4_E8M0_AMAX_MIN = FP4_MAX * 2.0**-126  # scale >= 2^-126, the smallest normal float32
FP4_E4M3_AMAX_MIN = FP4_MAX * 2.0**-9  # scale >= 2^-9, the smallest E4M3 subnormal

_MANTISSA_BITS = 23
_MANTISSA_MASK = (1 << _MANTISSA_BITS) - 1


# ---------------------------------------------------------------------------------------------
# Scales


def pow2_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """V4's scale: exp2(ceil(log2(amax / top))), elementwise, in amax's (float) dtype.

    Meant as the power of two at or above amax / top, but the float32 log2 of a value a few
    ulps above 2^k can round to exactly k, and then the scale is 2^k, below amax / top (see
    ``ue8m0_scale``). Kept as is: V4's ``fp8_sim`` and ``fp4_sim`` are defined by it.
    amax / top is computed as amax * (1 / top), the reciprocal rounded to amax's dtype first:
    what torch's CUDA division by a Python number does; written out so the CPU (which divides)
    rounds alike, and ``atom.kernels.block_round`` with it.
    """
    return torch.exp2(torch.ceil(torch.log2(amax * (1.0 / top))))


def ue8m0_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """The power of two at or above amax / top, as the published V4.1 kernels compute it.

    amax: any shape, finite and >= 0 (callers clamp it away from 0 first). Returns float32 of
    amax's shape, each a power of two (an exact UE8M0 value).

    y = amax.float() * float32(1/top): the reciprocal is rounded to float32 first and one
    float32 multiply follows (not a division). Then, from y's IEEE-754 bits, the result is
    2^(exponent - 127 + (mantissa != 0)): y's own exponent when y is a power of two, else one
    more. Unlike ``pow2_scale`` no log2 is rounded, so the result is never below y. The result
    is built from bits as the kernel does, so y = 0 gives 0.0 (exponent field 0).
    """
    inv = torch.tensor(1.0 / top, dtype=torch.float32, device=amax.device)
    bits = (amax.float() * inv).view(torch.int32)
    exponent = (bits >> _MANTISSA_BITS) & 0xFF
    biased = exponent + ((bits & _MANTISSA_MASK) != 0).to(torch.int32)
    return (biased << _MANTISSA_BITS).view(torch.float32)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes (``float8_e8m0fnu`` or uint8), or float multipliers -> float32.

    A byte b means 2^(b - 127); any other dtype is taken as the multiplier itself.
    """
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return torch.exp2(scale.view(torch.uint8).float() - 127.0)
    return scale.float()


# ---------------------------------------------------------------------------------------------
# Stored weights


def fp8_scale_shape(
    shape: tuple[int, int], block: tuple[int, int] = (FP8_TILE, FP8_TILE)
) -> tuple[int, int]:
    """Scale shape of an FP8 [out, in] weight in (bo, bi) blocks: (ceil(out/bo), ceil(in/bi))."""
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def dequant_fp8(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = (FP8_TILE, FP8_TILE),
) -> torch.Tensor:
    """weight e4m3 [out, in], scale [ceil(out/bo), ceil(in/bi)] -> float32 [out, in].

    block = (bo, bi): rows and columns sharing one scale; the last blocks may be partial.
    scale may be E8M0 (``float8_e8m0fnu`` or uint8 exponent bytes) or float multipliers.
    """
    out, inp = weight.shape
    want = fp8_scale_shape((out, inp), block)
    if tuple(scale.shape) != want:
        raise ValueError(
            f"FP8 weight {list(weight.shape)} in {list(block)} blocks needs a scale of shape "
            f"{list(want)}, got {list(scale.shape)}"
        )
    s = e8m0_to_float(scale).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return weight.float() * s[:out, :inp]


def dequant_fp8_blocks(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """``dequant_fp8`` with the block stated (e.g. (32, 32) for V4.1-Flash); same contract."""
    return dequant_fp8(weight, scale, block)


def fp4_shapes(
    shape: tuple[int, int], group: int = FP4_GROUP
) -> tuple[tuple[int, int], tuple[int, int]]:
    """(packed weight shape, scale shape) of a logical [out, in] FP4 matrix."""
    return (shape[0], shape[1] // 2), (shape[0], shape[1] // group)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed int8/uint8 bytes [..., in/2] -> E2M1 values float32 [..., in].

    Element 2j is byte j's low nibble, 2j+1 its high nibble; code bit 3 is the sign.
    """
    b = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)
    table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=packed.device)
    mag = table[codes & 0x7]
    return torch.where(codes & 0x8 != 0, -mag, mag)


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, group: int = FP4_GROUP) -> torch.Tensor:
    """Packed [out, in/2], scale [out, in/group] (E8M0 or float) -> float32 [out, in]."""
    values = unpack_fp4(packed)
    return values * e8m0_to_float(scale).repeat_interleave(group, 1)


# ---------------------------------------------------------------------------------------------
# Element roundings


_FP4_GRIDS: dict[torch.device, torch.Tensor] = {}


def _fp4_grid(device: torch.device) -> torch.Tensor:
    """The E2M1 values on ``device``, made once per device (a host-to-device copy per call
    would synchronize a CUDA forward; a meta grid is never kept)."""
    grid = _FP4_GRIDS.get(device)
    if grid is None:
        grid = torch.tensor(FP4_VALUES, dtype=torch.float32, device=device)
        if device.type != "meta":
            _FP4_GRIDS[device] = grid
    return grid


def round_fp4(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value (|x| clamped to 6), ties to the even code, sign kept for x != 0.

    Ties: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4. The sign comes from
    torch.sign, so x = -0.0 gives +0.0 (V4's behaviour; ``fp4_act_sim`` keeps the sign).
    """
    grid = _fp4_grid(x.device)
    mag = x.abs().clamp(max=FP4_MAX)
    hi = torch.bucketize(mag, grid).clamp(max=len(FP4_VALUES) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return torch.where(pick_hi, grid[hi], grid[lo]) * torch.sign(x)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., D] as float32 [..., D/block, block]; D must be a multiple of block."""
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the block {block}")
    return x.float().unflatten(-1, (-1, block))


def _amax(xb: torch.Tensor, floor: float) -> torch.Tensor:
    return xb.abs().amax(-1, keepdim=True).clamp(min=floor)


# ---------------------------------------------------------------------------------------------
# V4's simulated quantization


def fp8_sim(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """V4: x [..., D] (D % block == 0) rounded through E4M3 with a ``pow2_scale`` per block.

    Returns x's shape and dtype. amax is floored at 1e-4; values saturate at +-448.
    """
    xb = _blocks(x, block)
    scale = pow2_scale(_amax(xb, FP8_ACT_AMAX_MIN), FP8_MAX)
    q = (xb / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).flatten(-2).to(x.dtype)


def fp4_sim(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """V4: x [..., D] (D % block == 0) rounded through E2M1 with a ``pow2_scale`` per block.

    Returns x's shape and dtype. amax is floored at 6 * 2^-126.
    """
    xb = _blocks(x, block)
    scale = pow2_scale(_amax(xb, FP4_E8M0_AMAX_MIN), FP4_MAX)
    return (round_fp4(xb / scale) * scale).flatten(-2).to(x.dtype)


_HADAMARD: dict[tuple[int, torch.device], torch.Tensor] = {}


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform of the last dim (a power of two), in float32."""
    n = x.shape[-1]
    key = (n, x.device)
    h = _HADAMARD.get(key)
    if h is None:
        h = torch.ones(1, 1)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        h = _HADAMARD.setdefault(key, (h / math.sqrt(n)).to(x.device))
    if invariant.enabled():  # h is symmetric: x @ h, row-tiled
        return invariant.linear(x.float(), h)
    return x.float() @ h


# ---------------------------------------------------------------------------------------------
# V4.1's published inference roundings


def fp8_act_quant(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """V4.1's FP8 activation quantization: x [..., D] (D % block == 0) ->
    (``float8_e4m3fn`` values [..., D], float32 UE8M0 scales [..., D/block]).

    Per block of the last dim: amax = max|x| floored at 1e-4, s = ``ue8m0_scale(amax, 448)``,
    q = clamp(x / s, -448, 448) cast to E4M3 (round to nearest even; the clamp makes values
    past 448 saturate instead of becoming NaN). x / s is exact (s is a power of two).
    float32(1/448) is above 1/448, so for finite x, |x / s| <= 448 already; the clamp is kept
    as the kernel has it, so no cast's overflow rule (NaN or saturate) can matter.
    """
    xb = _blocks(x, block)
    s = ue8m0_scale(_amax(xb, FP8_ACT_AMAX_MIN), FP8_MAX)
    q = (xb / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), s.squeeze(-1)


def fp8_act_sim(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """V4.1's FP8 activation rounding, simulated: ``fp8_act_quant`` dequantised (q * s).

    x [..., D] (D % block == 0) -> a new tensor of x's shape and dtype. The reference applies
    it over the whole window-KV vector (RoPE dims included) and to every FP8/FP4 linear's input.
    """
    q, s = fp8_act_quant(x, block)
    return (q.float().unflatten(-1, (-1, block)) * s.unsqueeze(-1)).flatten(-2).to(x.dtype)


def fp4_act_sim(x: torch.Tensor, block: int, scale_fmt: str) -> torch.Tensor:
    """V4.1's FP4 (E2M1) activation rounding, simulated: x [..., D] (D % block == 0) -> x's
    shape and dtype.

    Per block of the last dim, with amax = max|x|:

    * scale_fmt "e8m0" (the indexer's q and k, block 32): amax floored at 6 * 2^-126,
      s = ``ue8m0_scale(amax, 6)``.
    * scale_fmt "e4m3" (compressed KV rows, block 16): amax floored at 6 * 2^-9,
      s = amax / 6 (float32 division) rounded to E4M3 (saturating at 448) and back.

    Then clamp(x / s, -6, 6) is rounded to the nearest E2M1 value, ties to the even code
    (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4), keeping the sign of x / s,
    zeros included (-0.0 stays -0.0, as the E2M1 code 0b1000); result = rounded * s.
    """
    xb = _blocks(x, block)
    if scale_fmt == "e8m0":
        s = ue8m0_scale(_amax(xb, FP4_E8M0_AMAX_MIN), FP4_MAX)
    elif scale_fmt == "e4m3":
        s = _amax(xb, FP4_E4M3_AMAX_MIN) / FP4_MAX
        s = s.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    else:
        raise ValueError(f"scale_fmt must be 'e8m0' or 'e4m3', got {scale_fmt!r}")
    v = (xb / s).clamp(-FP4_MAX, FP4_MAX)
    # round_fp4 takes its sign from torch.sign, which loses -0.0; copysign restores it.
    r = torch.copysign(round_fp4(v), v)
    return (r * s).flatten(-2).to(x.dtype)


def fp8_linear_sim(x: torch.Tensor, weight: torch.Tensor, block: int = 32) -> torch.Tensor:
    """A block-scaled FP8 GEMM, simulated: x [..., in] (in % block == 0), weight float32
    [out, in] (already dequantised, e.g. by ``dequant_fp8``) -> float32 [..., out].

    F.linear(fp8_act_sim(x, block) as float32, weight): the kernel quantises x per block of
    ``block`` inputs (``fp8_act_quant``), multiplies E4M3 by E4M3 exactly and applies both
    scales, so this is what it computes up to the order of float32 summation. The activation
    is dequantised in float32 here (not in x's dtype), as the kernel never rounds it back.
    """
    return invariant.linear(fp8_act_sim(x.float(), block), weight.float())


def fp8_weight_quant(
    weight: torch.Tensor, block: tuple[int, int] = (FP8_TILE, FP8_TILE)
) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense [out, in] weight -> (``float8_e4m3fn`` [out, in], float32 scales
    [ceil(out/bo), ceil(in/bi)]), the inverse of ``dequant_fp8`` up to the rounding.

    Per (bo, bi) block (the last ones may be partial): amax floored at 1e-4,
    s = ``ue8m0_scale(amax, 448)`` (a power of two, so ``dequant_fp8`` of the result is
    q * s exactly), q = clamp(w / s, -448, 448) cast to E4M3 (round to nearest even).
    Quantizing a dequantized weight again gives the same values back.
    """
    out, inp = weight.shape
    so, si = fp8_scale_shape((out, inp), block)
    w = weight.float()
    padded = w.new_zeros(so * block[0], si * block[1])
    padded[:out, :inp] = w
    tiles = padded.view(so, block[0], si, block[1])
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=FP8_ACT_AMAX_MIN)
    s = ue8m0_scale(amax, FP8_MAX)
    q = (tiles / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(so * block[0], si * block[1])[:out, :inp].contiguous(), s


def fp4_weight_quant(
    weight: torch.Tensor, group: int = FP4_GROUP
) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense [out, in] weight (in % group == 0) -> (packed uint8 [out, in/2], E8M0 uint8
    [out, in/group]), the inverse of ``dequant_fp4`` up to the rounding: per group of inputs,
    amax floored at 6 * 2^-126, s = ``ue8m0_scale(amax, 6)`` (a power of two), each value
    ``round_fp4(w / s)`` coded (element 2j in the low nibble). Quantizing a dequantized weight
    again gives the same values back (not always the same codes: a group whose largest value
    rounded to 3 is coded again at half the scale)."""
    out, inp = weight.shape
    if inp % group or inp % 2:
        raise ValueError(f"an FP4 weight needs in_features divisible by {group}; got {inp}")
    w = weight.float().view(out, inp // group, group)
    s = ue8m0_scale(w.abs().amax(-1, keepdim=True).clamp(min=FP4_E8M0_AMAX_MIN), FP4_MAX)
    v = round_fp4(w / s).view(out, inp)
    grid = _fp4_grid(weight.device)
    mag = torch.bucketize(v.abs(), grid)  # exact grid values: their codes 0..7
    codes = (mag | ((v < 0).to(torch.int64) << 3)).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    exponent = ((s.view(torch.int32) >> _MANTISSA_BITS) & 0xFF).to(torch.uint8)
    return packed.contiguous(), exponent.view(out, inp // group).contiguous()
