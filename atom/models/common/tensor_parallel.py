"""Tensor parallelism as the layers declare it: which parameters the ranks split, along which
dimension, and what a layer changes once it holds one rank's slice.

A layer that takes part (an attention with a grouped output projection, the MoE) defines

* ``tp_splits() -> {parameter name, relative to the layer: dimension}``: rank r of N holds the
  r-th of N equal contiguous slices of each along that dimension;
* ``tp_narrow(world, reduce)``: its counts become one rank's (heads, output groups), and its
  output, a partial sum over its slice, is summed over the ranks by ``reduce`` (float32).

A model defines ``tp_layers() -> {prefix: layer}``, the layers that split (its main decoder
layers' attention and MoE; draft layers stay whole). ``split_plan`` turns that into full
parameter names (as the model's ``state_dict`` and, for both families, its checkpoint loader
name them); ``shard_model`` narrows a whole model in place. Everything else stays whole and is
computed identically on every rank, so the paged state and every discrete choice (top-k,
routing) are the same on every rank; ``atom.distributed`` holds the ranks and collectives.
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
    "split_plan",
    "shard_model",
    "rank_slices",
    "SPLIT_FIELDS",
]

#: the config fields a world size must divide: the attention heads, the output projection's
#: groups and every expert's intermediate dimension
SPLIT_FIELDS = ("num_attention_heads", "o_groups", "moe_intermediate_size")


class TensorParallelError(ConfigError):
    """A world size the model cannot be split over, or a model that is already split."""


class SplitLayer(Protocol):
    """A layer the ranks split (module doc)."""

    def tp_splits(self) -> dict[str, int]: ...

    def tp_narrow(self, world: int, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None: ...


def check_divides(config, world_size: int) -> None:
    """Refuse a world size that does not divide what the ranks split, naming each value."""
    if world_size < 1:
        raise TensorParallelError(f"tensor_parallel_size={world_size} must be >= 1")
    bad = [f"{f}={getattr(config, f)}" for f in SPLIT_FIELDS if getattr(config, f) % world_size]
    if bad:
        raise TensorParallelError(
            f"tensor_parallel_size={world_size} must divide num_attention_heads, o_groups and "
            f"moe_intermediate_size (the ranks split the attention heads, the output "
            f"projection's groups and every expert's intermediate dimension); it does not "
            f"divide {', '.join(bad)}"
        )


def split_plan(model: nn.Module) -> dict[str, int]:
    """Full parameter name -> the dimension split across the ranks, for every parameter a
    layer of ``model.tp_layers()`` declares."""
    plan = {}
    for prefix, layer in _layers(model).items():
        for name, dim in layer.tp_splits().items():
            plan[f"{prefix}.{name}"] = dim
    return plan


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
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    p = getattr(module, attr)
    n = p.shape[dim] // world
    part = p.detach().narrow(dim, rank * n, n).clone()  # own storage: the whole one is freed
    setattr(module, attr, nn.Parameter(part, requires_grad=p.requires_grad))


@torch.no_grad()
def shard_model(
    model: nn.Module, rank: int, world: int, reduce: Callable[[torch.Tensor], torch.Tensor]
) -> nn.Module:
    """Split a whole model in place for ``rank`` of ``world`` (recorded as ``model.tp_shard``)
    and return it: each planned
    parameter narrowed to the rank's slice (a model on ``meta`` keeps only the slices' shapes,
    for a loader that reads just them), each split layer narrowed (``tp_narrow``). At world
    size 1 the model is returned untouched; a model already split is refused."""
    check_divides(model.config, world)
    if getattr(model, "tp_shard", None) is not None:
        raise TensorParallelError("the model is already split for tensor parallelism")
    model.tp_shard = (rank, world)  # what ``rank_slices`` and a second split read
    if world == 1:
        return model
    for name, dim in split_plan(model).items():
        _narrow(model, name, dim, rank, world)
    for layer in _layers(model).values():
        layer.tp_narrow(world, reduce)
    return model
