"""Kernels a decode step launches, counted on CPU: the GPU-free measure of the decode step's
kernel budget (the ≤400 target), per model component, with the launch-cutting kernels (rope,
hc_mix, route, page_write, swiglu, block_round, compressor_pool) off and on.

TRITON_INTERPRET=1 python -m benchmarks.kernel_count --model v41-mini --batch 4 --position 256 \
    --arms plain default --name kernel_count_cpu

On CPU the forward runs the same torch ops it runs on CUDA; each op that computes (not a view,
not a no-op cast) stands for one CUDA kernel, and each Triton launch (Triton's interpreter runs
them on CPU; Triton must be importable) for one. The prefill that fills the sequences runs
without the interpreter (its kernels are slow there), the measured decode step with it. The
count is a proxy: cuBLAS may add a split-K reduction kernel to a GEMM, and an op CUDA does as two
kernels counts once. At 9f085a1 it gave about the 1,772 kernels the H200's profiler counted for
v41-bench's batch-16 step (benchmarks/results/profile_components_h200_kernels.md). Time is not
measured here.
"""

from __future__ import annotations

import os
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from atom.kernels import OPT_IN
from benchmarks.common import command_line, md_table, write_results
from benchmarks.profile_components import _components, instrument
from benchmarks.profile_forward import _shape_runs, profiled_runtime, shape_parser

# ops that launch no kernel: views, metadata, allocation, casts that return their input
NO_KERNEL = frozenset(
    "aten::" + n
    for n in (
        "view reshape slice select as_strided expand unsqueeze squeeze t transpose permute empty "
        "detach alias _unsafe_view split unbind empty_strided narrow flatten chunk view_as "
        "expand_as lift_fresh resolve_conj resolve_neg split_with_sizes empty_like "
        "_reshape_alias unflatten item _local_scalar_dense is_nonzero result_type movedim "
        "diagonal set_ resize_ detach_ numpy_T swapaxes lift sym_size sym_stride is_same_size "
        "to type_as contiguous _has_compatible_shallow_copy_type"
    ).split()
)
# (ATOM_TRITON_OFF, ATOM_TRITON_ON) of each arm: plain without the launch-cutting kernels
# (rope, hc_mix and route became the default at bd8cbf3, page_write and swiglu after the gate at
# 93bc75c, block_round and compressor_pool after it at 352d6d6), default with them, opt_in
# with the opt-in kernels (atom.kernels.OPT_IN; none at present) on too
ARMS = {
    "plain": ("rope,hc_mix,route,page_write,swiglu,block_round,compressor_pool", ""),
    "default": ("", ""),
    "opt_in": ("", ",".join(sorted(OPT_IN))),
}


def _triton_ranges() -> None:
    """Each interpreted Triton launch as a profiler range named ``triton::<kernel>``."""
    from triton.runtime import interpreter

    run = interpreter.InterpretedFunction.run

    def ranged(self, *a, **k):
        with record_function("triton::" + getattr(self.fn, "__name__", "kernel")):
            return run(self, *a, **k)

    interpreter.InterpretedFunction.run = ranged


def launches(event, ops: Counter) -> int:
    """Kernels under a profiler event: a Triton range is one; an aten op with no counted op
    beneath it is one unless it launches none; anything else is what its children launch."""
    if event.name.startswith("triton::"):
        ops[event.name] += 1
        return 1
    n = sum(launches(c, ops) for c in event.cpu_children)
    if n == 0 and event.name.startswith("aten::") and event.name not in NO_KERNEL:
        ops[event.name] += 1
        return 1
    return n


def count(prof, labels: list[str]) -> tuple[int, Counter, dict[str, list[int]]]:
    """(kernels in the step, kernels by op, [kernels, calls] by component: outermost ranges
    only where a component nests in itself)."""
    ops, rows = Counter(), {}
    total = sum(launches(e, ops) for e in prof.events() if e.cpu_parent is None)
    for e in prof.events():
        if e.name not in labels:
            continue
        parent = e.cpu_parent
        while parent is not None and parent.name != e.name:
            parent = parent.cpu_parent
        if parent is not None:
            continue
        row = rows.setdefault(e.name, [0, 0])
        row[0] += launches(e, Counter())
        row[1] += 1
    return total, ops, rows


def measure(args, switches: tuple[str, str]) -> tuple[int, Counter, dict]:
    """One decode step's count with ``ATOM_TRITON_OFF``, ``ATOM_TRITON_ON`` = ``switches`` (a
    fresh runtime and sequences)."""
    os.environ.pop("TRITON_INTERPRET", None)  # prefill without the interpreter
    rt, tables, _, _, _ = profiled_runtime(args)
    runs = {n.split()[0]: f for n, f, _ in _shape_runs(rt, args, tables, torch.Generator())}
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["ATOM_TRITON_OFF"], os.environ["ATOM_TRITON_ON"] = switches
    runs["decode"]()  # warm
    restore = instrument()
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            runs["decode"]()
    finally:
        restore()
    return count(prof, [label for _, _, label in _components()])


def main() -> None:
    ap = shape_parser(__doc__, 256, 15)
    ap.set_defaults(batch=4, position=256)
    ap.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=["plain", "default"])
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1" or args.device != "cpu":
        raise SystemExit(
            "kernel_count counts on CPU under Triton's interpreter: run it with "
            f"TRITON_INTERPRET=1 and --device cpu (got --device {args.device})"
        )
    _triton_ranges()
    labels = [label for _, _, label in _components()]
    results = {arm: measure(args, ARMS[arm]) for arm in args.arms}
    rows = [["step"] + [results[a][0] for a in args.arms]]
    for label in labels:
        got = [results[a][2].get(label) for a in args.arms]
        if any(got):
            rows.append([label] + [f"{g[0]} ({g[1]} calls)" if g else "" for g in got])
    table = md_table(["kernels per decode step"] + list(args.arms), rows)
    ops = md_table(
        ["op"] + list(args.arms),
        [
            [op] + [results[a][1].get(op, 0) for a in args.arms]
            for op, _ in (results[args.arms[0]][1] + results[args.arms[-1]][1]).most_common(
                args.top
            )
        ],
    )
    text = (
        f"{args.model}, decode batch {args.batch} at {args.position}, on CPU (one op or Triton "
        f"launch = one kernel; module doc). Arms: "
        + ", ".join(
            f"{a} (ATOM_TRITON_OFF={ARMS[a][0]!r}, ATOM_TRITON_ON={ARMS[a][1]!r})"
            for a in args.arms
        )
        + f".\n\n{table}\n\nMost launched ops:\n\n{ops}\n"
    )
    print(text, flush=True)
    if args.name:
        data = {
            "model": args.model,
            "arms": {
                a: {"kernels": r[0], "components": r[2], "ops": dict(r[1])}
                for a, r in results.items()
            },
        }
        cmd = "TRITON_INTERPRET=1 " + command_line("kernel_count", args)
        print(write_results(args.name, data, text, cmd))


if __name__ == "__main__":
    main()
