"""Benchmark results name the card they ran on: a GPU name says ``h200`` (the card the project
measures on), and a run on another card writes that card's tag (benchmarks/common.py)."""

from __future__ import annotations

import json

import pytest

from benchmarks import common


@pytest.mark.parametrize(
    "name,device,want",
    [
        ("roofline_h200", "NVIDIA H100 80GB HBM3", "roofline_h100"),
        ("transfer_h200_load_modes", "NVIDIA H200", "transfer_h200_load_modes"),
        ("serving_h200", "NVIDIA A100-SXM4-80GB", "serving_a100"),
        ("roofline_h200", "cpu", "roofline_h200"),  # no card to name: as given
        ("roofline_h200", "NVIDIA GeForce RTX 4090", "roofline_h200"),  # no tag found: as given
        ("transfer_cpu", "NVIDIA H100 80GB HBM3", "transfer_cpu"),  # no card tag to correct
    ],
)
def test_card_name(name, device, want):
    assert common.card_name(name, device) == want


def test_write_results_files_an_h100_run_under_h100(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    real = common.environment
    monkeypatch.setattr(common, "environment", lambda: {**real(), "device": "NVIDIA H100 PCIe"})
    path = common.write_results("roofline_h200_glue", {"x": 1}, "| a |", "python -m x")
    assert path == tmp_path / "roofline_h100_glue.md"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "roofline_h100_glue.json",
        "roofline_h100_glue.md",
    ]
    assert path.read_text().startswith("# roofline_h100_glue\n")
    assert json.loads((tmp_path / "roofline_h100_glue.json").read_text())["x"] == 1
