"""Triton kernels for the GPU path, each with the torch expression it replaces.

A kernel runs only where it can: a CUDA tensor and an importable Triton (``use_triton``);
everywhere else the torch expression runs. Which kernels may run is the engine config's
(``EngineConfig.triton_kernels``, ``triton_off``, ``triton_on``; flags ``--triton-kernels``,
``--triton-off``, ``--triton-on``), applied by ``configure`` when an engine is built:
``triton_kernels=False`` turns every kernel off (A/B runs, and a way out if a kernel misbehaves
on some GPU); ``triton_off`` names kernels to turn off: sink_attention (prefill),
index_scores, decode_attention, moe_combine, fp8_gemm and fp4_gemm (FP8 weights and FP4
experts then run through the torch expression, which dequantizes them at every call). Also
on by default and turned off the same way: rope (RoPE in place, one launch where the torch
expression takes about ten), hc_mix (an mHC mixer's epilogue, one launch where it took eleven)
and route (the MoE router after its projection), page_write (a decode step's compressed rows
into the PAGE pool, one launch where the torch expression takes about twelve) and swiglu (the
experts' clamped SwiGLU product between their projections, one launch for eight or nine),
block_round (V4's simulated FP8/FP4 rounding of its window KV, compressed rows and index
queries, one launch where the torch expression takes about fifteen) and compressor_pool (a V4
decode step's compressor update: partial row, pooling, overlap fields; one launch for about
seventeen). ``OPT_IN`` kernels (none at present) run only when named in ``triton_on``: a new
kernel stays there until the GPU gate has run it. The settings are the process's (one engine
per process).

Debugging overrides, read at each call and winning over the config when set:
``ATOM_TRITON=0|1``, ``ATOM_TRITON_OFF=name[,name]``, ``ATOM_TRITON_ON=name[,name]`` (tests
and one-off side-by-side runs without a config change).
Kernels are checked against their torch expressions by tests/kernels (on CUDA, and on CPU under
Triton's interpreter when Triton is installed).
"""

from __future__ import annotations

import os

import torch

from atom.kernels.triton_env import interpreting, triton_importable  # noqa: F401

# kernels that run only when named in triton_on (ATOM_TRITON_ON); none at present.
# block_round (the torch expression's bits, on CUDA too) and compressor_pool (the same state
# bytes, pooled values to float32 rounding) were opt-in until the GPU gate ran with them on (an
# H100 at 352d6d6: tests/gpu 67 passed, V4's tier two-passes and graphs included; their kernel
# tests on CUDA) and they cut v4-bench's batch-16 decode step from 10.1 to 8.2-8.6 ms and 1,639
# to 939 kernels (roofline_v4_h100_352d6d6_*). page_write
# (a decode step's compressed rows into PAGE, one launch for about twelve; moves bytes, so the
# same bytes by construction) and swiglu (the experts' clamped SwiGLU product, one launch for
# eight or nine; torch's bits on CUDA by construction) were opt-in until the GPU gate passed with
# them on (an H100 at 93bc75c: 84 GPU tests, the tier two-passes included) and they cut
# v41-bench's batch-16 decode step from 8.84-9.38 to 8.27-8.72 ms (gpu_gate.md). rope,
# hc_mix and route (one launch where the torch expressions take ten or more) were opt-in until
# the GPU gate passed with them on (an H100 at bd8cbf3: 125 GPU tests, tier two-passes
# included; their kernel tests assert torch's bits on CUDA) and they cut v41-bench's decode
# step by 12-15% (benchmarks/results/gpu_gate.md, roofline_h100_{plain,fused}_r*.md).
# decode_attention and moe_combine were opt-in until 3f8538e, because a bf16 tier two-pass test
# that compared tokens within a near-tie bound parted with them on. That test's partings were
# later traced to pass 1 itself (its batches follow the lookups' timing, and bf16 rounds other
# batches differently), not to the kernels; the GPU tier tests now assert the loaded bytes
# instead, and the GPU gate passes with both kernels on (benchmarks/results/gpu_gate.md)
OPT_IN: frozenset[str] = frozenset()


KERNELS = frozenset(
    {
        "sink_attention",
        "index_scores",
        "decode_attention",
        "moe_combine",
        "fp8_gemm",
        "fp4_gemm",
        "rope",
        "hc_mix",
        "route",
        "page_write",
        "swiglu",
        "block_round",
        "compressor_pool",
    }
)

# the engine config's choice (``configure``); the environment overrides it (module doc)
_CONFIGURED = {"enabled": True, "off": frozenset(), "on": frozenset()}


def configure(enabled: bool = True, off=(), on=()) -> None:
    """Which kernels may run in this process (``EngineConfig.triton_kernels``, ``triton_off``,
    ``triton_on``); unknown names raise ``ValueError``."""
    off, on = frozenset(off), frozenset(on)
    unknown = (off | on) - KERNELS
    if unknown:
        raise ValueError(f"unknown Triton kernels {sorted(unknown)}; known: {sorted(KERNELS)}")
    _CONFIGURED.update(enabled=bool(enabled), off=off, on=on)


def _names(var: str, configured: frozenset[str]) -> set[str] | frozenset[str]:
    raw = os.environ.get(var)
    if raw is None:
        return configured
    return {n.strip() for n in raw.split(",")}


def use_triton(t: torch.Tensor, name: str | None = None, row_local: bool = False) -> bool:
    """Whether kernel ``name`` runs for a tensor like ``t``: off everywhere when the config
    (or ``ATOM_TRITON=0``) turns kernels off, off by name in ``triton_off`` (side-by-side
    benchmarks of one kernel); an ``OPT_IN`` kernel only when named in ``triton_on``. In the
    batch-invariant mode (``atom.kernels.invariant``) only ``row_local`` kernels run: each
    row computed by one program whose launch configuration the row's length alone sets (RMSNorm,
    mHC's combination and mixing, sinkhorn, the one-pass sink attention, the index scores), so
    a row's bits do not depend on the batch."""
    from atom.kernels import invariant_mode

    if invariant_mode.enabled() and not row_local:
        return False
    if row_local and torch.compiler.is_compiling():
        # inside compiled glue (atom/models/common/glue_compile.py) the row-local kernels give
        # way to their torch expression, which inductor fuses with its neighbours (traced as
        # user kernels they failed to compile on the H200: RMSNorm's eps reached tl.sqrt_rn as
        # float64, benchmarks/results/compile_probe_h200.md)
        return False
    enabled = os.environ.get("ATOM_TRITON")
    if not (_CONFIGURED["enabled"] if enabled is None else enabled != "0"):
        return False
    if not triton_importable():
        return False
    if name is not None and name in _names("ATOM_TRITON_OFF", _CONFIGURED["off"]):
        return False
    if name in OPT_IN and name not in _names("ATOM_TRITON_ON", _CONFIGURED["on"]):
        return False
    return t.is_cuda or interpreting()
