"""Float32 forms of low-precision weights, computed once and kept while the weights stand.

Some products are taken in float32 from weights stored in the compute dtype, as the published
code does (the pooling compressors' projections, the router's logits, Engram's gate weight).
Written as ``weight.float()`` at the call, each forward casts the weight again: on the GPU one
kernel per weight and layer that reads the bf16 weight and writes its float32 copy, in every
decode step. ``promoted`` computes the float32 tensor once and returns it until one of the
tensors it was computed from changes; the bits are those of the expression it caches.

What counts as a change: another storage (a load that replaces ``.data``, ``.to()``), another
device, dtype or shape, or an in-place write (the tensor's version counter, which ``copy_`` and
every in-place op bump). Nothing is kept where keeping would be wrong or traced:
  * for a source made under ``torch.inference_mode`` (it has no version counter);
  * under autograd with a source that requires grad (training needs the graph to the weight);
  * while torch.compile traces (the compiled glue computes it in its graph);
  * while a CUDA graph is being captured and nothing is kept yet: a tensor computed during a
    capture holds nothing until the graph first replays, so it is computed for the capture and
    not kept (the forwards that run before capture keep it).
The memory cost is the float32 copy of each such weight (for v41-bench about 84 MB, the four
pooling compressors' two projections).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

_ATTR = "_promoted"


def _stamp(sources: tuple[torch.Tensor, ...]) -> tuple | None:
    """What identifies the sources' current values; None where one has no version counter
    (a tensor made under ``torch.inference_mode``: its in-place writes cannot be seen)."""
    try:
        return tuple((s.data_ptr(), s._version, s.device, s.dtype, tuple(s.shape)) for s in sources)
    except RuntimeError:
        return None


def _capturing(sources: tuple[torch.Tensor, ...]) -> bool:
    return any(s.is_cuda for s in sources) and torch.cuda.is_current_stream_capturing()


def promoted(
    owner: nn.Module, key: str, compute: Callable[[], torch.Tensor], *sources: torch.Tensor
) -> torch.Tensor:
    """``compute()`` (a float32 function of ``sources``), kept on ``owner`` under ``key`` and
    returned again while every source is unchanged (module doc)."""
    if torch.compiler.is_compiling():
        return compute()
    if torch.is_grad_enabled() and any(s.requires_grad for s in sources):
        return compute()
    stamp = _stamp(sources)
    if stamp is None:
        return compute()
    kept = owner.__dict__.setdefault(_ATTR, {})
    got = kept.get(key)
    if got is not None and got[0] == stamp:
        return got[1]
    value = compute()
    if not _capturing(sources):
        kept[key] = (stamp, value)
    return value


def float_weight(linear: nn.Module) -> torch.Tensor:
    """``linear.weight.float()``, kept (``promoted``)."""
    w = linear.weight
    return promoted(linear, "float", lambda: w.float(), w)


def float_stacked(owner: nn.Module, key: str, *linears: nn.Module) -> torch.Tensor:
    """The linears' weights stacked along the output dim, as float32 (one GEMM for projections
    of the same input: its output's column blocks are theirs), kept on ``owner`` under
    ``key`` (``promoted``)."""
    ws = tuple(m.weight for m in linears)
    return promoted(owner, key, lambda: torch.cat(ws).float(), *ws)
