"""A linear layer whose weight is stored as FP8: block-scaled E4M3 weights times activations
quantized to E4M3 on the fly, as DeepSeek's FP8 GEMMs compute it.

The weight is ``float8_e4m3fn`` [N, K] with one float32 power-of-two scale per (bo, bk) block
([ceil(N/bo), K/bk]); the input [..., K] is quantized per block of ``bk`` values along K with
``atom.models.common.formats.fp8_act_quant`` (UE8M0 scales). The product is, per K block,
(q_x . q_w) * s_x * s_w summed over the blocks in float32, and rounded once to the output dtype.

The torch expression, ``fp8_linear_torch``, dequantizes both sides to float32 and runs one
``F.linear``: the same products, summed in another order (float32 noise). It is the CPU path
and the numerical reference. On CUDA the Triton kernel quantizes the input tile in registers
(no extra pass over the activations) and reads the FP8 weight once: half the bytes of a bf16
weight, which is what a decode step streams.
"""

from __future__ import annotations

import torch

from atom.kernels import invariant, use_triton
from atom.models.common.formats import dequant_fp8, fp8_act_sim

__all__ = [
    "fp8_linear",
    "fp8_linear_torch",
    "fp8_linear_usable",
    "check_fp8_operands",
    "fp8_act_round",
]


def check_fp8_operands(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> None:
    """Raise ValueError naming the bad shape when (x, weight, scale, block) do not fit."""
    n, k = weight.shape
    bo, bk = block
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 weight must be float8_e4m3fn, got {weight.dtype}")
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the weight {list(weight.shape)}")
    if k % bk:
        raise ValueError(f"in_features {k} is not a multiple of the FP8 block {bk}")
    want = (-(-n // bo), k // bk)
    if tuple(scale.shape) != want:
        raise ValueError(
            f"FP8 weight {list(weight.shape)} in {list(block)} blocks needs scales "
            f"{list(want)}, got {list(scale.shape)}"
        )


def fp8_linear_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] -> [..., N] in ``out_dtype`` (x's dtype by default):
    F.linear(fp8_act_sim(x, bk) in float32, dequant_fp8(weight, scale, block))."""
    xs = fp8_act_sim(x.float(), block[1])
    return invariant.linear(xs, dequant_fp8(weight, scale, block)).to(out_dtype or x.dtype)


def fp8_linear_usable(x: torch.Tensor) -> bool:
    """The kernel runs on CUDA (``use_triton``; name ``fp8_gemm``) for float inputs without
    gradients."""
    if torch.is_grad_enabled() and x.requires_grad:
        return False
    return x.dtype in (torch.bfloat16, torch.float16, torch.float32) and use_triton(x, "fp8_gemm")


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``fp8_linear_torch`` in one kernel where ``fp8_linear_usable(x)``, else the torch
    expression. Same contract."""
    if not fp8_linear_usable(x) or x.numel() == 0:
        return fp8_linear_torch(x, weight, scale, block, out_dtype)
    from atom.kernels._fp8_gemm_triton import fp8_linear_triton

    lead = x.shape[:-1]
    out = fp8_linear_triton(x.reshape(-1, x.shape[-1]), weight, scale, block, out_dtype)
    return out.view(*lead, weight.shape[0])


def fp8_act_round(x: torch.Tensor, block: int) -> torch.Tensor:
    """``fp8_act_sim(x, block)``: x [..., K] rounded to E4M3 per ``block`` values along K, in
    x's dtype, as an FP8 or FP4 product takes its input; one kernel where
    ``fp8_linear_usable(x)`` (the same bits), else the torch expression."""
    if not fp8_linear_usable(x) or x.numel() == 0:
        return fp8_act_sim(x, block)
    from atom.kernels._fp8_gemm_triton import fp8_act_sim_triton

    return fp8_act_sim_triton(x.reshape(-1, x.shape[-1]), block).view(x.shape)
