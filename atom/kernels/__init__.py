"""Triton kernels for the GPU path, each with the torch expression it replaces.

A kernel runs only where it can: a CUDA tensor and an importable Triton (``use_triton``);
everywhere else the torch expression runs. ``ATOM_TRITON=0`` turns every kernel off (A/B runs,
and a way out if a kernel misbehaves on some GPU); ``ATOM_TRITON_OFF=name[,name]`` turns off the
named ones: sink_attention (prefill), index_scores; decode_attention and moe_combine
run only when named in ``ATOM_TRITON_ON`` (``OPT_IN`` says why).
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


# kernels that run only when named in ATOM_TRITON_ON. Each is tested equal to its torch
# expression (decode_attention also to the reference forward, float32), but on the H200 the
# bf16 tier two-pass test (tests/gpu/test_cuda_paths.py: a tier-resumed run against a full one,
# near-ties within 0.25 allowed) parted with both on (a top-2 gap of 0.39) and with moe_combine
# alone (0.41), and passed with both off; decode_attention alone was not run. Cause not found;
# with both off the forward's arithmetic is that of the last commit that passed every GPU test
# (fd5723e)
OPT_IN = frozenset({"decode_attention", "moe_combine"})


def _names(var: str) -> set[str]:
    return {n.strip() for n in os.environ.get(var, "").split(",")}


def use_triton(t: torch.Tensor, name: str | None = None) -> bool:
    """Whether kernel ``name`` runs for a tensor like ``t``: off everywhere with
    ``ATOM_TRITON=0``, off by name with ``ATOM_TRITON_OFF=name[,name...]`` (side-by-side
    benchmarks of one kernel); an ``OPT_IN`` kernel only with ``ATOM_TRITON_ON=name``."""
    if os.environ.get("ATOM_TRITON", "1") == "0" or not triton_importable():
        return False
    if name is not None and name in _names("ATOM_TRITON_OFF"):
        return False
    if name in OPT_IN and name not in _names("ATOM_TRITON_ON"):
        return False
    return t.is_cuda or interpreting()
