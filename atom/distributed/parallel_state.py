"""One rank's view of a tensor-parallel group: rank, world size, process groups, collectives.

``ParallelState.single()`` is the world of one rank: every collective is a no-op and no
``torch.distributed`` group exists. ``ParallelState.init`` joins a group of ``world_size``
processes (one per rank, each calling it with its own ``rank`` and the same ``init_method``),
with NCCL on CUDA devices and gloo on CPU.

Two process groups, two timeouts:
  * ``control`` (the default group): rendezvous, barriers and object broadcasts (startup, the
    steps rank 0 sends), with ``init_timeout_s`` (a rank may spend minutes loading weights);
  * ``group`` (a second group of the same ranks): the forward's all-reduces, with
    ``timeout_s``: a collective that does not complete in that time raises on gloo (a peer
    that exited is usually seen at once, as a closed connection); on NCCL the watchdog aborts
    the process after it (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, on by default). Either way a dead
    rank ends the others' forwards with an error, never a hang.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_INIT_TIMEOUT_S = 600.0


class RankFailure(RuntimeError):
    """Another rank is gone (or a collective with it failed): the engine cannot continue."""


@dataclass(frozen=True)
class RankChannels:
    """How rank 0 reaches the other ranks outside the forward's collectives.

    ``send(*op)`` broadcasts one op on the control group, in order with the forwards (raises
    ``RankFailure`` when a rank is gone); ``conns[r - 1]`` is rank r's own outcome pipe (read
    end); ``rank_replicated``: every rank's pool holds the same bytes for the same block.
    """

    world_size: int
    rank_replicated: bool
    send: Callable[..., bool]
    conns: list


def _loopback_transports() -> None:
    """The ranks all run on this machine: unless the user chose interfaces, gloo's and NCCL's
    bootstrap sockets listen on the loopback interface (they otherwise take the address the
    host name resolves to, which may face a network)."""
    names = (
        {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    )
    if "lo" in names:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")


def local_init_method(host: str = "127.0.0.1") -> str:
    """``tcp://host:port`` with a port free right now (for ranks on this machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


@dataclass
class ParallelState:
    """Rank ``rank`` of ``world_size``; ``group`` runs the forward's collectives (None at world
    size 1), ``control`` the rest."""

    rank: int = 0
    world_size: int = 1
    group: Any = None
    control: Any = None
    backend: str | None = None
    timeout_s: float | None = None
    one_shot: Any = None  # OneShotAllReduce, or None: every all-reduce through ``group``
    _owns_dist: bool = field(default=False, repr=False)

    @classmethod
    def single(cls) -> ParallelState:
        return cls()

    @classmethod
    def init(
        cls,
        rank: int,
        world_size: int,
        *,
        init_method: str | None = None,
        store=None,
        device: torch.device | str = "cpu",
        backend: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        init_timeout_s: float = DEFAULT_INIT_TIMEOUT_S,
        control_timeout_s: float | None = None,
        all_reduce: str = "group",
    ) -> ParallelState:
        """Join the group (every rank calls this; returns once all have). ``backend``: nccl
        for a CUDA ``device`` (made this process's current device), gloo otherwise.
        ``control_timeout_s``: how long a control op (a rank waiting for rank 0's next op)
        may wait (default ``init_timeout_s``); an idle rank 0 keeps its ranks within it by
        sending pings (``broadcast_runtime``). ``store``: a joined rendezvous store
        (``rendezvous``) instead of ``init_method``. ``all_reduce``: "group" (every forward
        all-reduce through the group's backend) or "one_shot" (CUDA only: small ones through
        ``OneShotAllReduce``, set up here, a collective of every rank)."""
        if all_reduce not in ("group", "one_shot"):
            raise ValueError(f"all_reduce={all_reduce!r}: use 'group' or 'one_shot'")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} world_size={world_size}: need 0 <= rank < world_size")
        device = torch.device(device)
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(device)
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process")
        if (init_method is None) == (store is None):
            raise ValueError("give ParallelState.init one of init_method and store")
        _loopback_transports()
        dist.init_process_group(
            backend,
            init_method=init_method,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=init_timeout_s),
        )
        group = dist.new_group(
            list(range(world_size)), timeout=timedelta(seconds=timeout_s), backend=backend
        )
        # with NCCL the control ops go on a gloo group of their own: a rank waiting for rank
        # 0's next op then waits on the host, not inside an NCCL kernel that holds its device
        # (the tier's transfers into that device's pool must run meanwhile)
        control = dist.group.WORLD
        control_s = init_timeout_s if control_timeout_s is None else control_timeout_s
        if backend == "nccl" or control_s != init_timeout_s:
            control = dist.new_group(
                list(range(world_size)), timeout=timedelta(seconds=control_s), backend="gloo"
            )
        one_shot = None
        if all_reduce == "one_shot" and world_size > 1:
            from atom.distributed.one_shot import OneShotAllReduce

            one_shot = OneShotAllReduce(group, device)
        return cls(rank, world_size, group, control, backend, timeout_s, one_shot, True)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks, the same tensor on every rank (through the group: in
        place when ``x`` is contiguous; one-shot: a new tensor); ``x`` itself at world size
        1. Callers use the returned tensor."""
        if self.world_size == 1:
            return x
        if self.one_shot is not None:
            out = self.one_shot.reduce(x)
            if out is not None:
                return out
        x = x.contiguous()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dimension in rank order, the same
        tensor on every rank (each passes the same shape and dtype; on the forward's group);
        ``x`` itself at world size 1. Exact: nothing is summed."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        if x.is_cuda:  # NCCL's own all-gather into one buffer (and inside graph captures)
            out = x.new_empty((self.world_size, *x.shape))
            dist.all_gather_into_tensor(out, x, group=self.group)
            return torch.cat(out.unbind(0), dim=-1)
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``x`` on every rank, in place (every rank passes a contiguous tensor
        of the same shape and dtype; on the forward's group); ``x`` itself at world size 1."""
        if self.world_size > 1:
            dist.broadcast(x, src=src, group=self.group)
        return x

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """``obj`` of rank ``src`` on every rank (picklable; on the control group)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.control)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (on the control group)."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.control)

    def destroy(self) -> None:
        """Leave the group (if ``init`` joined it)."""
        if self._owns_dist and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_dist = False
