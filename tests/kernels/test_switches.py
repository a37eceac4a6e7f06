"""The kernels' switches are the engine config's (``triton_kernels``, ``triton_off``,
``triton_on``, applied by ``build_engine``); the ``ATOM_TRITON*`` variables override them."""

from __future__ import annotations

import pytest
import torch

import atom.kernels
from atom.config import EngineConfig, EngineConfigError
from atom.kernels.attention import sink_attention_usable
from atom.kernels.index_scores import index_scores_usable


@pytest.fixture
def configured(kernels_on):
    yield atom.kernels.configure
    atom.kernels.configure()  # the defaults again, for the tests that follow


def test_the_config_turns_kernels_off_and_opt_in_ones_on(configured, monkeypatch):
    q, qi = torch.zeros(1, 1, 64), torch.zeros(1, 2, 32)
    configured(off=["index_scores"])
    assert sink_attention_usable(q) and not index_scores_usable(qi)
    assert sink_attention_usable(q, "decode_attention")  # no kernel is opt-in at present
    monkeypatch.setattr(atom.kernels, "OPT_IN", frozenset({"decode_attention"}))
    assert not sink_attention_usable(q, "decode_attention")
    configured(on=["decode_attention"])
    assert sink_attention_usable(q, "decode_attention") and index_scores_usable(qi)
    configured(enabled=False, on=["decode_attention"])
    assert not sink_attention_usable(q) and not sink_attention_usable(q, "decode_attention")
    with pytest.raises(ValueError, match="unknown Triton kernels"):
        configured(off=["nope"])


def test_the_environment_overrides_the_config(configured, monkeypatch):
    q = torch.zeros(1, 1, 64)
    configured(enabled=False)
    monkeypatch.setenv("ATOM_TRITON", "1")
    assert sink_attention_usable(q)
    configured(off=["sink_attention"])
    monkeypatch.setenv("ATOM_TRITON_OFF", "")
    assert sink_attention_usable(q)


def test_engine_config_reads_kernel_names_and_refuses_unknown_ones():
    cfg = EngineConfig(triton_off="index_scores, sink_attention", triton_kernels="false")
    assert cfg.triton_off == ["index_scores", "sink_attention"] and cfg.triton_kernels is False
    with pytest.raises(EngineConfigError, match="triton_on"):
        EngineConfig.build(triton_on="fast_attention")


def test_build_engine_applies_the_config(configured):
    from atom.builder import build_engine

    engine = build_engine(
        EngineConfig(model="v41-tiny", device="cpu", num_blocks=32, triton_off=["index_scores"])
    )
    try:
        assert not index_scores_usable(torch.zeros(1, 2, 32))
        assert sink_attention_usable(torch.zeros(1, 1, 64))
    finally:
        engine.shutdown()
