"""Tensor parallelism: greedy agreement and speed of tensor_parallel_size N against one rank.

    python -m benchmarks.tp --model v41-bench --device cuda --tp 2       # two GPUs
    python -m benchmarks.tp --model v41-tiny --device cpu --tp 2          # gloo, CPU

One engine per arm (TP=1, then TP=N; both with decode graphs, or both eager with
``--graphs off``: at TP=N every rank captures and replays its own graphs) generates
``--output-len`` greedy tokens for ``--prompts`` random prompts, ``--repeats`` times.
``--all-reduce both`` runs the TP=N arm twice, summing through NCCL and through the one-shot
kernel (``tp_all_reduce``), side by side. Reported per arm: wall time of the generate call
(median, spread), output tokens/s, and for TP=N the fraction of sequences whose tokens equal
TP=1's and, where they part, the first parting output and TP=1's top-2 logprob gap there (bf16
splits change rounding, which decides near-ties).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from atom import LLM, SamplingParams
from benchmarks.common import md_table, write_results


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tp", description=__doc__)
    ap.add_argument("--model", default="v41-bench")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--graphs", choices=("on", "off"), default="on")
    ap.add_argument(
        "--all-reduce",
        choices=("group", "one_shot", "both"),
        default="group",
        help="tp_all_reduce of the TP=N arm; both: one TP=N arm each, side by side",
    )
    ap.add_argument("--name", default=None)
    return ap.parse_args(argv)


def arm(args, tp: int, prompts, params, all_reduce: str = "group"):
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    blocks = -(-(args.prompt_len + args.output_len) // 256) * args.concurrency + 16
    llm = LLM(
        args.model,
        device=args.device,
        dtype=dtype,
        block_size=256,
        num_blocks=blocks,
        max_num_seqs=args.concurrency,
        max_num_batched_tokens=4096,
        cuda_graphs=args.graphs == "on",
        enable_prefix_caching=False,
        tensor_parallel_size=tp,
        tp_all_reduce=all_reduce,
    )
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    times, outs = [], None
    for _ in range(args.repeats):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        times.append(time.perf_counter() - t0)
    llm.shutdown()
    return times, outs


def main(argv=None) -> int:
    args = parse(argv)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, 250, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)
    ]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, logprobs=2)
    kinds = ("group", "one_shot") if args.all_reduce == "both" else (args.all_reduce,)
    t1, one = arm(args, 1, prompts, params)
    arms = {kind: arm(args, args.tp, prompts, params, kind) for kind in kinds}
    tokens = args.prompts * args.output_len
    rows, agreement, parts_by = [], {}, {}
    med1 = statistics.median(t1)
    rows.append(
        [1, "-", f"{med1:.3f} ({min(t1):.3f}-{max(t1):.3f})", f"{tokens / med1:.1f}", "1.00x"]
    )
    for kind, (times, many) in arms.items():
        same, parts = 0, []
        for a, b in zip(one, many):
            j = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
            if j is None:
                same += 1
                continue
            (_, lp1), (_, lp2) = a.logprobs[j].top[:2]
            parts.append({"output": j, "top2_gap": lp1 - lp2})
        agreement[kind], parts_by[kind] = f"{same}/{args.prompts}", parts
        med = statistics.median(times)
        rows.append(
            [
                args.tp,
                kind,
                f"{med:.3f} ({min(times):.3f}-{max(times):.3f})",
                f"{tokens / med:.1f}",
                f"{med1 / med:.2f}x",
            ]
        )
    table = md_table(
        ["TP", "all-reduce", "generate s (median, min-max)", "output tok/s", "speed vs TP=1"], rows
    )
    table += f"\n\nDecode graphs: {args.graphs} in every arm."
    for kind, parts in parts_by.items():
        table += (
            f"\n\nGreedy agreement TP={args.tp} ({kind}) vs TP=1: {agreement[kind]} sequences "
            f"equal; parting points (output index, TP=1 top-2 logprob gap): "
            f"{[(p['output'], round(p['top2_gap'], 4)) for p in parts]}"
        )
    data = dict(
        model=args.model,
        tp=args.tp,
        times={"1": t1, **{f"{args.tp}_{kind}": arms[kind][0] for kind in kinds}},
        agreement=agreement,
        parts=parts_by,
        prompts=args.prompts,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        graphs=args.graphs,
    )
    name = args.name or f"tp{args.tp}_{'h200' if args.device.startswith('cuda') else 'cpu'}"
    print(table)
    print(write_results(name, data, table, "python -m benchmarks.tp " + " ".join(sys.argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
