"""Offline serving on CPU: no prefix reuse vs HBM prefix caching, side by side in one run.

    python -m benchmarks.serving_offline [--requests 16] [--prefix-len 1024] [--tail-len 256]

Every request shares one of ``--prefixes`` long prefixes and has a unique tail; all arrive at
once (offline). Reports req/s, TTFT (from arrival) and where prompt tokens came from.
"""

from __future__ import annotations

import argparse
import time

from atom import LLM, SamplingParams
from benchmarks.common import command_line, md_table, write_results
from benchmarks.workload import shared_prefix_prompts, summarize


def run_arm(name: str, prompts, args, **engine) -> dict:
    llm = LLM(
        args.model,
        device=args.device,
        max_num_seqs=args.concurrency,
        max_num_batched_tokens=args.max_batched_tokens,
        num_blocks=args.num_blocks,
        **engine,
    )
    # warm up outside the measurement (first-call allocations), then start clean
    llm.generate([[1] * 8], SamplingParams(max_tokens=2, ignore_eos=True))
    llm.engine.reset_prefix_cache()
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    res = {"arm": name, **summarize(outs, wall), **{"engine": engine}}
    print(res, flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="v41-mini")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--tail-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-batched-tokens", type=int, default=1024)
    ap.add_argument("--num-blocks", type=int, default=256)
    ap.add_argument("--name", default="serving_offline_cpu")
    args = ap.parse_args()
    prompts = shared_prefix_prompts(args.requests, args.prefixes, args.prefix_len, args.tail_len)
    arms = [
        run_arm("no prefix reuse", prompts, args, enable_prefix_caching=False),
        run_arm("HBM prefix caching", prompts, args, enable_prefix_caching=True),
    ]
    base = arms[0]["req_per_s"]
    rows = [
        [
            a["arm"],
            a["req_per_s"],
            f"{a['req_per_s'] / base:.2f}x",
            a["ttft_p50_ms"],
            a["ttft_mean_ms"],
            a["hbm_hit_tokens"],
            a["tier_hit_tokens"],
            a["computed_prompt_tokens"],
        ]
        for a in arms
    ]
    table = md_table(
        [
            "arm",
            "req/s",
            "vs no reuse",
            "TTFT p50 ms",
            "TTFT mean ms",
            "HBM tokens",
            "tier tokens",
            "computed tokens",
        ],
        rows,
    )
    cmd = command_line("serving_offline", args)
    print(table)
    print(write_results(args.name, {"args": vars(args), "arms": arms}, table, cmd))


if __name__ == "__main__":
    main()
