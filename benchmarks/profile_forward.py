"""Where a paged forward's time goes: wall time, op counts and host syncs per forward, and the
ops that take the most time, for a prefill chunk batch and a decode batch at a serving position.

python -m benchmarks.profile_forward --model v41-bench --device cuda --dtype bfloat16 \
    --position 4096 --batch 16 [--graphs] [--verify K]

Prints (and writes under benchmarks/results/ with ``--name``) one row per shape: milliseconds
per forward, aten ops, kernel launches and stream synchronizations per step; host syncs inside
the forward; then the top ops by self device time and by self host time. Launch-bound forwards
show many launches and host time well above device time. ``--verify K`` adds speculative
decoding's verify forward at the same position: every sequence a span of K + 1 tokens (its
decode token and K drafts, all logits and residuals, as the engine runs it; the drafts all
accepted, so the next one starts K + 1 later), beside the decode forward of as many sequences:
what the verify step's extra rows cost, op by op. Each decode and verify row also gives the
weight bytes its forward reads (the roofline's floor bytes: routed experts as that batch's
routing activates them), and a line compares the two forwards' time with their bytes: more
rows activate more experts, so even a purely weight-bound verify costs more than a decode.

Two sync counts: "stream syncs" are the profiler's cudaStreamSynchronize/cudaDeviceSynchronize
calls over one whole step (the forward plus the step's own ``argmax().cpu()``, which a sampler
needs); "forward syncs" run one more forward alone under ``torch.cuda.set_sync_debug_mode
("warn")``, capture its warnings (every synchronizing CUDA call: ``.item()``, ``.tolist()``,
``nonzero``, blocking host<->device copies, ...) and count them, each with the innermost atom
source line it came from (listed under the table).
"""

from __future__ import annotations

import argparse
import time
import traceback
import warnings
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from atom.model_api import Span
from atom.models.registry import default_block_size
from benchmarks.common import bound_runtime, command_line, md_table, write_results
from benchmarks.roofline import distinct_experts, weight_counts

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize")


def count_forward_syncs(rt, run) -> tuple[int, Counter]:
    """Synchronizing CUDA calls made inside ``rt.forward`` during ``run()``, by source line
    (torch.cuda.set_sync_debug_mode("warn"), its warnings captured)."""
    sites: Counter = Counter()
    forward = rt.forward

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "/atom/" in f.filename]
        f = frames[-1] if frames else None
        where = f"atom/{f.filename.split('/atom/')[-1]}:{f.lineno} `{f.line}`" if f else filename
        sites[where] += 1

    def counted(*a, **k):
        torch.cuda.synchronize()
        # set the mode before listening: setting it warns once per process that the mode "is
        # a prototype feature and does not yet detect all synchronizing operations", which
        # was counted as the one sync of the first profiled forward (none of atom's frames)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = show
                return forward(*a, **k)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    rt.forward = counted
    try:
        run()
    finally:
        rt.forward = forward
    return sum(sites.values()), sites


def _shape_runs(rt, args, tables, gen):
    """(name, callable running one forward, token rows) for the shapes we profile (rows: None
    for prefill); state is advanced to ``--position`` first so decode reads a realistic number
    of compressed rows."""
    bs, batch = default_block_size(args.model), args.batch
    prompts = torch.randint(0, 300, (batch, args.position), generator=gen)
    for start in range(0, args.position, bs):
        end = min(args.position, start + bs)
        spans = [Span(start, end, i, tables[i]) for i in range(batch)]
        rt.forward(prompts[:, start:end].reshape(-1), spans)
    state = {"pos": args.position}

    def decode():
        pos = state["pos"]
        spans = [Span(pos, pos + 1, i, tables[i]) for i in range(batch)]
        rt.forward(torch.zeros(batch, dtype=torch.int64), spans).argmax(-1).cpu()
        state["pos"] += 1

    chunk_batch = max(1, args.prefill_tokens // bs)

    k1 = getattr(args, "verify", 0) + 1

    def verify():
        pos = state["pos"]
        spans = [Span(pos, pos + k1, i, tables[i]) for i in range(batch)]
        ids = torch.zeros(batch * k1, dtype=torch.int64)
        logits, _ = rt.forward_with_residual(ids, spans, True)
        logits.argmax(-1).cpu()
        state["pos"] += k1

    def prefill():
        # a fresh chunk at the start of each of the first sequences (resets their slots: run last)
        spans = [Span(0, bs, i, tables[i]) for i in range(chunk_batch)]
        rt.forward(prompts[:chunk_batch, :bs].reshape(-1), spans).argmax(-1).cpu()

    graphs = " (graphs)" if getattr(rt, "cuda_graphs", False) else ""
    shapes = [(f"decode batch {batch} at {args.position}{graphs}", decode, batch)]
    if k1 > 1:
        name = f"verify batch {batch} x {k1} rows at {args.position}{graphs}"
        shapes.append((name, verify, batch * k1))
    return shapes + [(f"prefill {chunk_batch} x {bs} tokens", prefill, None)]


def weight_bytes(counts: dict, experts: int, token_rows: int) -> int:
    """Bytes of the weights one forward reads (``benchmarks.roofline``'s floor bytes): the
    dense ones, the routed experts its rows activate and one lookup row per token."""
    return (
        counts["dense_bytes"]
        + experts * counts["per_expert_bytes"]
        + token_rows * counts["lookup_bytes_per_row"]
    )


def verify_ratio(rows: list, floors: dict) -> str:
    """The verify forward against the decode forward: measured time and weight bytes (the
    ratio a weight-bound step would show), or "" without a verify shape."""
    by = {r[0]: r for r in rows}
    decode = next((n for n in floors if n.startswith("decode")), None)
    verify = next((n for n in floors if n.startswith("verify")), None)
    if decode is None or verify is None:
        return ""
    t = by[verify][1] / by[decode][1]
    b = floors[verify] / floors[decode]
    return (
        f"verify / decode: {t:.2f}x the time, {b:.2f}x the weight bytes (a forward bound by "
        "streaming its weights would cost the bytes' ratio)"
    )


def shape_parser(doc: str, prefill_tokens: int, top: int) -> argparse.ArgumentParser:
    """The arguments every forward profile takes (this one and ``profile_components``)."""
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--model", default="v41-mini")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--position", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prefill-tokens", type=int, default=prefill_tokens)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top", type=int, default=top)
    ap.add_argument("--name", default="")
    ap.add_argument(
        "--batch-invariant",
        action="store_true",
        help="the forward in the batch-invariant mode (EngineConfig.batch_invariant)",
    )
    return ap


def profiled_runtime(args, extra_blocks: int = 0, graphs: bool = False):
    """(runtime, one block table per sequence, cuda, sync, profiler activities): a pool of
    ``--batch`` sequences each holding ``--position`` + repeats tokens and ``extra_blocks``;
    the batch-invariant mode on for the process when ``--batch-invariant`` is given."""
    if args.batch_invariant:
        from atom.kernels import invariant

        invariant.configure(True)
    k = getattr(args, "verify", 0)
    # decode and verify forwards advance the sequences past --position: warm-up, repeats,
    # the profiled run and the sync count, each 1 + (k + 1) positions
    ahead = (args.repeats + 5) * (k + 2) + 8  # and the floor's routing step
    per_seq = -(-(args.position + ahead) // default_block_size(args.model))
    per_seq += extra_blocks
    rt = bound_runtime(
        args.model,
        getattr(torch, args.dtype),
        args.device,
        per_seq * args.batch,
        args.batch,
        graphs=graphs,
        speculative_tokens=k,
    )
    tables = [
        torch.arange(i * per_seq, (i + 1) * per_seq, device=args.device) for i in range(args.batch)
    ]
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    return rt, tables, cuda, sync, activities


def main() -> None:
    ap = shape_parser(__doc__, prefill_tokens=2048, top=20)
    ap.add_argument("--graphs", action="store_true", help="decode through CUDA graphs (CUDA)")
    ap.add_argument(
        "--verify",
        type=int,
        default=0,
        help="also a verify forward of K drafts per sequence (K + 1 rows each; module doc)",
    )
    args = ap.parse_args()
    rt, tables, cuda, sync, activities = profiled_runtime(args, graphs=args.graphs)
    rows, tops, site_lines = [], [], []
    counts = weight_counts(rt.model)
    floors = {}  # shape -> weight bytes its forward reads (the roofline's floor bytes)
    for name, run, token_rows in _shape_runs(rt, args, tables, torch.Generator().manual_seed(0)):
        if token_rows is not None:
            floors[name] = weight_bytes(counts, distinct_experts(rt, run), token_rows)
        run()  # warm
        sync()
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            run()
        sync()
        ms = 1000 * (time.perf_counter() - t0) / args.repeats
        with profile(activities=activities) as prof:
            run()
            sync()
        events = prof.key_averages()
        aten = sum(e.count for e in events if e.key.startswith("aten::"))
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel"))
        syncs = sum(e.count for e in events if e.key in SYNC_EVENTS)
        forward_syncs, sites = count_forward_syncs(rt, run) if cuda else (None, Counter())
        gb = round(floors[name] / 1e9, 3) if name in floors else ""
        rows.append([name, round(ms, 2), aten, launches, syncs, forward_syncs, gb])
        print(rows[-1], flush=True)
        site_lines.append(
            f"- {name}: {forward_syncs} host syncs in the forward"
            + "".join(f"\n  - {n} x {w}" for w, n in sites.most_common())
        )
        print(site_lines[-1], flush=True)
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        top = events.table(sort_by=sort, row_limit=args.top, max_name_column_width=48)
        host = events.table(
            sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=48
        )
        tops.append(
            f"## {name}: top by {sort}\n\n```\n{top}\n```\n\n"
            f"## {name}: top by host time\n\n```\n{host}\n```\n"
        )
        print(tops[-1], flush=True)
    table = md_table(
        [
            "shape",
            "ms/forward",
            "aten ops",
            "kernel launches",
            "stream syncs (step)",
            "host syncs (forward)",
            "weight GB read",
        ],
        rows,
    )
    ratio = verify_ratio(rows, floors)
    if ratio:
        print(ratio, flush=True)
        table += "\n\n" + ratio
    table += (
        "\n\nstream syncs (step): the profiler's cudaStreamSynchronize/cudaDeviceSynchronize "
        "over one step (the forward and the step's argmax().cpu()); host syncs (forward): one "
        "forward under torch.cuda.set_sync_debug_mode('warn'), warnings counted, by source "
        "line; weight GB read: the bytes of every weight the forward reads at its stored dtype, "
        "routed experts as the batch's routing activates them (benchmarks/roofline.py's floor "
        "bytes):\n\n" + "\n".join(site_lines)
    )
    if args.name:
        cmd = command_line("profile_forward", args)
        print(
            write_results(
                args.name,
                {"model": args.model, "rows": rows, "verify_over_decode": ratio},
                table + "\n\n" + "\n".join(tops),
                cmd,
            )
        )
    else:
        print(table)


if __name__ == "__main__":
    main()
