"""Triton kernels for the GPU path, each with the torch expression it replaces.

A kernel runs only where it can: a CUDA tensor and an importable Triton (``use_triton``);
everywhere else the torch expression runs. ``ATOM_TRITON=0`` turns every kernel off (A/B runs,
and a way out if a kernel misbehaves on some GPU); ``ATOM_TRITON_OFF=name[,name]`` turns off the
named ones: engram, sink_attention (prefill), decode_attention, index_scores, moe_combine.
Kernels are checked against their torch expressions by tests/kernels (on CUDA, and on CPU under
Triton's interpreter when Triton is installed).
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Triton's interpreter (``TRITON_INTERPRET=1``) runs kernels on CPU tensors (tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor, name: str | None = None) -> bool:
    """Whether kernel ``name`` runs for a tensor like ``t``: off everywhere with
    ``ATOM_TRITON=0``, off by name with ``ATOM_TRITON_OFF=name[,name...]`` (side-by-side
    benchmarks of one kernel)."""
    if os.environ.get("ATOM_TRITON", "1") == "0" or not triton_importable():
        return False
    off = {n.strip() for n in os.environ.get("ATOM_TRITON_OFF", "").split(",")}
    if name is not None and name in off:
        return False
    return t.is_cuda or interpreting()
