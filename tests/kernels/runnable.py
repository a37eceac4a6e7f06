"""Where the kernel tests can run a kernel: Triton imports, and a CUDA device (or Triton's
interpreter, ``TRITON_INTERPRET=1``, set before Triton is first imported). CI has neither."""

import importlib.util
import os

import pytest
import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
RUNNABLE = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_kernel = pytest.mark.skipif(
    not (HAVE_TRITON and RUNNABLE), reason="needs Triton and CUDA (or TRITON_INTERPRET=1)"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# tests that drive a model through the CPU paged harness (tests/model/harness.py): they reach a
# kernel only under Triton's interpreter; on CUDA, tests/gpu runs the same paths on the device
cpu_harness_only = pytest.mark.skipif(
    DEVICE != "cpu", reason="the paged harness runs on CPU: Triton's interpreter only"
)


def refuse_fallback(monkeypatch, module, name: str, kernel: str, opt_in: bool = False) -> None:
    """Make ``module.name`` (a kernel's torch expression, as its wrapper calls it) raise, so a
    test of the kernel cannot pass through the fallback; the test module's own import of the
    expression stays callable. ``opt_in``: also turn the kernel on (``ATOM_TRITON_ON``)."""
    if opt_in:
        monkeypatch.setenv("ATOM_TRITON_ON", kernel)

    def refuse(*args, **kwargs):
        raise AssertionError(f"{kernel} fell back to the torch expression")

    monkeypatch.setattr(module, name, refuse)
