"""Linear layers kept in the FP8 format a checkpoint ships (``weight_dtype: fp8``).

``Fp8Linear`` holds an E4M3 weight [out, in] with one float32 power-of-two scale per (bo, bi)
block and computes ``atom.kernels.fp8_gemm.fp8_linear``: its input is quantized to E4M3 per
block of bi values (UE8M0 scales) and multiplied by the FP8 weight, as DeepSeek's FP8 GEMMs do.
On CPU that is the torch expression (the numerical reference); on CUDA one Triton kernel.

A family says which of its linears are FP8 in its published checkpoint (its ``Layout`` rows of
format ``fp8``, less those whose weight the forward reads directly, such as V4's grouped
``wo_a``, which DeepSeek's own converter dequantizes to bf16); ``quantize_linears`` turns those
``nn.Linear`` modules into ``Fp8Linear`` and ``dequantize_linears`` turns them back, so the
stored-precision forward and its dequantized twin run the very same weights.

Inputs already rounded through the same E4M3 blocks (V4.1's ``act_fp8_sim`` at the call sites)
are quantized again to the same values: the rounding is idempotent, so nothing rounds twice.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from atom.kernels.fp8_gemm import check_fp8_operands, fp8_linear
from atom.models.common.formats import dequant_fp8, fp8_scale_shape, fp8_weight_quant
from atom.models.common.layers import Linear

__all__ = [
    "Fp8Linear",
    "fp8_block",
    "fp8_module_names",
    "quantize_linears",
    "dequantize_linears",
    "stored_fp8",
]


class Fp8Linear(nn.Module):
    """A bias-free linear with an FP8 block-scaled weight.

    Buffers: ``weight`` ``float8_e4m3fn`` [out, in] and ``weight_scale`` float32
    [ceil(out/bo), in/bi] (powers of two). ``dtype`` is the compute dtype of the layers around
    it (the dtype outputs come back in is the input's). Call sites must not read ``weight`` as
    numbers: ``dequantized()`` gives them. ``in_features`` and ``out_features`` are the
    weight's (a tensor-parallel rank's slice, once split).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        block: tuple[int, int],
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if in_features % block[1]:
            raise ValueError(
                f"an FP8 linear needs in_features divisible by the block's {block[1]} "
                f"columns (activations are quantized per {block[1]}); got {in_features}"
            )
        self.block, self.dtype = (int(block[0]), int(block[1])), dtype
        self.register_buffer(
            "weight",
            torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device),
        )
        shape = fp8_scale_shape((out_features, in_features), self.block)
        self.register_buffer("weight_scale", torch.ones(shape, dtype=torch.float32, device=device))

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def tp_companions(self, name: str) -> tuple[str, ...]:
        """What splits with ``name`` across tensor-parallel ranks, along the same dimension
        (``atom.models.common.tensor_parallel``): the weight's block scales."""
        return ("weight_scale",) if name == "weight" else ()

    def tp_granule(self, dim: int) -> tuple[int, str]:
        """(what a rank's slice along ``dim`` must be a multiple of, why): the weight block's
        side along it, so each rank holds whole blocks and their scales (and, along K, rounds
        its input per the same blocks)."""
        bo, bi = self.block
        return self.block[dim], f"E4M3 in {bo} x {bi} blocks, one scale per block"

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, block: tuple[int, int]) -> Fp8Linear:
        """``linear``'s weight quantized (``fp8_weight_quant``) into a new module on its device."""
        if linear.bias is not None:
            raise ValueError("an FP8 linear has no bias; this one has")
        w = linear.weight
        out = cls(w.shape[1], w.shape[0], block, w.dtype, device=w.device)
        q, s = fp8_weight_quant(w.detach(), out.block)
        out.weight.copy_(q)
        out.weight_scale.copy_(s)
        return out

    def dequantized(self) -> torch.Tensor:
        """The weight as float32 [out, in]: e4m3 * scale."""
        return dequant_fp8(self.weight, self.weight_scale, self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_fp8_operands(x, self.weight, self.weight_scale, self.block)
        return fp8_linear(x, self.weight, self.weight_scale, self.block)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, block={list(self.block)}"


def fp8_module_names(
    model: nn.Module, rows: Iterable[tuple[str, str, str]], exclude: Iterable[str] = ()
) -> list[str]:
    """The ``nn.Linear`` modules of ``model`` a published layout stores as FP8
    (``stored_module_names``)."""
    return stored_module_names(model, rows, "fp8", exclude)


def stored_module_names(
    model: nn.Module,
    rows: Iterable[tuple[str, str, str]],
    stored: str,
    exclude: Iterable[str] = (),
) -> list[str]:
    """The ``nn.Linear`` modules of ``model`` a published layout stores in format ``stored``.

    ``rows``: (published name, parameter name, format) with ``{L}``/``{M}``/``{E}``
    placeholders; a row of format ``stored`` whose parameter is ``X.weight`` names module ``X``.
    ``exclude``: module-name suffixes kept dense (weights the forward reads directly).
    """
    pats = []
    for _, param, fmt in rows:
        if fmt != stored or not param.endswith(".weight"):
            continue
        path = re.escape(param.removesuffix(".weight"))
        for key in ("L", "M", "E"):
            path = path.replace(re.escape("{" + key + "}"), r"\d+")
        pats.append(re.compile(path + "$"))
    skip = tuple(exclude)
    return [
        name
        for name, module in model.named_modules()
        if type(module) in (nn.Linear, Linear)
        and any(p.match(name) for p in pats)
        and not (skip and name.endswith(skip))
    ]


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` at dotted ``name`` in ``model``."""
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


@torch.no_grad()
def quantize_linears(
    model: nn.Module, names: Iterable[str], block: tuple[int, int], *, empty: bool = False
) -> int:
    """Replace each named ``nn.Linear`` by its ``Fp8Linear`` (weights quantized in (bo, bi)
    blocks; with ``empty``, left for a loader to fill); returns how many were replaced. Refuses
    (ValueError, before changing anything) a module whose in_features the block's columns do
    not divide."""
    mods = {name: model.get_submodule(name) for name in names}
    bad = [f"{n} ({m.in_features})" for n, m in mods.items() if m.in_features % block[1]]
    if bad:
        raise ValueError(
            f"FP8 weights in {list(block)} blocks need in_features divisible by {block[1]}; "
            f"not so for {', '.join(bad[:5])}. Use weight_dtype bf16, or a checkpoint whose "
            "quantization_config.weight_block_size divides them"
        )
    for name, module in mods.items():
        w = module.weight
        new = (
            Fp8Linear(w.shape[1], w.shape[0], block, w.dtype, device=w.device)
            if empty
            else Fp8Linear.from_linear(module, block)
        )
        replace_module(model, name, new)
    return len(mods)


@torch.no_grad()
def dequantize_linears(model: nn.Module, kinds: tuple[type, ...] = (Fp8Linear,)) -> int:
    """Replace every module of ``kinds`` (``Fp8Linear``; any with ``dequantized()``,
    ``in_features``, ``out_features`` and ``dtype``) by a ``Linear`` of its compute dtype holding
    the dequantized weight (exact: E4M3 or E2M1 times a power of two fits bf16 and float32)."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, kinds)]
    for name, module in found:
        dense = Linear(
            module.in_features,
            module.out_features,
            bias=False,
            dtype=module.dtype,
            device=module.weight.device,
        )
        dense.weight.copy_(module.dequantized())
        replace_module(model, name, dense)
    return len(found)


def stored_fp8(config) -> bool:
    """Whether a model config says its checkpoint stores FP8 weights
    (``quantization_config.quant_method == "fp8"``, as DeepSeek's published configs do)."""
    quant = getattr(config, "quantization_config", None) or {}
    return str(quant.get("quant_method", "")).lower() == "fp8"


def fp8_block(config, default: tuple[int, int]) -> tuple[int, int]:
    """The FP8 weight block the config states (``quantization_config.weight_block_size``), or
    the family's ``default``; ValueError for a malformed one."""
    quant = getattr(config, "quantization_config", None) or {}
    block = quant.get("weight_block_size") or default
    if len(block) != 2 or any(int(b) <= 0 for b in block):
        raise ValueError(
            f"quantization_config.weight_block_size is {block}; expected two positive integers "
            "[rows, columns]"
        )
    return int(block[0]), int(block[1])
