"""``run_ranks`` returns what each rank returned, tensors included, after the rank has exited
(torch's queue passes a tensor's storage by a file descriptor the sender must serve: a rank
that exits at once left the parent reading a closed socket, as the one-shot test on the GPU
did at ade40a7)."""

from __future__ import annotations

import torch

from tests.distributed.spawn import run_ranks


def _tensor_of_rank(rank, world, init_method, n):
    return {"rank": rank, "values": torch.arange(n, dtype=torch.float32) * (rank + 1)}


def test_ranks_return_tensors_that_outlive_the_rank():
    outcomes = run_ranks(_tensor_of_rank, 2, 1 << 16, timeout_s=120)
    for o in outcomes:
        assert o.error is None and not o.timed_out and o.exitcode == 0, o.error
        want = torch.arange(1 << 16, dtype=torch.float32) * (o.rank + 1)
        assert o.result["rank"] == o.rank and torch.equal(o.result["values"], want)
