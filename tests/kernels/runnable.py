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
