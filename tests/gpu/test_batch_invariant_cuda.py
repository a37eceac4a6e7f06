"""The batch-invariant mode on CUDA in bfloat16, both families: a request alone and inside
batches of other requests (other lengths, positions and chunk budgets) computes the same
logprobs, tokens and PAGE/image bytes, bit for bit (tests/engine/test_batch_invariant.py is
the CPU twin)."""

from __future__ import annotations

import pytest
import torch

from tests.engine import test_batch_invariant as cpu

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA_KW = {**cpu.KW, "device": "cuda", "dtype": "bfloat16", "kv_dtype": "bf16"}
CUDA_KW.pop("index_dtype")


@pytest.mark.parametrize("preset", ["v41-tiny", "v4-tiny"])
def test_a_request_computes_the_same_bits_alone_and_in_any_batch_on_cuda(preset, monkeypatch):
    monkeypatch.setattr(cpu, "KW", CUDA_KW)
    cpu.test_a_request_computes_the_same_bits_alone_and_in_any_batch(preset)
