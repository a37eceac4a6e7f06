"""Launch configurations of the FP4 expert GEMM (atom/kernels/_fp4_gemm_triton.py) on a preset's
routed-expert shapes, against the bf16 grouped GEMM the bf16 model runs (``torch._grouped_mm``
on the dequantized weights), side by side in one run.

For each candidate ``Fp4Config`` (BM, BN, BK, warps, stages, K loop, split of K), the device ms of
one layer's three expert products (gate, up: [G, inter, hidden]; down: [G, hidden, inter]) times the
preset's MoE layers, at each ``--tokens`` (tokens x top-k rows routed by a seeded random top-k, the
same routing for every candidate), the weight bytes it reads per ms (the FP4 bytes of the experts
the routing uses), and whether it equals the torch expression (float64 torch reference, bf16
tolerance). Times are medians of CUDA-event timings over ``--iters`` replays of
a CUDA graph that calls each of several weight copies once (the copies exceed the L2, as a
decode step's layers do), over ``--repeats`` repeats; the spread is the repeats' range.

    python -m benchmarks.fp4_gemm_sweep --model v41-bench-fp8 --tokens 16 4096
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.common import command_line, graph_median, md_table, write_results

# (BM, BN, BK, warps, stages, pairs, split); the first is CONFIG's bf16 launch at 2b6a2cb
CANDIDATES = [
    (64, 64, 64, 4, 3, False, 1),
    (64, 128, 64, 4, 3, False, 1),
    (64, 64, 128, 4, 3, False, 1),
    (64, 64, 64, 4, 3, False, 4),
    (64, 64, 64, 4, 3, True, 1),
    (64, 128, 64, 4, 3, True, 1),
    (64, 128, 128, 4, 3, True, 1),
    (64, 256, 64, 8, 3, True, 1),
    (64, 64, 128, 4, 4, True, 1),
    (64, 64, 128, 4, 3, True, 2),
    (64, 128, 128, 4, 3, True, 4),
    (32, 128, 128, 4, 3, True, 1),
    (16, 128, 128, 4, 3, True, 1),
    (16, 64, 256, 4, 3, True, 2),
    (16, 128, 128, 4, 3, True, 4),
]


def _candidate(text: str) -> tuple:
    """BM,BN,BK,warps,stages,pairs,split -> the tuple ``Fp4Config`` takes."""
    parts = [int(v) for v in text.split(",")]
    if len(parts) != 7:
        raise argparse.ArgumentTypeError(f"{text!r}: want BM,BN,BK,warps,stages,pairs,split")
    return (*parts[:5], bool(parts[5]), parts[6])


def expert_shapes(model: str) -> tuple[dict, int, int, int]:
    """({name: (G, N, K)}, MoE layers, top-k, hidden) of the preset's routed experts."""
    from atom.models.registry import resolve_config

    cfg, _ = resolve_config(model)
    g, inter, hidden = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    shapes = {"gate": (g, inter, hidden), "up": (g, inter, hidden), "down": (g, hidden, inter)}
    return shapes, cfg.num_hidden_layers, cfg.num_experts_per_tok, hidden


def routed_ends(tokens: int, groups: int, top_k: int, seed: int = 0) -> torch.Tensor:
    """Cumulative row counts per expert of ``tokens`` tokens each routed to ``top_k`` distinct
    experts at random (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    choice = torch.rand(tokens, groups, generator=gen).topk(top_k, dim=-1).indices
    return torch.bincount(choice.flatten(), minlength=groups).cumsum(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="v41-bench-fp8")
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 4096])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--l2-mib", type=int, default=128, help="weight copies per shape exceed this")
    ap.add_argument("--name", default="fp4_gemm_sweep_h200")
    ap.add_argument(
        "--candidates",
        nargs="+",
        type=_candidate,
        default=CANDIDATES,
        help="launches to measure, each BM,BN,BK,warps,stages,pairs(0/1),split",
    )
    args = ap.parse_args()
    from atom.kernels import _fp4_gemm_triton as k
    from atom.kernels.fp4_gemm import dequantized, fp4_grouped_linear_torch

    shapes, layers, top_k, hidden = expert_shapes(args.model)
    print(f"{layers} layers x {shapes}, top-{top_k}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights, dense, inputs = {}, {}, {}
    for name, (g, n, kd) in shapes.items():
        copies = max(1, -(-args.l2_mib * 2**20 // (g * n * kd // 2)))
        weights[name] = [
            (
                torch.randint(0, 256, (g, n, kd // 2), device="cuda", dtype=torch.uint8),
                torch.randint(122, 131, (g, n, kd // 32), device="cuda", dtype=torch.uint8),
            )
            for _ in range(copies)
        ]
        dense[name] = [dequantized(p, s, torch.bfloat16) for p, s in weights[name][:2]]
        rows = max(args.tokens) * top_k
        inputs[name] = torch.randn(rows, kd, device="cuda", generator=gen).bfloat16()
    ends = {t: routed_ends(t, shapes["gate"][0], top_k).cuda() for t in args.tokens}
    used = {t: int((ends[t].diff(prepend=ends[t][:1] * 0) > 0).sum()) for t in args.tokens}

    def total(call):
        """({tokens: ms of one model's expert products, median over repeats}, repeats)."""
        per = []
        for _ in range(args.repeats):
            ms = {t: 0.0 for t in args.tokens}
            for name in shapes:
                for t in args.tokens:
                    x = inputs[name][: t * top_k]
                    ws = weights[name] if call is not None else dense[name]
                    fn = call(x, ws, ends[t]) if call is not None else _dense(x, ws, ends[t])
                    ms[t] += layers * graph_median(fn, len(ws), args.iters)
            per.append(ms)
        return {t: statistics.median(p[t] for p in per) for t in args.tokens}, per

    def _dense(x, ws, e):
        offs = e.to(torch.int32)
        return lambda i: torch._grouped_mm(x, ws[i].transpose(1, 2), offs=offs)

    def fp4_call(config):
        def make(x, ws, e):
            tiles = k.group_tiles_for(e, x.shape[0], x.dtype, config)
            return lambda i: k.fp4_grouped_linear_triton(x, *ws[i], e, tiles, config)

        return make

    def read_gb_per_s(t: int, ms: float) -> float:
        g = shapes["gate"][0]
        fp4 = sum(n * kd // 2 + n * kd // 32 for _, n, kd in shapes.values()) * layers
        return fp4 * used[t] / g / ms / 1e6

    head = ["(BM, BN, BK, warps, stages, pairs, split)"]
    head += [f"{t} tokens ms (vs bf16)" for t in args.tokens]
    head += [f"{t} tokens GB/s" for t in args.tokens] + ["repeats' range", "equals torch"]
    command = command_line("fp4_gemm_sweep", args)
    rows: list[list] = []
    data: dict = {"shapes": shapes, "layers": layers, "top_k": top_k, "experts_used": used}

    def save() -> None:  # after every configuration: a run cut short keeps what it measured
        table = (
            f"Routed experts of {args.model}: {layers} layers x {shapes}, top-{top_k}; "
            f"experts the routing uses: {used}.\n\n" + md_table(head, rows)
        )
        write_results(args.name, data, table, command)

    base, _ = total(None)
    data["bf16_grouped_mm"] = base
    rows.append(["bf16 torch._grouped_mm"] + [round(base[t], 3) for t in args.tokens])
    rows[-1] += [""] * (len(head) - len(rows[-1]))
    data["configs"] = []
    for cand in args.candidates:
        config = k.Fp4Config(*cand)
        try:
            got, per = total(fp4_call(config))
        except Exception as exc:  # noqa: BLE001 - a config the GPU cannot launch
            print(f"{cand}: {type(exc).__name__}: {exc}", flush=True)
            continue
        equal = True
        for name in shapes:
            t = min(args.tokens)
            x, (p, s) = inputs[name][: t * top_k], weights[name][0]
            y = k.fp4_grouped_linear_triton(x, p, s, ends[t], None, config).double()
            want = fp4_grouped_linear_torch(x.double(), p, s, ends[t])
            equal &= bool((y - want).abs().max() <= 0.02 * want.abs().max())
        spread = [f"{min(q[t] for q in per):.3f}-{max(q[t] for q in per):.3f}" for t in args.tokens]
        rows.append(
            [str(cand)]
            + [f"{got[t]:.3f} ({got[t] / base[t]:.2f}x)" for t in args.tokens]
            + [f"{read_gb_per_s(t, got[t]):.0f}" for t in args.tokens]
            + [" / ".join(spread), "yes" if equal else "NO"]
        )
        data["configs"].append({"config": cand, "ms": got, "equal": equal, "repeats": per})
        print(rows[-1], flush=True)
        save()
    save()
    print(md_table(head, rows))


if __name__ == "__main__":
    main()
