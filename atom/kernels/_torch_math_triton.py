"""Element-wise functions as torch's CUDA kernels compute them, for kernels that keep torch's
bits (imported only where Triton is): libdevice's ``expf``, ``log1pf``, ``log2f`` and ``exp2f``
are the CUDA math library's, which torch's kernels call. Triton's interpreter has no libdevice:
a kernel passes ``LIBDEVICE=not interpreting()``, and there numpy's functions run instead."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def expf(z, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        e = libdevice.exp(z)
    else:
        e = tl.exp(z)
    return e


@triton.jit
def log1pf(z, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        y = libdevice.log1p(z)
    else:
        y = tl.log(1.0 + z)
    return y


@triton.jit
def log2f(z, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        y = libdevice.log2(z)
    else:
        y = tl.log2(z)
    return y


@triton.jit
def exp2f(z, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        y = libdevice.exp2(z)
    else:
        y = tl.exp2(z)
    return y
