"""Routed experts kept in the FP4 format DeepSeek ships them in (``weight_dtype: fp8``, the
stored precision).

``Fp4Linear`` holds two E2M1 codes per byte [out, in/2] and one E8M0 scale byte per 32 inputs
[out, in/32] (``atom.models.common.formats``) and computes ``atom.kernels.fp4_gemm.fp4_linear``:
on CPU the dequantized product (the numerical reference), on CUDA one Triton kernel that
dequantizes in registers. The MoE stacks its experts' codes and scales and runs them as one
grouped call (``MoE._fp4``).

A family says which of its linears are FP4 (``fp4_linears``: the rows of format ``fp4`` in its
published layout, when its config says the experts are FP4); ``quantize_fp4_linears`` turns
those ``nn.Linear`` modules into ``Fp4Linear`` and ``dequantize_fp4_linears`` turns them back,
so the stored-precision forward and its dequantized twin run the very same weights. Quantizing
weights that came from FP4 gives their values back exactly (``fp4_weight_quant``), so a
checkpoint's experts, dequantized by its loader, become their stored values again.

At stored precision an FP4 expert also takes its input as DeepSeek's kernels do,
``fp4_gemm(act_quant(x, block), w)``: rounded to E4M3 per block along K with power-of-two
scales (``act_block``: the checkpoint's FP8 K block). The dequantized twin (``weight_dtype
bf16``) takes it unrounded, as the FP8 linears' twins do.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from atom.kernels.fp4_gemm import fp4_linear
from atom.kernels.fp8_gemm import fp8_act_round
from atom.models.common.formats import FP4_GROUP, dequant_fp4, fp4_weight_quant
from atom.models.common.fp8_linear import (
    dequantize_linears,
    replace_module,
    stored_module_names,
)

__all__ = [
    "Fp4Linear",
    "experts_fp4",
    "fp4_module_names",
    "quantize_fp4_linears",
    "dequantize_fp4_linears",
]


class Fp4Linear(nn.Module):
    """A bias-free linear with a packed FP4 weight. Buffers: ``weight`` uint8 [out, in/2],
    ``weight_scale`` uint8 [out, in/32] (E8M0). ``dtype``: the compute dtype around it (outputs
    come back in the input's). Call sites must not read ``weight`` as numbers:
    ``dequantized()`` gives them. ``in_features`` and ``out_features`` are the weight's (a
    tensor-parallel rank's slice, once split).

    ``act_block``: its input is rounded to E4M3 per that many values along K first
    (``round_input``), as DeepSeek's ``fp4_gemm(act_quant(x, block), w)`` computes (the
    checkpoint's FP8 block: 128 on V4, 32 on V4.1); None leaves it as it is."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        act_block: int | None = None,
    ):
        super().__init__()
        if in_features % FP4_GROUP:
            raise ValueError(
                f"an FP4 linear needs in_features divisible by {FP4_GROUP} (one scale per "
                f"{FP4_GROUP} inputs); got {in_features}"
            )
        if act_block is not None and in_features % act_block:
            raise ValueError(
                f"an FP4 linear rounding its input per {act_block} needs in_features divisible "
                f"by it; got {in_features}"
            )
        self.dtype, self.act_block = dtype, act_block
        self.register_buffer(
            "weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device)
        )
        self.register_buffer(
            "weight_scale",
            torch.full(
                (out_features, in_features // FP4_GROUP), 127, dtype=torch.uint8, device=device
            ),
        )

    @property
    def in_features(self) -> int:
        return self.weight.shape[1] * 2

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def tp_companions(self, name: str) -> tuple[str, ...]:
        """What splits with ``name`` across tensor-parallel ranks, along the same dimension
        (``atom.models.common.tensor_parallel``): the weight's group scales."""
        return ("weight_scale",) if name == "weight" else ()

    def tp_granule(self, dim: int) -> tuple[int, str]:
        """(what a rank's slice along ``dim`` must be a multiple of, why): any rows; along K
        whole scale groups (and whole input-rounding blocks, ``act_block``)."""
        what = f"packed FP4, one E8M0 scale per {FP4_GROUP} inputs"
        if self.act_block is not None:
            what += f", inputs rounded to E4M3 per {self.act_block}"
        if dim == 0:
            return 1, what
        return math.lcm(FP4_GROUP, self.act_block or 1), what

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, act_block: int | None = None) -> Fp4Linear:
        """``linear``'s weight quantized (``fp4_weight_quant``) into a new module on its device."""
        if linear.bias is not None:
            raise ValueError("an FP4 linear has no bias; this one has")
        w = linear.weight
        out = cls(w.shape[1], w.shape[0], w.dtype, device=w.device, act_block=act_block)
        packed, scale = fp4_weight_quant(w.detach())
        out.weight.copy_(packed)
        out.weight_scale.copy_(scale)
        return out

    def dequantized(self) -> torch.Tensor:
        """The weight as float32 [out, in]."""
        return dequant_fp4(self.weight, self.weight_scale, FP4_GROUP)

    def round_input(self, x: torch.Tensor) -> torch.Tensor:
        """x rounded as this linear's product takes it (E4M3 per ``act_block``; row-local)."""
        return x if self.act_block is None else fp8_act_round(x, self.act_block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp4_linear(self.round_input(x), self.weight, self.weight_scale)

    def extra_repr(self) -> str:
        act = "" if self.act_block is None else f", inputs e4m3 per {self.act_block}"
        return f"in={self.in_features}, out={self.out_features}, fp4 (e8m0 per {FP4_GROUP}){act}"


def experts_fp4(config) -> bool:
    """Whether a config says its checkpoint stores the routed experts as FP4: an FP8-stored
    config (``quantization_config.quant_method == "fp8"``) whose ``expert_dtype`` (V4's field,
    or V4.1's ``quantization_config.expert_dtype``) is "fp4"."""
    quant = getattr(config, "quantization_config", None) or {}
    if str(quant.get("quant_method", "")).lower() != "fp8":
        return False
    dtype = quant.get("expert_dtype", getattr(config, "expert_dtype", None))
    return str(dtype).lower() == "fp4"


def fp4_module_names(model: nn.Module, rows: Iterable[tuple[str, str, str]]) -> list[str]:
    """The ``nn.Linear`` modules of ``model`` a published layout stores as FP4 (``rows``:
    (published name, parameter name, format), ``{L}``/``{M}``/``{E}`` placeholders)."""
    return stored_module_names(model, rows, "fp4")


@torch.no_grad()
def quantize_fp4_linears(
    model: nn.Module,
    names: Iterable[str],
    *,
    exact: bool = False,
    act_block: int | None = None,
    empty: bool = False,
) -> int:
    """Replace each named ``nn.Linear`` by its ``Fp4Linear``; returns how many. ``exact``: the
    weights must already be FP4 values (a checkpoint's, dequantized by its loader), and a
    weight that quantizing would change raises ValueError naming it (before any replacement).
    ``act_block``: each rounds its input to E4M3 per that many values (``Fp4Linear``).
    ``empty``: left for a loader to fill (nothing quantized; a model on ``meta`` too)."""
    mods = {name: model.get_submodule(name) for name in names}
    group = FP4_GROUP if act_block is None else max(FP4_GROUP, act_block)
    bad = [f"{n} ({m.in_features})" for n, m in mods.items() if m.in_features % group]
    if bad:
        raise ValueError(
            f"FP4 experts need in_features divisible by {group} (the FP4 group {FP4_GROUP}, "
            f"the input rounding's block {act_block}); not so for {', '.join(bad[:5])}. Use "
            "weight_dtype bf16"
        )
    if empty:
        new = {
            name: Fp4Linear(
                m.weight.shape[1], m.weight.shape[0], m.weight.dtype, m.weight.device, act_block
            )
            for name, m in mods.items()
        }
    else:
        new = {name: Fp4Linear.from_linear(module, act_block) for name, module in mods.items()}
    if exact and not empty:
        changed = [
            n for n, m in new.items() if not torch.equal(m.dequantized(), mods[n].weight.float())
        ]
        if changed:
            raise ValueError(
                f"weights that are not FP4 values cannot be kept as FP4: {changed[:5]}. Use "
                "weight_dtype bf16, or a checkpoint whose experts are stored as FP4"
            )
    for name, module in new.items():
        replace_module(model, name, module)
    return len(new)


def dequantize_fp4_linears(model: nn.Module) -> int:
    """Replace every ``Fp4Linear`` by a ``Linear`` of its compute dtype holding the dequantized
    weight (exact in bf16 and float32)."""
    return dequantize_linears(model, kinds=(Fp4Linear,))
