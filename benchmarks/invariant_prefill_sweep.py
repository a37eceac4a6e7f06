"""Prefill tiles for the batch-invariant mode's GEMM (``PREFILL_CONFIG`` in
atom/kernels/_invariant_gemm_triton.py) on a preset's dense linear shapes, side by side with the
shape's own configuration and cuBLAS, in one run.

A shape's own configuration (BK, split of K) serves decode rows; a call of many rows may run at
a wider tile (BM, BN, warps, stages) if every row keeps its bits. For each shape and candidate
tile: device ms at each ``--m`` (medians of CUDA-event timings over ``--iters`` graph replays
cycling weight copies that exceed the L2, over ``--repeats`` repeats), and whether rows
computed by the tile equal the same rows computed by a 1-row and a 16-row call (``bits``). Per
shape it names the fastest tile that keeps the bits at the largest M, and the least M from
which it beats the shape's own configuration; the last lines print a ``PREFILL_CONFIG`` to
copy.

    python -m benchmarks.invariant_prefill_sweep --model v41-bench --m 256 1024 4096
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from benchmarks.common import command_line, graph_median, md_table, write_results
from benchmarks.invariant_gemm_sweep import linear_shapes

# (BM, BN, warps, stages)
TILES = [
    (128, 128, 4, 3),
    (128, 128, 8, 3),
    (128, 128, 8, 4),
    (128, 256, 8, 3),
    (128, 64, 4, 4),
    (64, 256, 8, 4),
    (256, 128, 8, 3),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="v41-bench")
    ap.add_argument("--m", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--l2-mib", type=int, default=128, help="weight copies per shape exceed this")
    ap.add_argument("--name", default="invariant_prefill_sweep_h200")
    args = ap.parse_args()
    from atom.kernels import _invariant_gemm_triton as k

    dtype = torch.bfloat16
    shapes = linear_shapes(args.model)
    print(f"{len(shapes)} shapes: {dict(shapes)}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    top = max(args.m)
    rows, chosen, data = [], {}, {"shapes": {}}
    head = ["N x K", "count", "tile (BM, BN, warps, stages)"]
    head += [f"M={m} ms (vs own, vs cuBLAS)" for m in args.m] + ["bits"]
    command = command_line("invariant_prefill_sweep", args)
    saved = (k.PREFILL_ROWS, dict(k.PREFILL_CONFIG))
    k.PREFILL_ROWS = 2  # every candidate call below is "many rows"; the 1-row call is not

    def save() -> None:
        pick = [
            [f"{n} x {kd}", shapes[n, kd], str(t), f"{m_from}", f"{gain:.2f}x"]
            for (n, kd), (t, m_from, gain) in chosen.items()
        ]
        table = md_table(head, rows) + "\n\nPer shape, the fastest tile that keeps the bits:\n\n"
        table += md_table(
            ["N x K", "count", "tile", "beats own from M", f"M={top} own / tile"], pick
        )
        write_results(args.name, data, table, command)

    def timed(call, n, kd, ws, x) -> dict:
        each = {m: [] for m in args.m}
        for _ in range(args.repeats):
            for m in args.m:
                r = x[:m]
                each[m].append(graph_median(lambda i, r=r: call(r, ws[i]), len(ws), args.iters))
        return {m: statistics.median(v) for m, v in each.items()}

    try:
        for n, kd in sorted(shapes):
            copies = max(1, -(-args.l2_mib * 2**20 // (n * kd * 2)))
            ws = [
                torch.randn(n, kd, device="cuda", generator=gen, dtype=dtype) for _ in range(copies)
            ]
            x = torch.randn(top, kd, device="cuda", generator=gen).to(dtype)
            k.PREFILL_CONFIG.pop((dtype, n, kd), None)
            base = timed(F.linear, n, kd, ws, x)
            own = timed(k.invariant_linear, n, kd, ws, x)
            want = [k.invariant_linear(x[lo:hi], ws[0]) for lo, hi in ((0, 1), (top - 16, top))]
            rec = {"cublas": base, "own": own, "own_config": k._config(dtype, n, kd), "tiles": []}
            rows.append(
                [f"{n} x {kd}", shapes[n, kd], f"own {k._config(dtype, n, kd)}"]
                + [f"{own[m]:.3f} (1.00x, {own[m] / base[m]:.2f}x)" for m in args.m]
                + ["-"]
            )
            best = None
            for tile in TILES:
                k.PREFILL_CONFIG[dtype, n, kd] = tile
                if not k.fits(k._config(dtype, n, kd, top), x.device):
                    k.PREFILL_CONFIG.pop((dtype, n, kd))
                    continue
                try:
                    got = timed(k.invariant_linear, n, kd, ws, x)
                    full = k.invariant_linear(x, ws[0])
                except Exception as exc:  # noqa: BLE001 - a tile the GPU cannot launch
                    print(f"{n}x{kd} {tile}: {type(exc).__name__}: {exc}", flush=True)
                    continue
                finally:
                    k.PREFILL_CONFIG.pop((dtype, n, kd), None)
                bits = torch.equal(full[:1], want[0]) and torch.equal(full[top - 16 :], want[1])
                rec["tiles"].append({"tile": tile, "ms": got, "bits": bits})
                rows.append(
                    [f"{n} x {kd}", shapes[n, kd], str(tile)]
                    + [
                        f"{got[m]:.3f} ({got[m] / own[m]:.2f}x, {got[m] / base[m]:.2f}x)"
                        for m in args.m
                    ]
                    + ["yes" if bits else "NO"]
                )
                print(rows[-1], flush=True)
                if bits and got[top] < own[top] and (best is None or got[top] < best[1][top]):
                    best = (tile, got)
            data["shapes"][f"{n}x{kd}"] = rec
            if best is not None:
                tile, got = best
                m_from = min((m for m in args.m if got[m] < own[m]), default=top)
                chosen[n, kd] = (tile, m_from, own[top] / got[top])
            save()
    finally:
        k.PREFILL_ROWS = saved[0]
        k.PREFILL_CONFIG.clear()
        k.PREFILL_CONFIG.update(saved[1])
    data["chosen"] = {f"{n}x{kd}": list(v) for (n, kd), v in chosen.items()}
    save()
    print(md_table(head, rows))
    print("PREFILL_CONFIG (bf16):")
    for (n, kd), (tile, m_from, gain) in chosen.items():
        print(f"    ({n}, {kd}): {tile},  # from M={m_from}, {gain:.2f}x own at M={top}")


if __name__ == "__main__":
    main()
