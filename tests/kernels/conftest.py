"""Fixtures of the kernel tests."""

import pytest


@pytest.fixture
def kernels_on(monkeypatch):
    """As where the kernels run (Triton imports; its interpreter takes CPU tensors), without
    running one: everywhere, CI included."""
    import atom.kernels

    monkeypatch.setattr(atom.kernels, "triton_importable", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("ATOM_TRITON_OFF", raising=False)
    monkeypatch.delenv("ATOM_TRITON_ON", raising=False)
    monkeypatch.delenv("ATOM_TRITON", raising=False)
