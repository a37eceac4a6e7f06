"""Engine tests run tiny forwards: one intra-op thread (spinning OpenMP workers on a shared
2-core host slow every step by an order of magnitude)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def captured_results(monkeypatch):
    """benchmarks.serving's results captured, not written to benchmarks/results: the dict gets
    the name, data, table and command of each ``write_results`` call."""
    from benchmarks import serving

    written = {}

    def write_results(name, data, table, command):
        written.update(name=name, data=data, table=table, command=command)
        return name

    monkeypatch.setattr(serving, "write_results", write_results)
    return written
