"""The process's switch for the routed experts' grouped GEMMs (``torch._grouped_mm``): the
engine config's ``moe_grouped_mm``, the debugging override ``ATOM_GROUPED_MM``, the device's
capability, and whether a grouped call has failed (the per-expert loop runs from then on).
``atom.models.common.moe`` reads it to choose a path, and re-exports its names."""

from __future__ import annotations

import os

import torch

# ``configured``: the engine config's ``moe_grouped_mm`` (``configure_grouped_mm``, when an
# engine is built); ``failed``: why a grouped call failed (the loop runs from then on)
_GROUPED_MM: dict[object, object] = {"configured": True, "failed": None}


def configure_grouped_mm(enabled: bool = True) -> None:
    """Whether the routed experts may run as grouped GEMMs in this process
    (``EngineConfig.moe_grouped_mm``; applied by ``build_engine`` and on every rank, as the
    Triton switches are). The setting is the process's (one engine per process)."""
    _GROUPED_MM["configured"] = bool(enabled)


def grouped_mm_enabled() -> bool:
    """The config's ``moe_grouped_mm``, unless the debugging override ``ATOM_GROUPED_MM``
    (``0`` off, anything else on) is set: it wins, read at each call (side-by-side runs
    without a config change)."""
    flag = os.environ.get("ATOM_GROUPED_MM")
    return bool(_GROUPED_MM["configured"]) if flag is None else flag != "0"


def _grouped_mm_usable(x: torch.Tensor) -> bool:
    """The routed experts run as grouped GEMMs (no host sync) on CUDA bf16 where torch has
    ``_grouped_mm`` (sm90+) and the config allows it (``grouped_mm_enabled``:
    ``EngineConfig.moe_grouped_mm``, ``--moe-grouped-mm false`` turns it off); a failed call
    turns it off for the process (``_GROUPED_MM["failed"]`` says why). Elsewhere the
    per-expert loop runs, with its one host sync per layer (the expert counts)."""
    if x.device.type not in ("cuda", "meta") or x.dtype != torch.bfloat16:
        return False
    if torch.is_grad_enabled():
        return False
    if _GROUPED_MM["failed"] or not grouped_mm_enabled():
        return False
    if x.device.type == "meta":  # shape tracing (tests/model/test_host_syncs.py)
        return hasattr(torch, "_grouped_mm")
    key = ("cap", x.device.index)
    if key not in _GROUPED_MM:
        _GROUPED_MM[key] = hasattr(torch, "_grouped_mm") and (
            torch.cuda.get_device_capability(x.device) >= (9, 0)
        )
    return bool(_GROUPED_MM[key])
