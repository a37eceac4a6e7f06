"""CPU time of this process's threads, by name: what the tier's threads and the client
library's take from the cores (and, in CPython, from the interpreter lock the step thread also
needs) while the engine serves.

Python threads are read through their own CPU clocks (``time.pthread_getcpuclockid``,
nanoseconds) and named by ``threading``; threads Python does not know (torch's intra-op pool,
zmq's I/O threads) are read from ``/proc/self/task/<tid>/schedstat`` and named by the kernel
(``comm``). Threads of one name are summed. A thread that ended is no longer counted, so a
difference of two readings is exact only for threads that lived through both (the tier's
transfer, lookup and heartbeat threads, the client's polling loop do; its probe threads may
not). Where neither source exists (not Linux) the reading is empty.
"""

from __future__ import annotations

import os
import threading
import time

_TASKS = "/proc/self/task"


def thread_cpu_seconds() -> dict[str, float]:
    """{thread name: CPU seconds (user + system) it has used}, for every live thread."""
    out: dict[str, float] = {}
    seen: set[int] = set()
    for t in threading.enumerate():
        if t.ident is None:
            continue
        try:
            clock = time.pthread_getcpuclockid(t.ident)
            seconds = time.clock_gettime(clock)
        except (AttributeError, OSError, OverflowError):  # ended meanwhile, or no such clock
            continue
        out[t.name] = out.get(t.name, 0.0) + seconds
        if t.native_id is not None:
            seen.add(t.native_id)
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return out
    for tid in tids:
        if not tid.isdigit() or int(tid) in seen:
            continue
        try:
            with open(f"{_TASKS}/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"{_TASKS}/{tid}/comm") as f:
                name = f.read().strip()
        except (OSError, ValueError, IndexError):  # ended meanwhile
            continue
        out[name] = out.get(name, 0.0) + ns / 1e9
    return out


def cpu_used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds each thread name used between two readings (names in ``after``; a name that
    lost threads in between may read less than it used: never negative here)."""
    return {k: max(0.0, v - before.get(k, 0.0)) for k, v in after.items()}
