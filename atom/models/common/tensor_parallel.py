"""Tensor parallelism as the layers declare it: which parameters the ranks split, along which
dimension, and what a layer changes once it holds one rank's slice.

A layer that takes part (an attention with a grouped output projection, the MoE) defines

* ``tp_splits() -> {parameter name, relative to the layer: dimension}``: rank r of N holds the
  r-th of N equal contiguous slices of each along that dimension;
* ``tp_narrow(world, reduce, gather)``: its counts become one rank's (heads, output groups),
  and its output, a partial sum over its slice, is summed over the ranks by ``reduce``
  (float32); a layer whose slice gives part of a result rather than a partial sum (V4.1's
  Engram table, split by columns) joins the ranks' parts with ``gather`` (concatenation along
  the last dimension in rank order: exact).

A model defines ``tp_layers() -> {prefix: layer}``, the layers that split (its main decoder
layers' attention and MoE; draft layers stay whole). ``split_plan`` turns that into full
tensor names (as the model's ``state_dict`` and, for both families, its checkpoint loader
name them); ``shard_model`` narrows a whole model in place. Everything else stays whole and is
computed identically on every rank, so the paged state and every discrete choice (top-k,
routing) are the same on every rank; ``atom.distributed`` holds the ranks and collectives.

Stored precision (``Fp8Linear``, ``Fp4Linear``): a split ``weight`` may be a buffer, and its
module's ``tp_companions()`` names the tensors that split with it along the same dimension
(its ``weight_scale``), so the plan names those too. A module whose other tensors follow a
slice in a way equal slices cannot say (an ``Fp8RowTable``'s scale groups, which a column
split may cut) defines ``tp_narrowed(attr, dim, rank, world)``, called once its tensor is
narrowed. Such a module's ``tp_granule(dim)`` says
how many rows or columns a rank's slice must be a multiple of (an FP8 weight block along that
dimension; an FP4 scale group along K), since a rank then holds whole blocks with their own
scales and rounds its inputs in the blocks the unsplit model does; ``check_split`` refuses a
world size that would cut one, naming the layer, the dimension, the size and what would do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from atom.models.common.config import ConfigError

__all__ = [
    "TensorParallelError",
    "check_divides",
    "check_split",
    "split_plan",
    "shard_model",
    "rank_slices",
    "SPLIT_FIELDS",
]

#: the config fields a world size must divide: the attention heads, the output projection's
#: groups, every expert's intermediate dimension and the vocabulary (embedding and head)
SPLIT_FIELDS = ("num_attention_heads", "o_groups", "moe_intermediate_size", "vocab_size")


class TensorParallelError(ConfigError):
    """A world size the model cannot be split over, or a model that is already split."""


class SplitLayer(Protocol):
    """A layer the ranks split (module doc)."""

    def tp_splits(self) -> dict[str, int]: ...

    def tp_narrow(
        self,
        world: int,
        reduce: Callable[[torch.Tensor], torch.Tensor],
        gather: Callable[[torch.Tensor], torch.Tensor],
    ) -> None: ...


def sum_partials(y: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor] | None):
    """A layer's output ``y`` summed over the ranks' partial outputs (``reduce``: the
    all-reduce, None at one rank), in float32 as the MoE's are (a bf16 sum would round twice
    where one rank's matmul rounds once), back in ``y``'s dtype."""
    return y if reduce is None else reduce(y.float()).to(y.dtype)


def check_divides(config, world_size: int) -> None:
    """Refuse a world size that does not divide what the ranks split, naming each value."""
    if world_size < 1:
        raise TensorParallelError(f"tensor_parallel_size={world_size} must be >= 1")
    fields = SPLIT_FIELDS + (
        ("engram_head_dim",) if getattr(config, "engram_layer_ids", ()) else ()
    )
    bad = [f"{f}={getattr(config, f)}" for f in fields if getattr(config, f) % world_size]
    if bad:
        raise TensorParallelError(
            f"tensor_parallel_size={world_size} must divide num_attention_heads, o_groups, "
            f"moe_intermediate_size, vocab_size and (with Engram layers) engram_head_dim (the "
            f"ranks split the attention heads, the output projection's groups, every expert's "
            f"intermediate dimension, the embedding and head by vocabulary and the Engram "
            f"tables' columns); it does not divide {', '.join(bad)}"
        )


def split_plan(model: nn.Module) -> dict[str, int]:
    """Full tensor name -> the dimension split across the ranks, for every tensor a layer of
    ``model.tp_layers()`` declares (parameters or buffers), and the tensors that split with
    them (an FP8 or FP4 weight's ``weight_scale``: ``tp_companions``)."""
    plan = {}
    for prefix, layer in _layers(model).items():
        for name, dim in layer.tp_splits().items():
            full = f"{prefix}.{name}"
            plan[full] = dim
            owner, _, attr = full.rpartition(".")
            companions = getattr(model.get_submodule(owner), "tp_companions", None)
            for other in companions(attr) if companions is not None else ():
                plan[f"{owner}.{other}"] = dim
    return plan


def _granules(model: nn.Module):
    """(module name, module, dim, size along dim, granule, what it is) for every split weight
    whose module states a granule (``tp_granule``)."""
    for prefix, layer in _layers(model).items():
        for name, dim in layer.tp_splits().items():
            owner, _, attr = f"{prefix}.{name}".rpartition(".")
            module = model.get_submodule(owner)
            granule = getattr(module, "tp_granule", None)
            if attr != "weight" or granule is None:
                continue
            size = module.out_features if dim == 0 else module.in_features
            yield owner, module, dim, size, *granule(dim)


def check_split(model: nn.Module, world_size: int) -> None:
    """Refuse a world size that would cut a stored-precision block across ranks: each rank's
    slice of an FP8 linear must hold whole weight blocks along the split dimension, and of an
    FP4 linear whole scale groups along K (``tp_granule``). The error names the first such
    layer, the dimension, its size, the slice and the world sizes that keep whole blocks."""
    check_divides(model.config, world_size)
    if world_size == 1:
        return
    found = list(_granules(model))
    bad = [g for g in found if g[3] % world_size or (g[3] // world_size) % g[4]]
    if not bad:
        return
    name, module, dim, size, granule, what = bad[0]
    sizes = {(s, g) for _, _, _, s, g, _ in found}
    fits = [
        w
        for w in range(1, size + 1)
        if all(s % w == 0 and (s // w) % g == 0 for s, g in sizes)
        and not any(getattr(model.config, f) % w for f in SPLIT_FIELDS)
    ]
    axis = "rows (out_features" if dim == 0 else "columns (in_features"
    more = f"; {len(bad) - 1} more split tensors are cut likewise" if len(bad) > 1 else ""
    raise TensorParallelError(
        f"tensor_parallel_size={world_size} cannot split {name} ({type(module).__name__}, "
        f"{what}) along dim {dim}: its {axis}={size}) would be {size / world_size:g} per "
        f"rank, not a multiple of {granule}, so a rank would hold part of a block that shares "
        f"one scale{more}. Use a tensor_parallel_size that keeps whole blocks on every rank "
        f"({', '.join(map(str, fits))}), or weight_dtype=bf16 (dequantized weights have no "
        "blocks to keep whole)"
    )


def rank_slices(model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """A loader's ``shards`` for a model split by ``shard_model``: split parameter -> (dim,
    this rank, ranks); none for a model not split, or split over one rank."""
    rank, world = getattr(model, "tp_shard", None) or (0, 1)
    if world == 1:
        return {}
    return {n: (d, rank, world) for n, d in split_plan(model).items()}


def _layers(model: nn.Module) -> dict[str, SplitLayer]:
    return model.tp_layers()


def _narrow(model: nn.Module, name: str, dim: int, rank: int, world: int) -> None:
    """Replace the parameter or buffer ``name`` by the rank's slice along ``dim`` (its own
    storage: the whole one is freed); a parameter stays one, a buffer stays a buffer. A dense
    ``nn.Linear``'s feature counts follow its weight (a stored-precision linear's are read
    from its weight's shape)."""
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    p = getattr(module, attr)
    n = p.shape[dim] // world
    part = p.detach().narrow(dim, rank * n, n).clone()
    if attr in module._buffers:
        module._buffers[attr] = part
    else:
        setattr(module, attr, nn.Parameter(part, requires_grad=p.requires_grad))
    if isinstance(module, nn.Linear) and attr == "weight":
        module.out_features, module.in_features = part.shape
    narrowed = getattr(module, "tp_narrowed", None)
    if narrowed is not None:  # what else the module holds for the slice (its scale groups)
        narrowed(attr, dim, rank, world)


@torch.no_grad()
def shard_model(
    model: nn.Module,
    rank: int,
    world: int,
    reduce: Callable[[torch.Tensor], torch.Tensor],
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> nn.Module:
    """Split a whole model in place for ``rank`` of ``world`` (recorded as ``model.tp_shard``)
    and return it: each planned tensor (parameter or buffer) narrowed to the rank's slice (a
    model on ``meta`` keeps only the slices' shapes, for a loader that reads just them), each
    split layer narrowed (``tp_narrow``). At world size 1 the model is returned untouched; a
    model already split is refused, and so is a world size that would cut a stored-precision
    block (``check_split``), before anything changes."""
    if getattr(model, "tp_shard", None) is not None:
        raise TensorParallelError("the model is already split for tensor parallelism")
    check_split(model, world)
    model.tp_shard = (rank, world)  # what ``rank_slices`` and a second split read
    if world == 1:
        return model
    for name, dim in split_plan(model).items():
        _narrow(model, name, dim, rank, world)
    for layer in _layers(model).values():
        layer.tp_narrow(world, reduce, gather)
    return model
