"""Where a forward's GEMM time goes, call by call: every weight GEMM of a decode batch and of a
prefill chunk batch timed with CUDA events around the call, grouped by weight shape, with the
weight bytes each streams and the bandwidth that makes.

The profiler's component ranges (benchmarks/profile_components.py) cannot say this: a Triton
kernel carries no range, and the batch-invariant mode's GEMM is one kernel name for every
shape. Here the calls themselves are wrapped: in the default mode ``torch.nn.functional.linear``
(dense) and ``torch._grouped_mm`` (routed experts); in the batch-invariant mode
(``--batch-invariant``) ``invariant_linear`` and ``invariant_grouped_linear``. Run it once per
mode and compare the tables. The forward runs eagerly (an event pair per call; the kernels'
own times, not the gaps between them).

    python -m benchmarks.gemm_calls --model v41-bench --device cuda --dtype bfloat16 \
        --position 2048 --batch 16 [--batch-invariant]
"""

from __future__ import annotations

import functools
from collections import defaultdict

import torch
import torch.nn.functional as F

from benchmarks.common import command_line, md_table, write_results
from benchmarks.profile_forward import _shape_runs, profiled_runtime, shape_parser


class CallTimes:
    """Event pairs around wrapped calls, keyed by (kind, weight shape); read after a sync."""

    def __init__(self) -> None:
        self.records: list = []

    def wrap(self, fn, kind: str, shape_of, groups_of=None):
        @functools.wraps(fn)
        def timed(*a, **k):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*a, **k)
            end.record()
            rows = a[0].numel() // a[0].shape[-1]
            used = groups_of(*a, **k) if groups_of is not None else None
            self.records.append((kind, shape_of(*a, **k), rows, used, start, end))
            return out

        return timed

    def table(self) -> tuple[list, dict]:
        """Rows per (kind, shape): calls, rows a call, ms, weight GB, GB/s; and the totals."""
        per = defaultdict(lambda: [0, set(), 0.0, 0.0])
        for kind, shape, rows, used, start, end in self.records:
            ms = start.elapsed_time(end)
            groups = int((used > 0).sum()) if used is not None else 1
            n, k = shape[-2], shape[-1]
            entry = per[kind, shape]
            entry[0] += 1
            entry[1].add(rows)
            entry[2] += ms
            entry[3] += groups * n * k * 2 / 1e9
        rows, total_ms, total_gb = [], 0.0, 0.0
        for (kind, shape), (calls, m, ms, gb) in sorted(per.items(), key=lambda e: -e[1][2]):
            total_ms, total_gb = total_ms + ms, total_gb + gb
            shape_s = " x ".join(map(str, shape))
            m = f"{min(m)}-{max(m)}" if len(m) > 1 else min(m)
            rows.append(
                [kind, shape_s, calls, m, round(ms, 3), round(1e3 * ms / calls, 1), round(gb, 3)]
                + [round(gb / ms * 1e3, 1) if ms else ""]
            )
        return rows, {"ms": round(total_ms, 3), "gb": round(total_gb, 3)}


def _group_sizes(offs_or_ends: torch.Tensor) -> torch.Tensor:
    """Rows per group from cumulative ends."""
    ends = offs_or_ends.to(torch.int64)
    return ends - torch.cat([ends.new_zeros(1), ends[:-1]])


def instrument(times: CallTimes, invariant_mode: bool):
    """Wrap the GEMM entry points of the mode; returns a function that undoes it."""
    undo = []

    def weight(*a, **_):
        return tuple(a[1].shape)

    def groups(*a, **k):
        return _group_sizes(k["ends"] if "ends" in k else a[2])

    if invariant_mode:
        from atom.kernels import _invariant_gemm_triton as gemm

        pairs = [
            (gemm, "invariant_linear", "dense", weight, None),
            (gemm, "invariant_grouped_linear", "grouped", weight, groups),
        ]
    else:

        def experts(*a, **_):  # mat_b [G, K, N]: the weight as [G, N, K]
            return tuple(a[1].transpose(1, 2).shape)

        def offs(*a, **k):
            return _group_sizes(k["offs"] if "offs" in k else a[2])

        pairs = [
            (F, "linear", "dense", weight, None),
            (torch, "_grouped_mm", "grouped", experts, offs),
        ]
    for owner, attr, kind, shape_of, groups_of in pairs:
        raw = getattr(owner, attr)
        setattr(owner, attr, times.wrap(raw, kind, shape_of, groups_of))
        undo.append((owner, attr, raw))

    def restore():
        for owner, attr, raw in reversed(undo):
            setattr(owner, attr, raw)

    return restore


def main() -> None:
    ap = shape_parser(__doc__, prefill_tokens=4096, top=0)
    args = ap.parse_args()
    if not args.device.startswith("cuda"):
        ap.error("--device cuda: the calls are timed with CUDA events")
    rt, tables, _, sync, _ = profiled_runtime(args)
    sections, data = [], {}
    head = ["kind", "weight", "calls", "rows of a call", "ms", "us a call", "weight GB", "GB/s"]
    for name, run, _ in _shape_runs(rt, args, tables, torch.Generator().manual_seed(0)):
        run()  # warm: compiles
        sync()
        times = CallTimes()
        restore = instrument(times, args.batch_invariant)
        try:
            run()
            sync()
        finally:
            restore()
        rows, total = times.table()
        data[name] = {"rows": rows, "total": total}
        sections.append(
            f"## {name}\n\nGEMM calls: {total['ms']} ms for {total['gb']} GB of weights "
            f"({round(total['gb'] / total['ms'] * 1e3, 1) if total['ms'] else 0} GB/s).\n\n"
            + md_table(head, rows)
        )
        print(sections[-1], flush=True)
    mode = "batch-invariant" if args.batch_invariant else "default"
    table = f"Mode: {mode}. Weight GB: a grouped call counts the groups it has rows for.\n\n"
    write_results(
        args.name or f"gemm_calls_{mode}",
        data,
        table + "\n\n".join(sections),
        command_line("gemm_calls", args),
    )


if __name__ == "__main__":
    main()
