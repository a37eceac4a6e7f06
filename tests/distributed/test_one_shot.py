"""The one-shot all-reduce's choice and refusals on CPU (its kernel runs on CUDA only:
tests/gpu/test_one_shot_cuda.py, two GPUs): the config refuses it on CPU ranks with the fix,
``ParallelState`` refuses an unknown kind, and ``all_reduce`` hands a tensor to the one-shot
path when it takes it and to the group when it declines."""

from __future__ import annotations

import pytest
import torch

from atom.config import EngineConfig
from atom.distributed import parallel_state
from atom.distributed.one_shot import OneShotAllReduce, OneShotUnavailable
from atom.distributed.parallel_state import ParallelState


def test_the_config_refuses_one_shot_on_cpu_ranks_naming_the_fix():
    with pytest.raises(
        ValueError, match="tp_all_reduce=one_shot with device=cpu.*use tp_all_reduce=group"
    ):
        EngineConfig(
            model="v41-tiny", device="cpu", tensor_parallel_size=2, tp_all_reduce="one_shot"
        )
    with pytest.raises(ValueError, match="tp_all_reduce"):
        EngineConfig(model="v41-tiny", tp_all_reduce="ring")
    # one rank reduces nothing; a CUDA or auto device is left to the ranks' start
    assert (
        EngineConfig(model="v41-tiny", device="cpu", tp_all_reduce="one_shot").tp_all_reduce
        == "one_shot"
    )
    assert EngineConfig(
        model="v41-tiny", device="cuda", tensor_parallel_size=2, tp_all_reduce="one_shot"
    )


def test_parallel_state_refuses_an_unknown_all_reduce_before_joining_anything():
    with pytest.raises(ValueError, match="all_reduce='ring'"):
        ParallelState.init(0, 2, init_method="tcp://127.0.0.1:1", all_reduce="ring")


def test_the_one_shot_all_reduce_refuses_a_cpu_device():
    with pytest.raises(OneShotUnavailable, match="needs CUDA ranks.*tp_all_reduce=group"):
        OneShotAllReduce(object(), "cpu")


class _OneShot:
    """Takes what ``take`` says; records what it was given."""

    def __init__(self, take: bool):
        self.take, self.seen = take, []

    def reduce(self, x):
        self.seen.append(x)
        return x * 2 if self.take else None


def test_all_reduce_uses_the_one_shot_result_and_falls_back_to_the_group(monkeypatch):
    group_calls = []
    monkeypatch.setattr(
        parallel_state.dist, "all_reduce", lambda x, op, group: group_calls.append(x) or x.add_(1)
    )
    x = torch.arange(4.0)
    taken = ParallelState(rank=0, world_size=2, one_shot=_OneShot(take=True))
    assert torch.equal(taken.all_reduce(x), torch.arange(4.0) * 2)
    assert group_calls == []
    declined = ParallelState(rank=0, world_size=2, one_shot=_OneShot(take=False))
    assert torch.equal(declined.all_reduce(x), torch.arange(4.0) + 1)
    assert len(group_calls) == 1 and len(declined.one_shot.seen) == 1
    # one rank: neither
    assert ParallelState.single().all_reduce(x) is x
