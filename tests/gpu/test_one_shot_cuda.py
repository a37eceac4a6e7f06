"""The one-shot all-reduce on two GPUs (``atom.distributed.one_shot``): the sum every rank
gets is the same bits on both ranks and equals the two inputs added (float addition of two
values does not depend on their order, so NCCL's sum too), eagerly and replayed from a CUDA
graph with new inputs; tensors it declines (too big, not whole 16-byte vectors) go through
NCCL. And TP=2 greedy decoding with it equals one rank's in fp32, as with NCCL. Those need
two CUDA devices; on one, two processes share it (torch allows ranks on one device with
TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1) for the kernel's bits and graphs alone (what it
declines would go to NCCL, which refuses two ranks on one device)."""

from __future__ import annotations

import pytest
import torch

from atom import LLM, SamplingParams
from tests.distributed.spawn import run_ranks
from tests.engine.workloads import prefix_tree_prompts
from tests.gpu.test_decode_graphs_cuda import assert_same_greedy

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
one_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _inputs(rank: int, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + len(shape))
    return torch.randn(shape, generator=g).to(dtype).cuda()


def _reduce_on_rank(rank, world, init_method, shared_device):
    import os

    from atom.distributed.parallel_state import ParallelState

    if shared_device:
        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    device = "cuda:0" if shared_device else f"cuda:{rank}"
    state = ParallelState.init(
        rank, world, init_method=init_method, device=device, all_reduce="one_shot"
    )
    one = state.one_shot
    out = {}
    cases = {
        "decode_fp32": ((16, 4096), torch.float32),
        "bf16": ((3, 8), torch.bfloat16),
    }
    if not shared_device:
        cases["ragged"] = ((5,), torch.float32)  # 20 bytes: declined
        cases["big"] = ((3 << 20,), torch.float32)  # 12 MiB: declined
    for name, (shape, dtype) in cases.items():
        before = one.calls
        mine = [_inputs(r, shape, dtype) for r in range(world)]
        got = state.all_reduce(mine[rank].clone())
        out[name] = (got.cpu(), (mine[0] + mine[1]).cpu(), one.calls - before)
    # captured once, replayed with new inputs
    static = torch.zeros(16, 4096, device=device)
    state.all_reduce(static)  # warm outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        reduced = state.all_reduce(static)
    replays = []
    for step in range(3):
        mine = [_inputs(r + 7 * step, (16, 4096), torch.float32) for r in range(world)]
        static.copy_(mine[rank])
        graph.replay()
        torch.cuda.synchronize()
        replays.append((reduced.cpu().clone(), (mine[0] + mine[1]).cpu()))
    out["replays"] = replays
    state.destroy()
    return out


def _check(outcomes, cases):
    for o in outcomes:
        assert o.error is None and not o.timed_out, o.error
    r0, r1 = (o.result for o in outcomes)
    for name, one_shot_calls in cases:
        got0, want, calls0 = r0[name]
        got1, _, calls1 = r1[name]
        assert (calls0, calls1) == (one_shot_calls, one_shot_calls), name
        assert torch.equal(got0, got1), name
        assert torch.equal(got0, want), name
    for (got0, want), (got1, _) in zip(r0["replays"], r1["replays"]):
        assert torch.equal(got0, got1) and torch.equal(got0, want)


@two_gpus
def test_one_shot_sums_are_the_same_bits_on_both_ranks_eager_and_in_graphs():
    outcomes = run_ranks(_reduce_on_rank, 2, False, timeout_s=180)
    _check(outcomes, (("decode_fp32", 1), ("bf16", 1), ("ragged", 0), ("big", 0)))


@one_gpu
def test_one_shot_kernel_on_two_processes_of_one_gpu():
    outcomes = run_ranks(_reduce_on_rank, 2, True, timeout_s=180)
    _check(outcomes, (("decode_fp32", 1), ("bf16", 1)))


KW = dict(block_size=16, num_blocks=128, max_num_seqs=8, max_num_batched_tokens=128, device="cuda")


@two_gpus
def test_tp2_greedy_with_the_one_shot_all_reduce_matches_one_rank_in_fp32():
    dtype, eps = dict(dtype="float32", kv_dtype="fp32", index_dtype="fp32"), 1e-3
    prompts = prefix_tree_prompts(16, 16, seed=31)
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2)
    one = LLM("v41-tiny", **KW, **dtype).generate(prompts, params)
    llm = LLM("v41-tiny", tensor_parallel_size=2, tp_all_reduce="one_shot", **KW, **dtype)
    two = llm.generate(prompts, params, on_step=lambda e: e.check_integrity())
    llm.shutdown()
    assert_same_greedy(two, one, eps, most=2)
