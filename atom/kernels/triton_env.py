"""Whether Triton can run here: it imports, and (for CPU tensors in tests) its interpreter is
on. A leaf module, so every kernel module may ask without importing ``atom.kernels``."""

from __future__ import annotations

import functools
import os


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
