"""Prefill and decode throughput of the paged forward (v41-mini on CPU by default).

python -m benchmarks.model_forward [--model v41-mini] [--device cpu] [--dtype float32]
"""

from __future__ import annotations

import argparse
import time

import torch

from atom.model_api import Span
from atom.models.registry import default_block_size
from benchmarks.common import bound_runtime, md_table, write_results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="v41-mini")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--name", default="model_forward_cpu")
    args = ap.parse_args()
    bs = default_block_size(args.model)
    max_batch = max(args.batch)
    blocks_per_seq = -(-(args.prompt_len + args.decode_steps) // bs)
    rt = bound_runtime(
        args.model, getattr(torch, args.dtype), args.device, blocks_per_seq * max_batch, max_batch
    )
    gen = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    rows = []
    for batch in args.batch:
        tables = [
            torch.arange(i * blocks_per_seq, (i + 1) * blocks_per_seq, device=args.device)
            for i in range(batch)
        ]
        prompts = torch.randint(0, 300, (batch, args.prompt_len), generator=gen)
        sync()
        t0 = time.perf_counter()
        for start in range(0, args.prompt_len, bs):
            end = min(args.prompt_len, start + bs)
            spans = [Span(start, end, i, tables[i]) for i in range(batch)]
            rt.forward(prompts[:, start:end].reshape(-1), spans)
        sync()
        prefill_s = time.perf_counter() - t0
        nxt = torch.zeros(batch, dtype=torch.int64)
        t0 = time.perf_counter()
        for step in range(args.decode_steps):
            pos = args.prompt_len + step
            spans = [Span(pos, pos + 1, i, tables[i]) for i in range(batch)]
            nxt = rt.forward(nxt, spans).argmax(-1).cpu()
        sync()
        decode_s = time.perf_counter() - t0
        rows.append(
            {
                "batch": batch,
                "prefill_tokens_per_s": round(batch * args.prompt_len / prefill_s, 1),
                "decode_tokens_per_s": round(batch * args.decode_steps / decode_s, 1),
                "decode_step_ms": round(1000 * decode_s / args.decode_steps, 2),
            }
        )
        print(rows[-1], flush=True)
    table = md_table(
        ["batch", "prefill tok/s", "decode tok/s", "decode step ms"],
        [
            [r["batch"], r["prefill_tokens_per_s"], r["decode_tokens_per_s"], r["decode_step_ms"]]
            for r in rows
        ],
    )
    cmd = "python -m benchmarks.model_forward " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items()
    )
    print(
        write_results(
            args.name,
            {"model": args.model, "dtype": args.dtype, "prompt_len": args.prompt_len, "rows": rows},
            table,
            cmd,
        )
    )


if __name__ == "__main__":
    main()
