"""Tier two-pass on CUDA in both load modes: engine-driven loads (the engine copies from the
server's shared-memory L1, registered with CUDA, on its own stream) and lmcache_driven loads
(the server copies, ordered by interprocess CUDA events). In both, pass 2 loads pass 1's bytes
exactly; in the batch-invariant mode it also computes pass 1's tokens and logprobs bit for bit,
with another prefill chunk budget (tests/gpu/tier_two_pass.py says what each mode promises)."""

from __future__ import annotations

import pytest
import torch

from atom import SamplingParams
from tests.engine.test_batch_invariant import prompts_of
from tests.offload.test_tier_faults import pump

from .tier_two_pass import assert_same_bits, two_pass

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

KW = dict(
    block_size=256,
    num_blocks=64,
    max_num_seqs=4,
    max_num_batched_tokens=1024,
    device="cuda",
    dtype="bfloat16",
    offload="lmcache_mp",
    lmcache={"l1_size_gb": 2.0},
)


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch_invariant"])
@pytest.mark.parametrize("mode", ["engine_driven", "lmcache_driven"])
def test_tier_two_pass_on_cuda_in_both_load_modes(mode, invariant):
    prompts = prompts_of((700, 1030, 300), seed=1)
    p = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=5)
    kw = {**KW, "batch_invariant": invariant}
    second = {"lmcache": {"load_mode": mode}}
    if invariant:
        second["max_num_batched_tokens"] = 384  # other chunks than pass 1's 1024
    out1, out2, hits, info = two_pass("v41-mini", prompts, p, kw, second)
    assert hits == [512, 1024, 256]
    if invariant:
        assert_same_bits(out2, out1)
    assert info["load_mode"] == mode
    if mode == "engine_driven":
        assert info["copied"] == 3, f"{info['copied']} loads copied by the engine"
        assert info["pinned"] is True, "the L1 mapping was not registered with CUDA"
    else:
        assert info["copied"] == 0
        assert info["events_created"] >= 1  # the server's copies waited on engine events


def test_tier_two_pass_on_cuda_with_two_copy_streams():
    """``lmcache.load_streams: 2``: each engine-driven load's copies alternate between two
    copy streams; pass 2 loads pass 1's bytes exactly and decodes its tokens."""
    prompts = prompts_of((700, 1030, 300), seed=2)
    p = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=5)
    kw = {**KW, "batch_invariant": True}
    second = {
        "lmcache": {"load_mode": "engine_driven", "load_streams": 2},
        "max_num_batched_tokens": 384,
    }
    out1, out2, hits, info = two_pass("v41-mini", prompts, p, kw, second)
    assert hits == [512, 1024, 256]
    assert_same_bits(out2, out1)
    assert info["copied"] == 3, info


def test_tier_two_pass_on_cuda_with_engine_driven_saves():
    """``lmcache.save_mode: engine_driven``: pass 1's engine copies every save into space the
    server reserved in its L1 (a device-to-host copy on its own stream; the copy waiter waits
    on each copy's event and wakes the transfer thread), and commits it; pass 2 loads exactly
    those bytes and, in the mode, computes pass 1's bits."""
    prompts = prompts_of((700, 1030, 300), seed=3)
    p = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=5)
    kw = {**KW, "batch_invariant": True}
    kw["lmcache"] = {**KW["lmcache"], "save_mode": "engine_driven"}
    second = {"lmcache": {"load_mode": "engine_driven"}, "max_num_batched_tokens": 384}

    def saves_ready(llm):
        saves = llm.engine.tier.saves

        def ok() -> bool:  # the probe found the module and the server's segment is mapped
            return saves.mode == "engine_driven" and saves.mappings.current is not None

        pump(llm, ok, "engine-driven saves to be ready")

    out1, out2, hits, info = two_pass("v41-mini", prompts, p, kw, second, ready=saves_ready)
    assert hits == [512, 1024, 256]
    assert_same_bits(out2, out1)
    saves, done = info["first_saves"], info["first_saves_done"]
    assert done > 0 and saves.counts["copied"] == done, (done, saves.counts)
    assert saves.counts["via_server"] == saves.counts["failed"] == 0, saves.counts
    assert saves.waiter.waited >= done and saves.waiter.errors == 0, vars(saves.waiter)
    assert info["copied"] == 3, info


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch_invariant"])
def test_tier_two_pass_on_cuda_with_the_gather_kernel(invariant):
    """``lmcache.load_copy: kernel``: each engine-driven load is one kernel reading the
    registered L1 over the bus; pass 2 loads pass 1's bytes exactly (and, in the mode, computes
    its bits)."""
    prompts = prompts_of((700, 1030, 300), seed=1)
    p = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=5)
    kw = {**KW, "batch_invariant": invariant}
    second = {"lmcache": {"load_mode": "engine_driven", "load_copy": "kernel"}}
    if invariant:
        second["max_num_batched_tokens"] = 384
    out1, out2, hits, info = two_pass("v41-mini", prompts, p, kw, second)
    assert hits == [512, 1024, 256]
    if invariant:
        assert_same_bits(out2, out1)
    assert info["copied"] == 3 and info["gathers"] == 3, info
