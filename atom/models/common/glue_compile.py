"""Compiled glue inside captured graphs (``EngineConfig.compile_glue``): the small functions
between a layer's weight GEMMs (mHC mixes, query and KV projections with their norms and RoPE,
the compressor's group write, the router) run through ``torch.compile`` (inductor) while a
decode or span graph is warmed up and captured, so each graph replays a few fused kernels
where the eager code launches dozens of element-wise, index and copy kernels.

Contract:

* ``region`` marks such a function (a method or a free function). Outside a capture, and
  whenever the switch is off, it is the function itself: prefill, eager decode and every CPU
  forward without graphs are untouched, bit for bit.
* Inside ``capturing()`` (the graph backends wrap their warm-up runs and the capture in it)
  with the switch on, a region runs its compiled version. It is compiled once per function
  with dynamic shapes (``torch.compile(dynamic=True)``), not per layer: the layers' modules
  are arguments, their parameters graph inputs (torch's ``inline_inbuilt_nn_modules``), so
  every layer of a model shares one compiled version per region (a batch of 1 or a
  different module configuration may add one). The first capture pays the compile: the
  engine warms the graphs up at start when the switch is on (``GlueStats`` counts the
  compiles and their seconds for the log and the benchmarks).
* What a region computes is the function's math with inductor's fusions and roundings: in
  float32 within rounding of the eager code, in bf16 other roundings (as any kernel change).
  The batch-invariant mode refuses the switch (``EngineConfig``): inductor picks reduction
  strategies per shape, so a token's bits could depend on its batch.
* A region that fails to compile raises inside the capture and stays eager for the rest of
  the process (``GlueStats.disabled``); the graph set captures that key once more (without
  the region), and only if that fails too runs the key eagerly (its existing fallback).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

log = logging.getLogger("atom.models")

STATE = {"on": False}
_local = threading.local()  # capturing depth of this thread (the step thread captures)


@dataclass
class GlueStats:
    """What the compiled regions cost and did in this process."""

    compiles: int = 0  # graphs torch compiled for the regions (recompiles included)
    compile_s: float = 0.0  # seconds of the region calls that compiled, compile included
    calls: dict[str, int] = field(default_factory=dict)  # compiled calls by region
    disabled: dict[str, str] = field(default_factory=dict)  # region -> why it runs eagerly


STATS = GlueStats()
_COMPILED: dict[str, list] = {}  # region -> [its compiled function], made on first use


def compile_region(fn: Callable) -> Callable:
    """How a region is compiled (tests replace it to make one fail)."""
    return torch.compile(fn, dynamic=True, fullgraph=False)


def reset() -> None:
    """Forget every compiled region and the stats (tests; the next capture compiles again)."""
    for holder in _COMPILED.values():
        holder.clear()
    STATS.compiles, STATS.compile_s = 0, 0.0
    STATS.calls.clear()
    STATS.disabled.clear()


# compiled versions a region may keep (torch's default, 8, is less than the layer kinds times
# the shapes a model's regions meet: ratios, layer modes, with or without candidates)
RECOMPILE_LIMIT = 64


def configure(enabled: bool = False) -> None:
    """Turn compiled glue on or off for this process (``EngineConfig.compile_glue``)."""
    STATE["on"] = bool(enabled)
    if enabled:
        import torch._dynamo

        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)


def enabled() -> bool:
    return STATE["on"]


@contextlib.contextmanager
def capturing():
    """Regions called by this thread inside the block run compiled (when ``enabled``)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def _active() -> bool:
    return STATE["on"] and getattr(_local, "depth", 0) > 0


def region(fn: Callable) -> Callable:
    """Mark ``fn`` as glue compiled inside graph captures (module doc)."""
    name = f"{fn.__module__}.{fn.__qualname__}"
    compiled = _COMPILED.setdefault(name, [])

    @functools.wraps(fn)
    def call(*args, **kwargs):
        # a region inside a region is traced as part of it (is_compiling)
        if torch.compiler.is_compiling() or not _active() or name in STATS.disabled:
            return fn(*args, **kwargs)
        from torch._dynamo.utils import counters

        if not compiled:
            compiled.append(compile_region(fn))
        graphs, t0 = counters["stats"]["unique_graphs"], time.perf_counter()
        try:
            out = compiled[0](*args, **kwargs)
        except Exception as exc:
            STATS.disabled[name] = f"{type(exc).__name__}: {exc}"[:300]
            log.warning("compiled glue %s failed (%s); it runs eagerly from now on", name, exc)
            raise
        new = counters["stats"]["unique_graphs"] - graphs
        if new:
            took = time.perf_counter() - t0
            STATS.compiles += new
            STATS.compile_s += took
            log.info("compiled glue %s (%d graph(s)) in %.1f s", name, new, took)
        STATS.calls[name] = STATS.calls.get(name, 0) + 1
        return out

    return call
