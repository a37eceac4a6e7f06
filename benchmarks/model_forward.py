"""Prefill and decode throughput of the paged forward (v41-mini on CPU by default).

python -m benchmarks.model_forward [--model v41-mini] [--device cpu] [--dtype float32]

``--graphs both`` (CUDA) times the decode step with decode CUDA graphs off and on in the same
run, on the same sequences: after the prefill, each mode is warmed (its graphs captured), then
``--repeats`` rounds alternate ``--decode-steps`` steps eager and ``--decode-steps`` with
graphs; a step is the forward plus the greedy pick's ``argmax().cpu()``. The table gives the
median step time over the rounds and the range (min-max).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from atom.model_api import Span
from atom.models.registry import default_block_size
from benchmarks.common import bound_runtime, command_line, md_table, write_results

MODES = {"off": [False], "on": [True], "both": [False, True]}


def _spread(ms: list[float]) -> dict:
    return {
        "median": round(statistics.median(ms), 2),
        "min": round(min(ms), 2),
        "max": round(max(ms), 2),
        "rounds": [round(m, 2) for m in ms],
    }


def _decode_ms(rt, state: dict, tables: list[torch.Tensor], n: int, sync) -> float:
    """ms per step of n greedy decode steps of every sequence in ``tables`` (from
    ``state["pos"]``, feeding ``state["next"]``)."""
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        pos = state["pos"]
        spans = [Span(pos, pos + 1, i, t) for i, t in enumerate(tables)]
        state["next"] = rt.forward(state["next"], spans).argmax(-1).cpu()
        state["pos"] += 1
    sync()
    return 1000 * (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="v41-mini")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--graphs", default="off", choices=list(MODES))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--name", default="model_forward_cpu")
    args = ap.parse_args()
    modes = MODES[args.graphs]
    bs = default_block_size(args.model)
    max_batch = max(args.batch)
    steps = args.decode_steps * (args.repeats * len(modes)) + 2 * len(modes)
    blocks_per_seq = -(-(args.prompt_len + steps) // bs)
    rt = bound_runtime(
        args.model,
        getattr(torch, args.dtype),
        args.device,
        blocks_per_seq * max_batch,
        max_batch,
        graphs=any(modes),
    )
    if any(modes) and getattr(rt, "graphs", None) is None:
        raise SystemExit(f"--graphs {args.graphs}: this runtime on {args.device} has no graphs")
    gen = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    rows = []
    for batch in args.batch:
        # host block tables, as the engine hands them (uploaded with the forward's indices)
        tables = [torch.arange(i * blocks_per_seq, (i + 1) * blocks_per_seq) for i in range(batch)]
        prompts = torch.randint(0, 300, (batch, args.prompt_len), generator=gen)
        sync()
        t0 = time.perf_counter()
        for start in range(0, args.prompt_len, bs):
            end = min(args.prompt_len, start + bs)
            spans = [Span(start, end, i, tables[i]) for i in range(batch)]
            rt.forward(prompts[:, start:end].reshape(-1), spans)
        sync()
        prefill_s = time.perf_counter() - t0
        state = {"pos": args.prompt_len, "next": torch.zeros(batch, dtype=torch.int64)}

        def decode(n: int, graphs: bool, state=state, tables=tables) -> float:
            if any(modes):
                rt.cuda_graphs = graphs
            return _decode_ms(rt, state, tables, n, sync)

        if len(modes) == 1 and args.repeats == 1:  # the original measurement, no warm-up
            per_mode = {modes[0]: [decode(args.decode_steps, modes[0])]}
        else:
            for graphs in modes:
                decode(2, graphs)  # warm: captures this width's graph
            per_mode = {g: [] for g in modes}
            for _ in range(args.repeats):
                for graphs in modes:
                    per_mode[graphs].append(decode(args.decode_steps, graphs))
        step_ms = statistics.median(per_mode[modes[0]])
        row = {
            "batch": batch,
            "position": args.prompt_len,
            "prefill_tokens_per_s": round(batch * args.prompt_len / prefill_s, 1),
            "decode_tokens_per_s": round(batch * 1000 / step_ms, 1),
            "decode_step_ms": round(step_ms, 2),
        }
        for graphs in modes:
            row["decode_step_ms_" + ("graphs" if graphs else "eager")] = _spread(per_mode[graphs])
        if len(modes) == 2:
            eager_ms, graph_ms = (statistics.median(per_mode[g]) for g in modes)
            row["graphs_speedup"] = round(eager_ms / graph_ms, 2)
            row["captured"] = sorted(rt.graphs.graphs)
        rows.append(row)
        print(row, flush=True)
    headers = ["batch", "prefill tok/s", "decode tok/s", "decode step ms"]
    cells = [
        [r["batch"], r["prefill_tokens_per_s"], r["decode_tokens_per_s"], r["decode_step_ms"]]
        for r in rows
    ]
    if len(modes) == 2:
        headers = ["batch", "position", "prefill tok/s"]
        headers += ["eager step ms (range)", "graphs step ms (range)", "speedup"]
        cells = []
        for r in rows:
            e, g = r["decode_step_ms_eager"], r["decode_step_ms_graphs"]
            cells.append(
                [
                    r["batch"],
                    r["position"],
                    r["prefill_tokens_per_s"],
                    f"{e['median']} ({e['min']}-{e['max']})",
                    f"{g['median']} ({g['min']}-{g['max']})",
                    f"{r['graphs_speedup']}x",
                ]
            )
    table = md_table(headers, cells)
    if len(modes) == 2:
        table += (
            f"\n\nStep = forward + argmax().cpu(); median over {args.repeats} rounds of "
            f"{args.decode_steps} steps per mode, alternating eager and graphs on the same "
            "sequences (positions advance by one per step); range = min-max of the rounds."
        )
    cmd = command_line("model_forward", args)
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
