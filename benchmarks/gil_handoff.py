"""What a short foreign call costs a thread when it lets go of the interpreter lock beside a
busy Python thread: the call's wall time, p50 and p90 over many calls, with no other thread
and beside one that runs Python in bursts (like an event loop or the tier's lookup thread)
with short waits between them.

Calls: libc's ``getpid`` (well under a microsecond) and ``usleep(1)`` (tens of microseconds
with the kernel's timer slack) through ``ctypes.CDLL`` (lets go of the lock) and
``ctypes.PyDLL`` (keeps it); on CUDA also torch's ``Event.record`` (lets go) against the tier's
``StreamEvents.record`` (atom/tier/worker_side/cuda_events.py: keeps it). A thread waiting for
the lock needs some microseconds to wake and take it, so the cost shows once a call lasts
about that long.

    python -m benchmarks.gil_handoff [--device cuda] [--calls 2000]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import select
import threading
import time

from benchmarks.common import command_line, md_table, write_results


def _busy(stop: threading.Event, burst_s: float) -> None:
    """Python work in bursts of ``burst_s``, each followed by a 50 us wait on a pipe."""
    r, _ = os.pipe()
    while not stop.is_set():
        end = time.perf_counter() + burst_s
        x = 0
        while time.perf_counter() < end:
            x += 1
        select.select([r], [], [], 50e-6)


def _time(call, n: int) -> tuple[float, float]:
    took = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        took.append(time.perf_counter() - t0)
    took.sort()
    return 1e6 * took[n // 2], 1e6 * took[9 * n // 10]


def _calls(device: str) -> dict:
    libc = "libc.so.6"
    let_go, keep = ctypes.CDLL(libc), ctypes.PyDLL(libc)
    out = {
        "getpid, CDLL (lets go)": let_go.getpid,
        "getpid, PyDLL (keeps)": keep.getpid,
        "usleep(1), CDLL (lets go)": lambda: let_go.usleep(1),
        "usleep(1), PyDLL (keeps)": lambda: keep.usleep(1),
    }
    if device == "cuda":
        import torch

        from atom.tier.worker_side.cuda_events import StreamEvents

        stream = torch.cuda.Stream()
        tev = torch.cuda.Event(enable_timing=True)
        ev = StreamEvents.of_device("cuda")
        raw = ev.new()
        out["torch Event.record (lets go)"] = lambda: tev.record(stream)
        if ev.raw:
            out["StreamEvents.record (keeps)"] = lambda: ev.record(raw, stream)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--bursts-us", type=float, nargs="+", default=[100.0, 1000.0])
    ap.add_argument("--name", default="")
    args = ap.parse_args()
    calls = _calls(args.device)
    rows, data = [], []
    for burst in [0.0, *args.bursts_us]:
        stop = threading.Event()
        other = None
        if burst:
            other = threading.Thread(target=_busy, args=(stop, burst * 1e-6), daemon=True)
            other.start()
        try:
            for name, call in calls.items():
                call()  # warm
                p50, p90 = _time(call, args.calls)
                where = f"beside bursts of {burst:g} us" if burst else "alone"
                rows.append([name, where, round(p50, 1), round(p90, 1)])
                data.append({"call": name, "busy_burst_us": burst, "p50_us": p50, "p90_us": p90})
                print(rows[-1], flush=True)
        finally:
            stop.set()
            if other is not None:
                other.join()
    table = md_table(["call", "other thread", "p50 us", "p90 us"], rows)
    write_results(
        args.name or f"gil_handoff_{args.device}",
        {"rows": data},
        table,
        command_line("gil_handoff", args),
    )


if __name__ == "__main__":
    main()
