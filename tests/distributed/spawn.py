"""Run a function on N ranks, one spawned process each, with a deadline (no hung CI).

``run_ranks(fn, world, *args, timeout_s)`` starts ``fn(rank, world, init_method, *args)`` in
``world`` processes (a fresh ``tcp://127.0.0.1:<free port>`` each call) and returns each rank's
``Outcome``: its return value, or the traceback it raised, and its exit code. A rank still
running at the deadline is killed and reported (``timed_out``); nothing outlives the call.
"""

from __future__ import annotations

import os
import pickle
import queue
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch.multiprocessing as mp

from atom.distributed import local_init_method


@dataclass
class Outcome:
    rank: int
    result: Any = None
    error: str | None = None  # the traceback the rank raised
    exitcode: int | None = None
    timed_out: bool = False
    reported: bool = False  # the rank returned or raised (did not die first)


def _child(fn, rank, world, init_method, args, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    try:
        # pickled here, by value: torch's queue would pass a tensor's storage by a file
        # descriptor that this process must outlive the parent's read to serve (it does not)
        results.put((rank, True, pickle.dumps(fn(rank, world, init_method, *args))))
    except BaseException:  # noqa: B036 - reported to the parent, whatever it was
        results.put((rank, False, traceback.format_exc()))
    results.close()
    results.join_thread()
    # no interpreter teardown: destroying a process group whose peer died can block
    os._exit(0)


def run_ranks(fn, world: int, *args, timeout_s: float = 60.0) -> list[Outcome]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = local_init_method()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world, init_method, args, results), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out = [Outcome(r) for r in range(world)]
    deadline = time.monotonic() + timeout_s
    try:
        while not all(o.reported for o in out):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(left, 0.5))
            except queue.Empty:
                # a rank that died without reporting: stop once the others are done
                if all(o.reported or procs[o.rank].exitcode is not None for o in out):
                    break
                continue
            o = out[rank]
            o.reported = True
            o.result, o.error = (pickle.loads(value), None) if ok else (None, value)
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for o, p in zip(out, procs):
            if p.is_alive():
                o.timed_out = True
                p.kill()
                p.join(timeout=10)
            o.exitcode = p.exitcode
    return out


def results_of(outcomes: list[Outcome]) -> list[Any]:
    """Every rank's return value; fails naming each rank that raised, died or hung."""
    bad = []
    for o in outcomes:
        if o.timed_out:
            bad.append(f"rank {o.rank} did not finish in time (killed)")
        elif o.error is not None:
            bad.append(f"rank {o.rank} raised:\n{o.error}")
        elif not o.reported:
            bad.append(f"rank {o.rank} exited with code {o.exitcode} without a result")
    if bad:
        raise AssertionError("\n".join(bad))
    return [o.result for o in outcomes]
