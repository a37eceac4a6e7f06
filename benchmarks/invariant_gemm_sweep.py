"""Launch configurations of the batch-invariant mode's GEMM (atom/kernels/_invariant_gemm_triton.py)
on a preset's dense linear shapes, against cuBLAS, side by side in one run.

The mode needs one configuration for every row count M (a row's bits must not depend on M), so a
configuration is judged on decode-shaped and prefill-shaped calls together: for each candidate
(BM, BN, BK, warps, stages, programs per SM that K splits aim at), the device ms of every
distinct linear of the preset (weighted by how many the model has) at each ``--m``, and whether
row 0 keeps its bits from M = 1 to the largest M at every shape (``invariant``). Times are
medians of CUDA-event timings over ``--iters`` replays of a CUDA graph calling each of several
weight copies once (the copies exceed the L2, as a decode step's layers do), over ``--repeats``
repeats; the spread is the repeats' range of the weighted sum.

    python -m benchmarks.invariant_gemm_sweep --model v41-bench --m 16 4096
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter

import torch
import torch.nn.functional as F

from benchmarks.common import command_line, graph_median, md_table, write_results

# (BM, BN, BK, warps, stages); BM stays 64 (one wgmma M tile)
TILES = [
    (64, 128, 64, 4, 3),
    (64, 128, 64, 4, 4),
    (64, 128, 128, 4, 3),
    (64, 128, 64, 8, 3),
    (64, 256, 64, 8, 3),
    (64, 256, 64, 8, 4),
    (64, 64, 128, 4, 4),
    (64, 128, 128, 8, 3),
]
SPLIT_PROGRAMS = (1, 2, 4)


def linear_shapes(model: str) -> Counter:
    """{(N, K): how many} of the preset's dense linears (nn.Linear weights, built on meta)."""
    from atom.models.registry import family, resolve_config

    cfg, _ = resolve_config(model)
    net = family(cfg).get("model")(
        cfg, dtype=torch.bfloat16, kv_dtype="bf16", index_dtype="fp8", device="meta"
    )
    return Counter(tuple(m.weight.shape) for m in net.modules() if isinstance(m, torch.nn.Linear))


def _keyed(per_shape: dict) -> dict:
    """Shape keys as "NxK" strings (JSON)."""
    return {f"{n}x{k}": v for (n, k), v in per_shape.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="v41-bench")
    ap.add_argument("--m", type=int, nargs="+", default=[16, 4096])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--l2-mib", type=int, default=128, help="weight copies per shape exceed this")
    ap.add_argument("--name", default="invariant_gemm_sweep_h200")
    args = ap.parse_args()
    from atom.kernels import _invariant_gemm_triton as k

    shapes = linear_shapes(args.model)
    print(f"{len(shapes)} shapes: {dict(shapes)}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights, inputs = {}, {}
    for n, kd in shapes:
        copies = max(1, -(-args.l2_mib * 2**20 // (n * kd * 2)))
        weights[n, kd] = [
            torch.randn(n, kd, device="cuda", generator=gen, dtype=torch.bfloat16)
            for _ in range(copies)
        ]
        inputs[n, kd] = torch.randn(max(args.m), kd, device="cuda", generator=gen).bfloat16()

    def total(call):
        """({M: weighted ms, median over repeats}, the repeats' totals, {shape: {M: ms}})."""
        per, each = [], {s: {m: [] for m in args.m} for s in shapes}
        for _ in range(args.repeats):
            ms = {m: 0.0 for m in args.m}
            for (n, kd), count in shapes.items():
                ws, x = weights[n, kd], inputs[n, kd]
                for m in args.m:
                    rows = x[:m]
                    t = graph_median(lambda i, r=rows, w=ws: call(r, w[i]), len(ws), args.iters)
                    each[n, kd][m].append(t)
                    ms[m] += count * t
            per.append(ms)
        shaped = {s: {m: statistics.median(v) for m, v in d.items()} for s, d in each.items()}
        return {m: statistics.median(p[m] for p in per) for m in args.m}, per, shaped

    def best_per_shape() -> list[list]:
        """Per weight shape, the configuration with the least sum over M of its time over
        cuBLAS's (one configuration must serve every M: ``SHAPE_CONFIG``)."""
        out = []
        for s in shapes:

            def cost(c, s=s):
                return sum(c["shapes"][s][m] / base_shaped[s][m] for m in args.m)

            kept = [c for c in data["configs"] if c["invariant"]]
            best = min(kept, key=cost, default=None)
            if best is None:
                continue
            out.append(
                [f"{s[0]} x {s[1]}", shapes[s], str(best["tile"]), best["split_programs"]]
                + [f"{best['shapes'][s][m] / base_shaped[s][m]:.2f}x" for m in args.m]
            )
        return out

    head = ["(BM, BN, BK, warps, stages)", "programs / SM"]
    head += [f"M={m} ms (vs cuBLAS)" for m in args.m] + ["repeats' range", "row 0 invariant"]
    command = command_line("invariant_gemm_sweep", args)

    def save() -> None:  # after every configuration: a run cut short keeps what it measured
        table = f"Dense linears of {args.model}, weighted by count: {dict(shapes)}.\n\n"
        table += md_table(head, rows) + "\n\nPer shape, the configuration of least cost:\n\n"
        table += md_table(
            ["N x K", "count", "(BM, BN, BK, warps, stages)", "programs / SM"]
            + [f"M={m} vs cuBLAS" for m in args.m],
            best_per_shape(),
        )
        json_data = dict(
            data, configs=[dict(c, shapes=_keyed(c["shapes"])) for c in data["configs"]]
        )
        write_results(args.name, json_data, table, command)

    base, _, base_shaped = total(F.linear)
    rows, data = [], {"cublas": base, "cublas_shapes": _keyed(base_shaped), "configs": []}
    rows.append(["cuBLAS (F.linear)", ""] + [round(base[m], 3) for m in args.m] + ["", "no"])
    saved = (k.CONFIG[torch.bfloat16], k.SPLIT_PROGRAMS, dict(k.SHAPE_CONFIG))
    k.SHAPE_CONFIG.clear()  # every shape at the candidate's configuration
    try:
        for tile in TILES:
            for sp in SPLIT_PROGRAMS:
                k.CONFIG[torch.bfloat16], k.SPLIT_PROGRAMS = tile, sp
                try:
                    got, per, shaped = total(k.invariant_linear)
                except Exception as exc:  # noqa: BLE001 - a config the GPU cannot launch
                    print(f"{tile} x{sp}: {type(exc).__name__}: {exc}", flush=True)
                    continue
                invariant = all(
                    torch.equal(
                        k.invariant_linear(inputs[s][: max(args.m)], weights[s][0])[:1],
                        k.invariant_linear(inputs[s][:1], weights[s][0]),
                    )
                    for s in shapes
                )
                spread = [
                    f"{min(p[m] for p in per):.3f}-{max(p[m] for p in per):.3f}" for m in args.m
                ]
                rows.append(
                    [str(tile), sp]
                    + [f"{got[m]:.3f} ({got[m] / base[m]:.2f}x)" for m in args.m]
                    + [" / ".join(spread), "yes" if invariant else "NO"]
                )
                data["configs"].append(
                    {
                        "tile": tile,
                        "split_programs": sp,
                        "ms": got,
                        "invariant": invariant,
                        "shapes": shaped,
                    }
                )
                print(rows[-1], flush=True)
                save()
    finally:
        k.CONFIG[torch.bfloat16], k.SPLIT_PROGRAMS = saved[:2]
        k.SHAPE_CONFIG.update(saved[2])
    save()
    print(md_table(head, rows))


if __name__ == "__main__":
    main()
