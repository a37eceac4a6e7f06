"""Tensor parallelism: a model split across ranks, one process per rank (torch.distributed:
NCCL on GPUs, gloo on CPU).

``parallel_state.ParallelState`` is one rank's view of the group (rank, world size, process
groups; ``all_reduce`` is a no-op at world size 1). ``split_models`` builds one rank's split
model of either family from what its layers declare (``atom.models.common.tensor_parallel``;
what is split, what is replicated, which all-reduces a forward makes: its module doc).
``ranks`` and ``broadcast_runtime`` run an engine over the ranks with them.

On every rank ``r`` of ``N``::

    state = ParallelState.init(r, N, init_method=addr, device=dev)
    model = build_v41_tp(config, state, dtype=..., device=dev, checkpoint=path)  # or seed=
    runtime = V41Runtime(model, block_size=...)  # its own pool and slots, same geometry
    # every rank runs the same forwards (same tokens and spans, same order); rank 0 decides
    # them and sends them (state.broadcast_object); the logits are the same on every rank
"""

from atom.distributed.parallel_state import ParallelState, local_init_method
from atom.distributed.split_models import (
    TensorParallelError,
    build_tp_model,
    build_v41_tp,
    check_divides,
    shard_for_ranks,
)

__all__ = [
    "ParallelState",
    "local_init_method",
    "TensorParallelError",
    "build_tp_model",
    "build_v41_tp",
    "check_divides",
    "shard_for_ranks",
]
