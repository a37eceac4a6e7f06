"""One copy of a model's weights for several engines of one benchmark run.

A benchmark that compares arms side by side keeps one engine per arm alive, so that its
repeats interleave. Each engine builds its model from the same seed, so their parameters hold
the same values: on an 80 GB card four copies of v41-bench-draft's do not fit. ``share`` points
a later engine's parameters at an earlier engine's equal tensors and drops its own copies, so
that the arms need one copy of the weights (and one more while an engine is built).

Only parameters are shared (weights are read-only in inference); buffers hold per-engine state
(caches, rings) and stay each engine's own. What a module derives from its parameters and keeps
follows them: a MoE whose experts are all shared also shares the source's stacked expert
tensors (``MoE.share_stacks``). Apart, each engine would restack the parameters the other had
stacked, and free the stack the other's CUDA graphs read (at ac76acb an illegal memory access
in the speculative benchmark's third arm, in the batch-invariant mode).

A parameter is shared only where it is bitwise equal to the source's (a draft layer an adapter
replaced is not): the engines compute exactly what they computed with their own copies. Call
it before the engine's first forward: its CUDA graphs, captured on first use, then read the
shared tensors.
"""

from __future__ import annotations

import torch


def share(source: torch.nn.Module, target: torch.nn.Module) -> int:
    """Point each parameter of ``target`` at ``source``'s parameter of the same name where that
    one is bitwise equal (same shape, dtype, device and values); returns the bytes this frees."""
    have = dict(source.named_parameters(remove_duplicate=False))
    freed = 0
    for name, param in list(target.named_parameters(remove_duplicate=False)):
        src = have.get(name)
        if src is None or src is param or not _same(src, param):
            continue
        owner, leaf = _owner(target, name)
        owner._parameters[leaf] = src
        freed += param.numel() * param.element_size()
    for name, module in target.named_modules():
        if hasattr(module, "share_stacks") and _all_shared(source.get_submodule(name), module):
            module.share_stacks(source.get_submodule(name))
    if freed and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return freed


def _all_shared(source: torch.nn.Module, target: torch.nn.Module) -> bool:
    mine, theirs = list(target.parameters()), list(source.parameters())
    return len(mine) == len(theirs) and all(a is b for a, b in zip(mine, theirs))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and a.device == b.device
        and bool(torch.equal(a.detach(), b.detach()))
    )


def _owner(module: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    *path, leaf = name.split(".")
    for part in path:
        module = getattr(module, part)
    return module, leaf
