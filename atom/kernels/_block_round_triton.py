"""The Triton kernel behind ``atom.kernels.block_round`` (imported only where Triton is)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels._torch_math_triton import exp2f, log2f
from atom.kernels.triton_env import interpreting


@triton.jit
def _nearest_e2m1(mag):
    """|v| (<= 6) -> the nearest E2M1 magnitude, ties to the even code: 0.25->0, 0.75->1,
    1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4 (``round_fp4``'s rule; its float32 distances to the
    two neighbours are exact there, so comparing with the midpoints decides the same)."""
    r = tl.where(mag <= 5.0, 4.0, 6.0)
    r = tl.where(mag < 3.5, 3.0, r)
    r = tl.where(mag <= 2.5, 2.0, r)
    r = tl.where(mag < 1.75, 1.5, r)
    r = tl.where(mag <= 1.25, 1.0, r)
    r = tl.where(mag < 0.75, 0.5, r)
    return tl.where(mag <= 0.25, 0.0, r)


@triton.jit
def _round_e4m3(v):
    """v (float32, |v| <= 448) rounded to the nearest E4M3 value, ties to even: the quantum is
    2^(e - 3) for v's binade 2^e, 2^-9 among the subnormals (e < -6); v / quantum is rounded to
    an integer by adding and subtracting 1.5 * 2^23 (exact below 2^22, round to nearest even
    in between); v's sign bit is kept (-0.0 and values rounding to zero stay negative). The
    same as the E4M3 cast's rounding, computed so on the GPU and under Triton's interpreter
    alike (the interpreter's cast rounds otherwise)."""
    e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.where(e < -6, -6, e)
    quantum = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    y = tl.math.div_rn(v, quantum)
    r = ((y + 12582912.0) - 12582912.0) * quantum
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _block_round_kernel(
    x_ptr,
    out_ptr,
    x_stride,
    out_stride,
    round_cols,
    cols,
    inv_top,
    amax_min,
    BLOCK: tl.constexpr,
    NB: tl.constexpr,
    TAIL: tl.constexpr,
    FP4: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    """One row per program: its first ``round_cols`` values in blocks of BLOCK through E4M3 or
    E2M1 with the scale exp2(ceil(log2(amax * inv_top))), the rest copied."""
    r = tl.program_id(0).to(tl.int64)
    kb = tl.arange(0, NB)
    ok = kb < round_cols // BLOCK
    offs = kb[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    a = tl.load(x_ptr + r * x_stride + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(a), axis=1)
    amax = tl.where(amax < amax_min, amax_min, amax)  # torch's clamp(min=)
    s = exp2f(tl.ceil(log2f(amax * inv_top, LIBDEVICE)), LIBDEVICE)[:, None]
    v = tl.math.div_rn(a, s)  # exact: s is a power of two
    if FP4:
        mag = tl.abs(v)
        mag = tl.where(mag > 6.0, 6.0, mag)
        sign = tl.where(v > 0.0, 1.0, tl.where(v < 0.0, -1.0, 0.0))  # torch.sign
        q = _nearest_e2m1(mag) * sign
    else:
        v = tl.where(v > 448.0, 448.0, tl.where(v < -448.0, -448.0, v))
        q = _round_e4m3(v)
    out = q * s
    tl.store(out_ptr + r * out_stride + offs, out.to(out_ptr.dtype.element_ty), mask=ok[:, None])
    if TAIL > 0:
        c = round_cols + tl.arange(0, TAIL)
        m = c < cols
        t = tl.load(x_ptr + r * x_stride + c, mask=m, other=0.0)
        tl.store(out_ptr + r * out_stride + c, t.to(out_ptr.dtype.element_ty), mask=m)


def block_round_triton(
    x: torch.Tensor, fp4: bool, block: int, round_cols: int, top: float, amax_min: float
) -> torch.Tensor:
    """x [R, D] (unit column stride) -> a new [R, D] tensor of x's dtype (``block_round``)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    out = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    tail = cols - round_cols
    if rows:
        _block_round_kernel[(rows,)](
            x,
            out,
            x.stride(0),
            out.stride(0),
            round_cols,
            cols,
            1.0 / top,
            amax_min,
            BLOCK=block,
            NB=triton.next_power_of_2(max(1, round_cols // block)),
            TAIL=triton.next_power_of_2(tail) if tail else 0,
            FP4=fp4,
            LIBDEVICE=not interpreting(),
            enable_fp_fusion=False,
        )
    return out
