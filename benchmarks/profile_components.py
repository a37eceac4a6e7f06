"""Which parts of the model a paged forward's device time goes to: kernel time and kernel count
per component (mHC, Engram, attention's projections, indexer, selection, attention proper,
MoE routing, experts, LM head), for a decode batch and a prefill chunk batch.

python -m benchmarks.profile_components --model v41-bench --device cuda --dtype bfloat16 \
    --position 4096 --batch 16 --name profile_components_h200

The forward runs eagerly (a CUDA graph hides which op launched a kernel); each component is a
profiler range around the model function that computes it, and its row sums the device time
of every kernel launched inside that range (nested ranges count in both: "attention" holds
"indexer"). Kernel times are those of a graph replay; the gaps between them are not. On CPU the rows
are host time (there are no kernels).
"""

from __future__ import annotations

import functools
from collections import defaultdict

import torch
from torch.profiler import profile, record_function

from atom.model_api import Span
from atom.models.registry import default_block_size
from benchmarks.common import command_line, md_table, write_results
from benchmarks.profile_forward import _shape_runs, profiled_runtime, shape_parser


def _components():
    """(owner, attribute, label): the functions wrapped in a profiler range."""
    from atom.models.common import layers as common_layers
    from atom.models.common import mhc, moe
    from atom.models.deepseek_v41 import attention, block, engram, model, paged_decode

    return [
        (model.DeepseekV41ForCausalLM, "_embed", "embed"),
        (model.DeepseekV41ForCausalLM, "_head", "lm head (mHC + norm + head)"),
        (engram.Engram, "forward", "engram"),
        (mhc.HcMixer, "mixes", "mhc mixes (mix, sinkhorn)"),
        (block, "collapse", "mhc collapse"),
        (block, "hc_post", "mhc post"),
        (common_layers.RMSNorm, "forward", "rms norm (module)"),
        (block.DecoderLayer, "block", "layer"),
        (attention.CSA2Attention, "queries", "attn: q projections + rope"),
        (attention.CSA2Attention, "window_kv", "attn: window kv"),
        (attention.CSA2Attention, "index_query", "attn: index query"),
        (attention.CSA2Attention, "attend", "attn: attend (decode)"),
        (attention.CSA2Attention, "attend_tiles", "attn: attend (prefill)"),
        (attention.CSA2Attention, "output", "attn: output projection"),
        (attention.Indexer, "scores", "attn: index scores"),
        (attention, "select_topk", "attn: top-k"),
        (attention, "candidate_row_mask", "attn: candidate blocks"),
        (paged_decode, "_complete_groups", "attn: compressor + PAGE write"),
        (paged_decode, "decode_attention", "attention (decode, all)"),
        (moe.MoE, "route", "moe: routing"),
        (moe.MoE, "_mix_float", "moe: experts (shared + routed)"),
        (moe.Expert, "forward", "moe: Expert.forward (shared; routed on the loop path)"),
    ]


def _wrap(fn, label):
    @functools.wraps(fn)
    def wrapped(*a, **k):
        with record_function(label):
            return fn(*a, **k)

    return wrapped


def instrument():
    """Wrap every component; returns a function that undoes it. Module-level functions are
    also rebound where other modules imported them by name."""
    from atom.models.deepseek_v41 import attention, model, paged_attention, paged_decode

    undo = []
    for owner, attr, label in _components():
        raw = owner.__dict__[attr]
        is_static = isinstance(raw, staticmethod)
        fn = raw.__func__ if is_static else raw
        new = _wrap(fn, label)
        setattr(owner, attr, staticmethod(new) if is_static else new)
        undo.append((owner, attr, raw))
        for mod in (attention, model, paged_attention, paged_decode):  # model: the head's collapse
            if mod is not owner and getattr(mod, attr, None) is fn:
                setattr(mod, attr, new)
                undo.append((mod, attr, fn))

    def restore():
        for owner, attr, raw in reversed(undo):
            setattr(owner, attr, raw)

    return restore


def _kernels(event, cuda: bool) -> tuple[float, int]:
    """(device us, kernels) of the aten kernels launched under ``event``; on CPU (no kernels),
    the range's host time and 0."""
    if not cuda:
        return event.cpu_time_total, 0
    us, n = sum(k.duration for k in event.kernels), len(event.kernels)
    for child in event.cpu_children:
        cu, cn = _kernels(child, cuda)
        us, n = us + cu, n + cn
    return us, n


def breakdown(prof, labels: list[str], cuda: bool) -> tuple[dict, float, int]:
    """Per label: [device us, kernels, calls] summed over its ranges (outermost only where a
    label nests in itself); and the whole step's device us and kernels. On CUDA the device
    total counts every kernel (Triton's carry no range and are missing from the rows)."""
    rows: dict[str, list] = defaultdict(lambda: [0.0, 0, 0])
    for e in prof.events():
        if e.name not in labels or e.device_type != torch.autograd.DeviceType.CPU:
            continue  # a range is also recorded as a device annotation: count it once
        parent, nested = e.cpu_parent, False
        while parent is not None:
            nested = nested or parent.name == e.name
            parent = parent.cpu_parent
        if nested:
            continue
        us, n = _kernels(e, cuda)
        row = rows[e.name]
        row[0], row[1], row[2] = row[0] + us, row[1] + n, row[2] + 1
    total_us = total_n = 0
    for e in prof.events():
        if e.cpu_parent is None:
            us, n = _kernels(e, cuda)
            total_us, total_n = total_us + us, total_n + n
    if cuda:
        total_us = sum(e.self_device_time_total for e in device_kernels(prof, labels))
    return rows, total_us, total_n


def device_kernels(prof, labels: list[str]) -> list:
    """The profile's kernels by name (key averages), most device time first; the ranges' own
    device annotations left out."""
    kernels = [
        e
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.key not in labels
    ]
    return sorted(kernels, key=lambda e: -e.self_device_time_total)


def main() -> None:
    ap = shape_parser(__doc__, prefill_tokens=4096, top=15)
    ap.add_argument("--late-prefill", action="store_true", help="also chunks at --position")
    args = ap.parse_args()
    bs = default_block_size(args.model)
    extra = (args.repeats + 2) * args.late_prefill  # a chunk of bs per late prefill run
    rt, tables, cuda, sync, activities = profiled_runtime(args, extra_blocks=extra)
    labels = [label for _, _, label in _components()]
    sections, data = [], {}
    shapes = list(_shape_runs(rt, args, tables, torch.Generator().manual_seed(0)))
    if args.late_prefill:  # chunks at --position, where selection and attention are full
        n = max(1, min(args.batch, args.prefill_tokens // bs))
        late = {"pos": None}

        def late_prefill():
            if late["pos"] is None:
                late["pos"] = int(rt.slots.host_position[0])
            p = late["pos"]
            spans = [Span(p, p + bs, i, tables[i]) for i in range(n)]
            rt.forward(torch.randint(0, 300, (n * bs,)), spans).argmax(-1).cpu()
            late["pos"] += bs

        shapes.insert(1, (f"prefill {n} x {bs} tokens at {args.position}", late_prefill, None))
    for shape, run, _ in shapes:
        run()  # warm
        sync()
        restore = instrument()
        try:
            per, top = [], []
            for _ in range(args.repeats):
                with profile(activities=activities) as prof:
                    run()
                    sync()
                per.append(breakdown(prof, labels, cuda))
                top = device_kernels(prof, labels)[: args.top] if cuda else []
        finally:
            restore()
        total_us = min(p[1] for p in per)
        total_n = per[0][2]
        rows = []
        for label in labels:
            got = [p[0].get(label) for p in per]
            if not any(got):
                continue
            us = sorted(g[0] for g in got)[len(got) // 2]
            rows.append(
                [
                    label,
                    round(us / 1000, 3),
                    f"{100 * us / max(total_us, 1e-9):.1f}%",
                    got[0][1],
                    got[0][2],
                ]
            )
        table = md_table(["component", "device ms", "of step", "kernels", "calls"], rows)
        if top:  # kernels launched outside aten (Triton's) carry no range: listed by name
            table += "\n\nTop kernels by device time (one step):\n\n" + md_table(
                ["kernel", "device ms", "launches"],
                [[e.key[:60], round(e.self_device_time_total / 1000, 3), e.count] for e in top],
            )
        head = (
            f"## {shape}\n\nAll kernels: {total_us / 1000:.3f} ms device time (least of "
            f"{args.repeats}), {total_n} kernels per step (the step's argmax included)."
        )
        sections.append(f"{head}\n\n{table}\n")
        data[shape] = {"device_ms": total_us / 1000, "kernels": total_n, "rows": rows}
        print(sections[-1], flush=True)
    text = (
        "Component ms: median over repeats of the device time of the kernels launched inside "
        "the component's ranges; components nest (a layer holds its attention, attention its "
        "indexer), so rows do not add up to the step.\n\n" + "\n".join(sections)
    )
    if args.name:
        cmd = command_line("profile_components", args)
        print(write_results(args.name, {"model": args.model, "shapes": data}, text, cmd))


if __name__ == "__main__":
    main()
