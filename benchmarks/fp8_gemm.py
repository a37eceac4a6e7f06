"""The FP8 block-scaled GEMM (atom.kernels.fp8_gemm) against bf16 cuBLAS, per linear shape.

For each distinct FP8 linear of the given presets (their weight shape and block, read from the
model built on ``meta``) and each row count M, times side by side in one run: ``F.linear`` in
bf16 on the dequantized weight (cuBLAS), the Triton kernel with its default tile config, each
candidate config of a small sweep, and (for 128 x 128 blocks) torch's blockwise
``scaled_mm`` where this torch has it. Also checks the kernel against its torch expression
(max relative error, float32 output). Times are medians of CUDA-event timings over
``--iters`` replays of a CUDA graph that calls each of several weight copies once (device
time, as under the engine's decode graphs; the copies exceed the L2), repeated ``--repeats``
times; the spread is the repeats' range.

    python -m benchmarks.fp8_gemm --models v4-bench-fp8 v41-bench-fp8 --m 1 16 32 128 4096
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from benchmarks.common import command_line, graph_timer, md_table, write_results


def candidates(m: int) -> list[dict]:
    """The sweep's launch configurations for M rows (``fp8_linear_triton``'s ``config``)."""
    out = []
    if m <= 64:
        for bm in (16,) if m <= 16 else (32, 64):
            for bn in (32, 64, 128):
                for split in (1, 2, 4, 8) if m <= 16 else (1, 2, 4):
                    for group in (1, 4):
                        out.append(
                            dict(BM=bm, BN=bn, num_warps=4, num_stages=4, SPLIT=split, GROUP=group)
                        )
        out.append(dict(BM=16, BN=64, num_warps=4, num_stages=6, SPLIT=2, GROUP=4))
        out.append(dict(BM=16, BN=64, num_warps=4, num_stages=4, SPLIT=4, QUANT_IN_KERNEL=False))
    if m > 16:
        for bm, bn, warps in ((64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8)):
            for stages in (3, 4):
                for split in (1, 2) if m <= 512 else (1,):
                    out.append(
                        dict(
                            BM=bm,
                            BN=bn,
                            num_warps=warps,
                            num_stages=stages,
                            SPLIT=split,
                            QUANT_IN_KERNEL=False,
                        )
                    )
    if m > 128:
        out.append(dict(BM=128, BN=256, num_warps=8, num_stages=3, SPLIT=1, QUANT_IN_KERNEL=False))
        out.append(dict(METHOD="dequant"))
    # both operands dequantized in registers, bf16 dots (atom/kernels/_fp8_dq_triton.py)
    for bm in (16,) if m <= 16 else (32, 64) if m <= 64 else (64, 128):
        for bn in (32, 64, 128) if m <= 64 else (64, 128):
            for kt in (128, 256):
                for split in (1, 2, 4, 8) if m <= 64 else (1,):
                    warps = 8 if bm * bn >= 128 * 128 else 4
                    out.append(
                        dict(
                            METHOD="dq",
                            BM=bm,
                            BN=bn,
                            KT=kt,
                            SPLIT=split,
                            num_warps=warps,
                            num_stages=3,
                        )
                    )
    return [c if "METHOD" in c else {"METHOD": "tiles", **c} for c in out]


def linear_shapes(models: list[str]) -> list[tuple[str, int, int, tuple[int, int]]]:
    """(preset, N, K, block) for every distinct FP8 linear of the presets."""
    from atom.models.registry import family, resolve_config

    seen, out = set(), []
    for name in models:
        cfg, _ = resolve_config(name)
        fam = family(cfg)
        net = fam.get("model")(
            cfg, dtype=torch.bfloat16, kv_dtype="bf16", index_dtype="fp8", device="meta"
        )
        names, block = fam.get("fp8_linears")(net)
        for mod in names:
            w = net.get_submodule(mod).weight
            key = (name, w.shape[0], w.shape[1], block)
            if key not in seen:
                seen.add(key)
                out.append(key)
    return out


def timed(fn, copies: int, iters: int, repeats: int) -> tuple[float, float, float]:
    """(median, min, max) over ``repeats`` of the median per-call device ms over ``iters``
    replays of one CUDA graph that calls ``fn(i)`` once for each weight copy i (the engine's
    decode steps run in graphs: launch costs are not the kernel's; the copies exceed the L2,
    so every call streams its weight from HBM, as a decode step's layers do)."""
    replay = graph_timer(fn, copies)
    meds = [statistics.median(replay() for _ in range(iters)) for _ in range(repeats)]
    return statistics.median(meds), min(meds), max(meds)


def scaled_mm_fn(x, q, s, block):
    """torch's blockwise scaled_mm for 128 x 128 weight blocks, or None where absent."""
    if block != (128, 128) or not hasattr(F, "scaled_mm"):
        return None
    try:
        from torch.nn.functional import ScalingType, SwizzleType  # noqa: F401
    except ImportError:
        return None
    from atom.kernels._fp8_gemm_triton import fp8_act_quant_triton

    def run():
        xq, xs = fp8_act_quant_triton(x, 128)
        return F.scaled_mm(
            xq,
            q.t(),
            scale_a=xs.t().contiguous().t(),
            scale_recipe_a=ScalingType.BlockWise1x128,
            scale_b=s.t(),
            scale_recipe_b=ScalingType.BlockWise128x128,
            output_dtype=torch.bfloat16,
        )

    try:
        run()
    except Exception as exc:  # noqa: BLE001 - an unsupported build or shape: not timed
        print(f"scaled_mm unavailable for {tuple(q.shape)}: {type(exc).__name__}: {exc}")
        return None
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["v4-bench-fp8", "v41-bench-fp8"])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 32, 64, 256, 4096])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sweep", action="store_true", help="time every candidate tile config")
    ap.add_argument("--name", default="fp8_gemm_h200")
    args = ap.parse_args()

    from atom.kernels._fp8_gemm_triton import fp8_linear_triton, tile_config
    from atom.kernels.fp8_gemm import fp8_linear_torch
    from atom.models.common.formats import dequant_fp8, fp8_weight_quant

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, cells = [], []
    ratios: dict = {}  # (m, block) -> config -> [fp8 / bf16 per shape]
    for preset, n, k, block in linear_shapes(args.models):
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        q, s = fp8_weight_quant(w, block)
        wd = dequant_fp8(q, s, block).to(torch.bfloat16)
        copies = max(2, min(16, -(-(256 << 20) // (2 * n * k))))  # bf16 copies >= 256 MiB
        qs = [(q.clone(), s.clone()) for _ in range(copies)]
        wds = [wd.clone() for _ in range(copies)]
        for m in args.m:
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            ref = fp8_linear_torch(x, q, s, block, torch.float32)
            got = fp8_linear_triton(x, q, s, block, torch.float32)
            rel = ((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()
            bf16 = timed(
                lambda i, x=x, wds=wds: F.linear(x, wds[i]), copies, args.iters, args.repeats
            )
            fp8 = timed(
                lambda i, x=x, b=block, qs=qs: fp8_linear_triton(x, *qs[i], b),
                copies,
                args.iters,
                args.repeats,
            )
            best = (fp8[0], tile_config(m, n, k, block[1]))
            if args.sweep:
                for cfg in candidates(m):
                    try:
                        t = timed(
                            lambda i, c=cfg, x=x, b=block, qs=qs: fp8_linear_triton(
                                x, *qs[i], b, config=c
                            ),
                            copies,
                            args.iters,
                            1,
                        )[0]
                    except Exception as exc:  # noqa: BLE001 - a config that does not compile
                        print(f"config {cfg} failed: {type(exc).__name__}")
                        continue
                    ratios.setdefault((m, block), {}).setdefault(repr(cfg), []).append(t / bf16[0])
                    if t < best[0]:
                        best = (t, cfg)
            smm = scaled_mm_fn(x, q, s, block)
            smm_ms = (
                timed(lambda i, f=smm: f(), 1, args.iters, args.repeats)[0]
                if smm is not None
                else None
            )
            wbytes = n * k
            row = dict(
                preset=preset,
                n=n,
                k=k,
                block=list(block),
                m=m,
                max_rel_err=rel,
                bf16_ms=bf16[0],
                bf16_range=[bf16[1], bf16[2]],
                fp8_ms=fp8[0],
                fp8_range=[fp8[1], fp8[2]],
                fp8_over_bf16=fp8[0] / bf16[0],
                fp8_weight_gbs=wbytes / (fp8[0] * 1e-3) / 1e9,
                best_ms=best[0],
                best_config=best[1],
                scaled_mm_ms=smm_ms,
            )
            rows.append(row)
            print(row, flush=True)
            cells.append(
                [
                    preset,
                    f"{n}x{k}",
                    f"{block[0]}x{block[1]}",
                    m,
                    f"{bf16[0]:.4f}",
                    f"{fp8[0]:.4f} ({fp8[1]:.4f}-{fp8[2]:.4f})",
                    f"{fp8[0] / bf16[0]:.2f}",
                    f"{row['fp8_weight_gbs']:.0f}",
                    f"{best[0]:.4f} {best[1]}" if args.sweep else "",
                    f"{smm_ms:.4f}" if smm_ms is not None else "n/a",
                    f"{rel:.1e}",
                ]
            )
    table = md_table(
        [
            "preset",
            "N x K",
            "block",
            "M",
            "bf16 ms",
            "fp8 ms (range)",
            "fp8 / bf16",
            "fp8 weight GB/s",
            "best swept config",
            "scaled_mm ms",
            "max rel err vs torch",
        ],
        cells,
    )
    summary = []
    for (m, block), per in sorted(ratios.items()):
        full = {c: r for c, r in per.items() if len(r) == max(map(len, per.values()))}
        cfg, r = min(full.items(), key=lambda kv: statistics.geometric_mean(kv[1]))
        summary.append([m, f"{block[0]}x{block[1]}", f"{statistics.geometric_mean(r):.2f}", cfg])
        print(
            f"M={m} block={block}: best on all shapes {cfg} (geomean fp8/bf16 "
            f"{statistics.geometric_mean(r):.2f})",
            flush=True,
        )
    if summary:
        table += "\n\nOne config for every shape of a block (the sweep's geometric mean):\n\n"
        table += md_table(["M", "block", "geomean fp8 / bf16", "config"], summary)
    write_results(
        args.name, {"rows": rows, "summary": summary}, table, command_line("fp8_gemm", args)
    )


if __name__ == "__main__":
    main()
