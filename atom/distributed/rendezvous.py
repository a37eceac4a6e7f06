"""A tensor-parallel group's start, bounded: rank 0 sees each rank join, or fails in seconds
saying why.

torch's own rendezvous (``init_process_group`` with a ``tcp://`` address) waits its whole
timeout for a rank that will never come (601 s by default) and then says only "1/2 clients
joined". Here rank 0 opens the store itself, on a port the kernel picks while it binds (no
port can be taken between choosing and binding it), before any rank is spawned; each rank
connects and marks itself joined; rank 0 polls the marks and its ranks' processes together:

  a rank process exited      -> at once: its exit code and the likely cause; exit code
                                ``REIMPORT_EXIT`` means the rank re-imported the entry script
                                and found an engine started at import (the missing
                                ``if __name__ == "__main__":`` guard; ``refuse_reimport``)
  ``timeout_s`` passed       -> which ranks are missing, and the setting that bounds the wait
  the port cannot be opened  -> the host and the OS's error

The group's process groups are then built on that store (``ParallelState.init(store=...)``),
their first collective (the connection of every pair) bounded by the same ``timeout_s``.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import sys
import time
from datetime import timedelta

import torch.distributed as dist

#: a spawned rank that re-imported the entry script and found an engine started at import
REIMPORT_EXIT = 87
DEFAULT_START_TIMEOUT_S = 30.0
_JOINED = "atom/joined/{}"


class TensorParallelStartError(RuntimeError):
    """The group did not form: a rank exited, did not join in time, or no port could open."""


GUARD_FIX = (
    'put the engine\'s start under `if __name__ == "__main__":` (tensor-parallel ranks are '
    "spawned processes, and each imports the entry script again)"
)


def refuse_reimport() -> None:
    """Where an engine starts its ranks: in a spawned process still importing its parent's
    entry script (the script starts an engine at import), exit with ``REIMPORT_EXIT`` and one
    line saying so, instead of multiprocessing's error about bootstrapping."""
    if getattr(mp.current_process(), "_inheriting", False):
        script = getattr(sys.modules.get("__main__"), "__file__", None) or "the entry script"
        print(
            f"atom: a tensor-parallel rank imported {script}, which starts an engine at "
            f"import; {GUARD_FIX}",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(REIMPORT_EXIT)


class Rendezvous:
    """Rank 0's side: the store every rank joins through, open before any rank starts."""

    def __init__(self, world_size: int, timeout_s: float, host: str = "127.0.0.1"):
        self.world_size, self.timeout_s, self.host = world_size, timeout_s, host
        try:
            # torch's store server listens on every interface unless handed a socket: bind
            # one on ``host`` (loopback by default) and give the store its fd
            listener = socket.socket(
                socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM
            )
            try:
                listener.bind((host, 0))
                listener.listen(max(16, world_size))
                self.store = dist.TCPStore(
                    host,
                    listener.getsockname()[1],
                    world_size,
                    is_master=True,
                    wait_for_workers=False,
                    timeout=timedelta(seconds=timeout_s),
                    master_listen_fd=listener.fileno(),
                )
            except BaseException:
                listener.close()
                raise
            listener.detach()  # the store's server owns the fd now
        except (RuntimeError, OSError) as exc:
            raise TensorParallelStartError(
                f"tensor_parallel_size={world_size}: could not open the ranks' rendezvous "
                f"port on {host} ({exc}); check that {host} is a local address and that "
                "ports can be bound"
            ) from None
        self.port = self.store.port
        self.store.set(_JOINED.format(0), "1")

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def wait_joined(self, procs, clock=time.monotonic, poll_s: float = 0.02) -> None:
        """Return once every rank joined; raise ``TensorParallelStartError`` as soon as a
        rank's process (``procs[r - 1]`` is rank r's) exited, or at the deadline."""
        deadline = clock() + self.timeout_s
        keys = [_JOINED.format(r) for r in range(self.world_size)]
        while not self.store.check(keys):
            for rank, p in enumerate(procs, start=1):
                if p.exitcode is not None:
                    raise TensorParallelStartError(exit_cause(rank, p, self.world_size))
            if clock() >= deadline:
                missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
                raise TensorParallelStartError(
                    f"tensor_parallel_size={self.world_size}: rank(s) {missing} did not join "
                    f"within {self.timeout_s:g} s (tensor_parallel_start_timeout_s); a rank "
                    f"may be stuck importing or building, or port {self.port} on "
                    f"{self.host} may be blocked; raise tensor_parallel_start_timeout_s if "
                    "starting a rank takes longer here"
                )
            time.sleep(poll_s)  # a poll round: the store has no wait that watches processes


def exit_cause(rank: int, proc, world_size: int) -> str:
    """The one line that says why rank ``rank``'s process exited before joining."""
    code = proc.exitcode
    head = f"tensor_parallel_size={world_size}: rank {rank} (pid {proc.pid}) exited with code "
    if code == REIMPORT_EXIT:
        script = getattr(sys.modules.get("__main__"), "__file__", None) or "the entry script"
        return (
            f"{head}{code} before joining: it imported {script}, which starts an engine at "
            f"import; {GUARD_FIX}"
        )
    return (
        f"{head}{code} before joining the group (its error is printed above; a negative code "
        "is the signal that killed it, e.g. -9 out of memory)"
    )


def join(address: tuple[str, int], rank: int, world_size: int, timeout_s: float):
    """A rank's side: connect to rank 0's store and mark this rank joined; the store."""
    host, port = address
    store = dist.TCPStore(
        host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s)
    )
    store.set(_JOINED.format(rank), "1")
    return store
