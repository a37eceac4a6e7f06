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
