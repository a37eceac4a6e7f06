"""Whether the forward runs batch-invariant (``EngineConfig.batch_invariant``): the process's
switch, in a leaf module so that the kernels' launch choices can read it without importing the
mode's arithmetic (``atom.kernels.invariant``, which uses those kernels)."""

from __future__ import annotations

STATE = {"on": False}


def configure(enabled: bool = False) -> None:
    """Turn the mode on or off for this process (``EngineConfig.batch_invariant``)."""
    STATE["on"] = bool(enabled)


def enabled() -> bool:
    """Whether the forward runs batch-invariant (``configure``)."""
    return STATE["on"]
