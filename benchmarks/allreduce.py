"""The forward's all-reduce alone, at decode sizes: the group's (NCCL) against the one-shot
kernel over symmetric memory (``atom.distributed.one_shot``), per call, side by side.

    python -m benchmarks.allreduce --tp 2                  # two GPUs
    python -m benchmarks.allreduce --tp 2 --device cpu     # gloo only (the harness)

Each rank sums a float32 [rows, hidden] tensor (rows: a decode step's batch). On CUDA the
calls run as the engine runs them, inside a captured CUDA graph of ``--calls`` all-reduces,
replayed ``--repeats`` times; the time per call is the replay's over ``--calls`` (median over
repeats, rank 0's clock). Both kinds run in the same processes, alternating per size.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from benchmarks.common import md_table, write_results
from tests.distributed.spawn import run_ranks


def _time_calls(state, x, calls: int, repeats: int, cuda: bool) -> list[float]:
    """Seconds per all-reduce of ``x``: ``calls`` of them in one graph (CUDA) or a loop."""
    if not cuda:
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                state.all_reduce(x)
            out.append((time.perf_counter() - t0) / calls)
        return out
    state.all_reduce(x)  # warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            state.all_reduce(x)
    graph.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3 / calls)
    return out


def _on_rank(rank, world, init_method, args):
    from atom.distributed.parallel_state import ParallelState

    cuda = args.device == "cuda"
    device = f"cuda:{rank}" if cuda else "cpu"
    kind = "one_shot" if cuda else "group"
    state = ParallelState.init(rank, world, init_method=init_method, device=device, all_reduce=kind)
    one_shot, rows = state.one_shot, []
    for n in args.rows:
        x = torch.randn(n, args.hidden, device=device)
        per_kind = {}
        for k in ("group", "one_shot") if cuda else ("group",):
            state.one_shot = one_shot if k == "one_shot" else None
            per_kind[k] = _time_calls(state, x, args.calls, args.repeats, cuda)
        rows.append((n, per_kind))
    state.one_shot = one_shot
    calls = one_shot.calls if one_shot is not None else 0
    state.destroy()
    return rows, calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 256])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    outcomes = run_ranks(_on_rank, args.tp, args, timeout_s=600)
    bad = [o for o in outcomes if o.error or o.timed_out]
    if bad:
        for o in bad:
            print(f"rank {o.rank}: {'timed out' if o.timed_out else o.error}", file=sys.stderr)
        return 1
    rows, one_shot_calls = outcomes[0].result
    table_rows = []
    for n, per_kind in rows:
        us = {k: 1e6 * statistics.median(v) for k, v in per_kind.items()}
        spread = {k: 1e6 * (max(v) - min(v)) for k, v in per_kind.items()}
        table_rows.append(
            [
                n,
                f"{n * args.hidden * 4 / 1024:.0f}",
                f"{us['group']:.1f} (±{spread['group'] / 2:.1f})",
                (
                    f"{us['one_shot']:.1f} (±{spread['one_shot'] / 2:.1f})"
                    if "one_shot" in us
                    else "-"
                ),
                f"{us['group'] / us['one_shot']:.2f}x" if "one_shot" in us else "-",
            ]
        )
    table = md_table(
        ["rows", "KiB", "group us/call", "one-shot us/call", "group / one-shot"], table_rows
    )
    table += (
        f"\n\n{args.tp} ranks, float32 [rows, {args.hidden}], {args.calls} all-reduces per "
        f"{'captured graph' if args.device == 'cuda' else 'loop'}, median over {args.repeats} "
        f"repeats (± half the range), rank 0's clock; one-shot calls made: {one_shot_calls}."
    )
    print(table)
    data = {"rows": [{"rows": n, "seconds": v} for n, v in rows], "args": vars(args)}
    name = args.name or f"allreduce_tp{args.tp}_{args.device}"
    cmd = "python -m benchmarks.allreduce " + " ".join(sys.argv[1:] if argv is None else argv)
    print(write_results(name, data, table, cmd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
