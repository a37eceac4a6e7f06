"""Tiles for the batch-invariant mode's GEMM (atom/kernels/_invariant_gemm_triton.py) per dense
linear shape of a preset, decode-shaped and prefill-shaped calls together, against cuBLAS, side
by side in one run.

A shape's own configuration (``SHAPE_CONFIG``: BN, BK, warps, stages; BM the dtype's) serves the
calls of fewer than ``PREFILL_ROWS`` rows and fixes what a product's bits depend on: BK, and the
split of K that ``splits`` derives from BN and BK. A call of more rows may run at a wider tile
(``PREFILL_CONFIG``: BM, BN, warps, stages) over the same BK and split. So each candidate pair
is judged together:

  * decode candidates (``--decode-tiles``: ``own`` alone, the shape's configuration today, or
    ``sweep``: ``DECODE_TILES`` too): device ms at each ``--m`` below ``PREFILL_ROWS``;
  * prefill tiles (``PREFILL_TILES``, and ``own``: the decode tile itself), for each distinct
    (BK, split of K) the decode candidates give: device ms at each ``--m`` from
    ``PREFILL_ROWS`` on, and whether the rows of the widest call equal the same rows computed
    by a 1-row and a 16-row call (``bits``).

Per shape it names the pair whose summed time over cuBLAS's, over every ``--m``, is least
among those that keep the bits, and the last lines print the two tables to copy. Times are
medians of CUDA-event timings over ``--iters`` graph replays cycling weight copies that exceed
the L2, over ``--repeats`` repeats.

    python -m benchmarks.invariant_prefill_sweep --model v41-bench --m 16 256 1024 4096
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from benchmarks.common import command_line, graph_median, md_table, write_results
from benchmarks.invariant_gemm_sweep import linear_shapes

# (BN, BK, warps, stages) for decode-shaped calls (BM: the dtype's)
DECODE_TILES = [
    (16, 128, 4, 8),
    (32, 64, 4, 6),
    (32, 128, 4, 6),
    (64, 64, 4, 6),
    (64, 128, 4, 4),
    (128, 64, 4, 4),
    (128, 128, 4, 3),
    (256, 64, 8, 4),
]
# (BM, BN, warps, stages) for prefill-shaped calls (BK: the decode tile's)
PREFILL_TILES = [
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
    ap.add_argument("--m", type=int, nargs="+", default=[16, 256, 1024, 4096])
    ap.add_argument("--decode-tiles", choices=["own", "sweep"], default="own")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--l2-mib", type=int, default=128, help="weight copies per shape exceed this")
    ap.add_argument("--name", default="invariant_prefill_sweep_h200")
    args = ap.parse_args()
    from atom.kernels import _invariant_gemm_triton as k

    dtype, dev = torch.bfloat16, torch.device("cuda")
    shapes = linear_shapes(args.model)
    print(f"{len(shapes)} shapes: {dict(shapes)}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    top = max(args.m)
    small = [m for m in args.m if m < k.PREFILL_ROWS]
    large = [m for m in args.m if m >= k.PREFILL_ROWS]
    if not large or top < 16:
        ap.error(f"--m needs a value of at least PREFILL_ROWS ({k.PREFILL_ROWS}) and of 16")
    bm = k.CONFIG[dtype][0]
    rows, chosen, data = [], {}, {"prefill_rows": k.PREFILL_ROWS, "shapes": {}}
    head = ["N x K", "count", "decode tile (BN, BK, warps, stages)", "splits", "prefill tile"]
    head += [f"M={m} ms (vs cuBLAS)" for m in args.m] + ["bits"]
    command = command_line("invariant_prefill_sweep", args)
    saved = (dict(k.SHAPE_CONFIG), dict(k.PREFILL_CONFIG))

    def save() -> None:
        pick = [
            [f"{n} x {kd}", shapes[n, kd], str(c["decode"]), str(c["prefill"])]
            + [f"{c['ms'][m]:.3f} ({c['ms'][m] / c['cublas'][m]:.2f}x)" for m in args.m]
            for (n, kd), c in chosen.items()
        ]
        table = md_table(head, rows) + "\n\nPer shape, the pair of least summed time over "
        table += "cuBLAS's that keeps the bits:\n\n"
        table += md_table(
            ["N x K", "count", "decode tile", "prefill tile"]
            + [f"M={m} ms (vs cuBLAS)" for m in args.m],
            pick,
        )
        write_results(args.name, data, table, command)

    def timed(call, ws, x, ms) -> dict:
        each = {m: [] for m in ms}
        for _ in range(args.repeats):
            for m in ms:
                r = x[:m]
                each[m].append(graph_median(lambda i, r=r: call(r, ws[i]), len(ws), args.iters))
        return {m: statistics.median(v) for m, v in each.items()}

    def configure(key, decode, prefill) -> None:
        """``decode``: (BN, BK, warps, stages) or None (the shape's own); ``prefill``: a tile,
        None (none: the decode tile serves every M)."""
        k.SHAPE_CONFIG.clear()
        k.SHAPE_CONFIG.update(saved[0])
        k.PREFILL_CONFIG.clear()
        if decode is not None:
            k.SHAPE_CONFIG[key] = decode
        if prefill is not None:
            k.PREFILL_CONFIG[key] = prefill

    def cells(ms_by_m: dict, base: dict) -> list:
        return [
            f"{ms_by_m[m]:.3f} ({ms_by_m[m] / base[m]:.2f}x)" if m in ms_by_m else ""
            for m in args.m
        ]

    try:
        for n, kd in sorted(shapes):
            key = (dtype, n, kd)
            copies = max(1, -(-args.l2_mib * 2**20 // (n * kd * 2)))
            ws = [
                torch.randn(n, kd, device="cuda", generator=gen, dtype=dtype) for _ in range(copies)
            ]
            x = torch.randn(top, kd, device="cuda", generator=gen).to(dtype)
            base = timed(F.linear, ws, x, args.m)
            configure(key, None, None)
            own = k._config(dtype, n, kd)[1:]
            decodes = [own]
            if args.decode_tiles == "sweep":
                decodes += [t for t in DECODE_TILES if t != own]
            rec = {"cublas": base, "own": own, "decode": [], "prefill": []}
            by_split: dict[tuple, dict] = {}  # (BK, splits) -> {prefill tile: (ms, bits)}
            best = None
            for dec in decodes:
                if not k.fits((bm, *dec), dev):
                    continue
                configure(key, dec, None)
                split = k.splits(n, kd, dtype, dev)
                try:
                    got = timed(k.invariant_linear, ws, x, small) if small else {}
                except Exception as exc:  # noqa: BLE001 - a tile the GPU cannot launch
                    print(f"{n}x{kd} decode {dec}: {type(exc).__name__}: {exc}", flush=True)
                    continue
                want = [k.invariant_linear(x[lo:hi], ws[0]) for lo, hi in ((0, 1), (top - 16, top))]
                rec["decode"].append({"tile": dec, "splits": split, "ms": got})
                rows.append(
                    [f"{n} x {kd}", shapes[n, kd], str(dec), split, "-"] + cells(got, base) + ["-"]
                )
                print(rows[-1], flush=True)
                group = (dec[1], split)
                if group in by_split:  # its prefill tiles were timed beside another decode tile
                    same = all(torch.equal(a, b) for a, b in zip(want, by_split[group]["want"]))
                    if not same:  # a BN that changed the bits: none of the group's tiles
                        print(f"{n}x{kd} decode {dec}: other bits than {group}'s", flush=True)
                        rows[-1][-1] = "NO (decode)"
                        continue
                options = by_split.setdefault(group, {"want": want, "tiles": {}})["tiles"]
                tiles = [None] + [t for t in PREFILL_TILES if t not in options]
                for tile in tiles:
                    if tile is None and dec != own:
                        continue  # the decode tile at every M: measured for today's only
                    wide = (tile[0], tile[1], dec[1], tile[2], tile[3]) if tile else None
                    if wide is not None and not k.fits(wide, dev):
                        continue
                    configure(key, dec, tile)
                    try:
                        pre = timed(k.invariant_linear, ws, x, large)
                        full = k.invariant_linear(x, ws[0])
                    except Exception as exc:  # noqa: BLE001
                        print(f"{n}x{kd} prefill {tile}: {type(exc).__name__}: {exc}", flush=True)
                        continue
                    bits = torch.equal(full[:1], want[0]) and torch.equal(full[top - 16 :], want[1])
                    options[tile] = (pre, bits)
                    rec["prefill"].append(
                        {"decode": dec, "splits": split, "tile": tile, "ms": pre, "bits": bits}
                    )
                    rows.append(
                        [f"{n} x {kd}", shapes[n, kd], str(dec), split, str(tile or "decode's")]
                        + cells(pre, base)
                        + ["yes" if bits else "NO"]
                    )
                    print(rows[-1], flush=True)
                for tile, (pre, bits) in options.items():
                    if not bits or (tile is None and dec != own):
                        continue
                    ms = got | pre
                    score = sum(ms[m] / base[m] for m in args.m)
                    if best is None or score < best[0]:
                        best = (score, dec, tile, ms)
            data["shapes"][f"{n}x{kd}"] = rec
            if best is not None:
                _, dec, tile, ms = best
                chosen[n, kd] = {"decode": dec, "prefill": tile, "ms": ms, "cublas": base}
            save()
    finally:
        k.SHAPE_CONFIG.clear()
        k.SHAPE_CONFIG.update(saved[0])
        k.PREFILL_CONFIG.clear()
        k.PREFILL_CONFIG.update(saved[1])
    data["chosen"] = {
        f"{n}x{kd}": {"decode": c["decode"], "prefill": c["prefill"]}
        for (n, kd), c in chosen.items()
    }
    save()
    print(md_table(head, rows))
    print("SHAPE_CONFIG (bf16):")
    for (n, kd), c in chosen.items():
        print(f"    ({n}, {kd}): {c['decode']},")
    print("PREFILL_CONFIG (bf16):")
    for (n, kd), c in chosen.items():
        if c["prefill"] is not None:
            print(f"    ({n}, {kd}): {c['prefill']},")


if __name__ == "__main__":
    main()
