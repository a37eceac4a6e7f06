"""The MoE's grouped GEMMs are the engine config's (``moe_grouped_mm``, applied by
``build_engine`` as the Triton switches are); ``ATOM_GROUPED_MM`` overrides it for debugging.

Which path runs is asked of a meta tensor (shape tracing takes the grouped path wherever torch
has ``_grouped_mm``), so this runs on CPU; tests/gpu/test_moe_cuda.py runs both paths on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from atom.config import EngineConfig, EngineConfigError
from atom.models.common import moe
from atom.models.common.moe import configure_grouped_mm, grouped_mm_enabled

needs_grouped_mm = pytest.mark.skipif(
    not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm"
)


@pytest.fixture
def configured(monkeypatch):
    monkeypatch.delenv("ATOM_GROUPED_MM", raising=False)
    monkeypatch.setitem(moe._GROUPED_MM, "failed", None)
    yield configure_grouped_mm
    configure_grouped_mm()  # the default again, for the tests that follow


def _usable() -> bool:
    with torch.no_grad():
        return moe._grouped_mm_usable(torch.empty(4, 8, dtype=torch.bfloat16, device="meta"))


@needs_grouped_mm
def test_the_config_turns_the_grouped_path_off_and_the_environment_overrides_it(
    configured, monkeypatch
):
    assert grouped_mm_enabled() and _usable()
    configured(False)
    assert not grouped_mm_enabled() and not _usable()
    monkeypatch.setenv("ATOM_GROUPED_MM", "1")  # the debugging override wins
    assert grouped_mm_enabled() and _usable()
    configured(True)
    monkeypatch.setenv("ATOM_GROUPED_MM", "0")
    assert not grouped_mm_enabled() and not _usable()


def test_engine_config_reads_the_switch_and_names_a_bad_value():
    assert EngineConfig().moe_grouped_mm is True
    assert EngineConfig(moe_grouped_mm="false").moe_grouped_mm is False
    for bad in ("maybe", 2):
        with pytest.raises(EngineConfigError, match=rf"moe_grouped_mm={bad!r}: use true or false"):
            EngineConfig.build(moe_grouped_mm=bad)


def test_build_engine_applies_the_config(configured):
    from atom.builder import build_engine

    engine = build_engine(
        EngineConfig(model="v41-tiny", device="cpu", num_blocks=32, moe_grouped_mm=False)
    )
    try:
        assert not grouped_mm_enabled()
    finally:
        engine.shutdown()
    engine = build_engine(EngineConfig(model="v41-tiny", device="cpu", num_blocks=32))
    try:
        assert grouped_mm_enabled()
    finally:
        engine.shutdown()
