"""Speculative decoding: acceptance and decode speed with the model's own drafter.

    python -m benchmarks.speculative --device cpu --ks 0 1 2 3
    python -m benchmarks.speculative --model v41-tiny-draft --device cpu   # random weights

Default model: models/v41-recall (trained target + its trained DSpark stage, which drafts blocks
of 3, so k <= 3: tools/train_dspark.py) on recall-task prompts (benchmarks/recall_task.py, the
held-out "eval" split). For each k (0 = plain decoding) one
engine generates ``--output-len`` greedy tokens for every prompt; each k runs ``--repeats``
times after a warm-up, arms interleaved (k0, k1, ..., k0, k1, ...) so that drift hits every arm
alike. Reported: decode tokens/s (output tokens / wall time of the generate call, prompts
included: they are short next to the output), its ratio to k = 0 per repeat (median and
spread), drafts verified, acceptance rate, mean tokens per verify span (accepted + 1), engine
steps, wall ms per engine step and its ratio to the first arm's (what a step with drafts costs
against a plain one: prefill steps included, a few per run), and whether every output equals
the first arm's (greedy must, in fp32; in bf16 up to near-ties). ``--oracle-acceptance A``
replaces the drafter's proposals by the true greedy token with probability A, the draft layers
still running (``benchmarks/oracle_drafts.py``). ``--eager-baseline`` adds k = 0 without
decode CUDA graphs ("0e"): verify spans run eagerly, so on a GPU it separates what the drafts
gain from what the graphs gain. ``--host-walk`` adds each k > 0 walking its drafts on the host
("kh": ``Engine.device_walk`` off), so the device walk's saving is measured side by side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from atom import LLM, SamplingParams
from benchmarks.common import md_table, write_results
from benchmarks.recall_task import split
from benchmarks.shared_weights import share

RECALL = Path(__file__).resolve().parent.parent / "models" / "v41-recall"


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.speculative", description=__doc__)
    ap.add_argument("--model", default=str(RECALL))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=192)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--eager-baseline",
        action="store_true",
        help="also run k=0 without CUDA graphs (verify spans run eagerly; this isolates the "
        "drafts' gain from the graphs' gain)",
    )
    ap.add_argument(
        "--draft-adapter",
        default=None,
        help="a trained draft layer's adapter file (tools/train_draft_adapter.py) for the model's "
        "draft layer",
    )
    ap.add_argument(
        "--oracle-acceptance",
        type=float,
        default=None,
        help="replace the drafter's proposals by the true greedy token with this probability "
        "(benchmarks/oracle_drafts.py; the draft layers still run): what drafts of a given "
        "acceptance do on a model whose own drafter is untrained. Needs k=0 among --ks",
    )
    ap.add_argument(
        "--batch-invariant",
        action="store_true",
        help="every arm in batch-invariant mode: a verify row computes what a decode row does, "
        "so in bf16 on a random-weight model (near-ties everywhere) drafts do not part the "
        "outputs from k=0's, which --oracle-acceptance needs (its truth is k=0's output)",
    )
    ap.add_argument(
        "--host-walk",
        action="store_true",
        help="also run each k > 0 with the accept walk and draft layers' proposals read back "
        'per depth on the host ("kh"), the path before the device walk: what the device '
        "walk saves",
    )
    ap.add_argument("--name", default=None, help="results name (default speculative_<device>)")
    return ap.parse_args(argv)


def prompts_for(args) -> list[list[int]]:
    if Path(args.model).is_dir() and "recall" in Path(args.model).name:
        return [ex.prompt for ex in split("eval", args.prompts, args.prompt_len)]
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(0, 256, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)
    ]


def build(args, arm: str) -> LLM:
    k, eager = int(arm.rstrip("eh")), arm.endswith("e")
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    blocks = -(-(args.prompt_len + args.output_len + 8) // 256) * args.concurrency + 64
    llm = LLM(
        args.model,
        device=args.device,
        dtype=dtype,
        block_size=256,
        num_blocks=blocks,
        max_num_seqs=args.concurrency,
        max_num_batched_tokens=max(2048, args.prompt_len),
        speculative_tokens=k,
        cuda_graphs=not eager,
        draft_adapter=args.draft_adapter if k else None,
        batch_invariant=args.batch_invariant,
    )
    llm.engine.device_walk = not arm.endswith("h")
    return llm


def main(argv=None) -> int:
    args = parse(argv)
    prompts = prompts_for(args)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    arms = [str(k) for k in args.ks] + (["0e"] if args.eager_baseline else [])
    if args.host_walk:
        arms += [f"{k}h" for k in args.ks if k]
    engines: dict[str, LLM] = {}
    for arm in arms:  # one copy of the weights for all arms (each built from the same seed)
        engines[arm] = build(args, arm)
        if len(engines) > 1:
            first = next(iter(engines.values()))
            share(first.engine.runtime.model, engines[arm].engine.runtime.model)
    # warm-up: allocations, kernels, and the graphs of every batch and table width a repeat
    # meets (at 141f422 a warm-up of 6 tokens left the first repeat capturing: k=1 ran 0.78x
    # there against 1.19x in the median)
    for llm in engines.values():
        llm.generate(prompts[: args.concurrency], params)
    if args.oracle_acceptance is not None:
        from benchmarks.oracle_drafts import OracleDrafter

        if "0" not in engines:
            raise SystemExit("--oracle-acceptance needs k=0 among --ks (its outputs are the truth)")
        truth = {
            tuple(p): list(p) + list(o.token_ids)
            for p, o in zip(prompts, engines["0"].generate(prompts, params))
        }
        vocab = engines["0"].engine.runtime.vocab_size
        for arm, llm in engines.items():
            if int(arm.rstrip("eh")):
                llm.engine.drafter = OracleDrafter(
                    llm.engine.drafter, truth, args.oracle_acceptance, vocab=vocab
                )
    times = {arm: [] for arm in arms}
    outputs, stats, steps = {}, {}, {}
    for r in range(args.repeats):
        for k, llm in engines.items():
            before, spec = llm.engine.steps, llm.engine.spec_stats
            counts = (spec.proposed, spec.accepted, spec.verifies) if spec else None
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            times[k].append(time.perf_counter() - t0)
            steps[k] = llm.engine.steps - before
            outputs[k] = [o.token_ids for o in outs]
            if spec is not None:
                proposed, accepted, verifies = (
                    now - then
                    for now, then in zip((spec.proposed, spec.accepted, spec.verifies), counts)
                )
                stats[k] = {
                    "draft_tokens": proposed,
                    "accepted_tokens": accepted,
                    "verify_spans": verifies,
                    "acceptance_rate": accepted / max(1, proposed),
                    "tokens_per_verify": (accepted + verifies) / max(1, verifies),
                }
            print(f"repeat {r} k={k}: {times[k][-1]:.3f} s, {steps[k]} steps", file=sys.stderr)
    total = sum(len(o) for o in outputs[arms[0]])
    base = arms[0]
    rows, data = [], {"arms": {}}
    for k in arms:
        ratio = [times[base][i] / times[k][i] for i in range(args.repeats)]
        same = sum(a == b for a, b in zip(outputs[k], outputs[base]))
        s = stats.get(k, {})
        ms_step = 1000 * statistics.median(times[k]) / max(1, steps[k])
        arm = {
            "seconds": times[k],
            "tokens_per_s_median": total / statistics.median(times[k]),
            "ms_per_step": ms_step,
            "speedup_vs_first_arm": ratio,
            "steps": steps[k],
            "outputs_equal_to_first_arm": f"{same}/{len(prompts)}",
            **s,
        }
        data["arms"][str(k)] = arm
        rows.append(
            [
                k,
                f"{arm['tokens_per_s_median']:.1f}",
                f"{statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f})",
                steps[k],
                f"{ms_step:.2f}",
                f"{ms_step / (1000 * statistics.median(times[base]) / max(1, steps[base])):.2f}",
                s.get("draft_tokens", 0),
                f"{s.get('acceptance_rate', 0.0):.3f}",
                f"{s.get('tokens_per_verify', 1.0):.2f}",
                arm["outputs_equal_to_first_arm"],
            ]
        )
    table = md_table(
        [
            "k (e: k=0 without graphs; h: walk on the host)",
            "output tok/s (median)",
            f"speed-up vs k={base} (median, min-max)",
            "steps",
            "ms / step",
            f"step cost vs k={base}",
            "drafts verified",
            "acceptance",
            "tokens / verify",
            f"outputs = k={base}",
        ],
        rows,
    )
    data.update(
        model=args.model,
        draft_adapter=args.draft_adapter,
        oracle_acceptance=args.oracle_acceptance,
        batch_invariant=args.batch_invariant,
        prompts=len(prompts),
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        concurrency=args.concurrency,
        repeats=args.repeats,
    )
    name = args.name or f"speculative_{'h200' if args.device.startswith('cuda') else 'cpu'}"
    command = "python -m benchmarks.speculative " + " ".join(argv or sys.argv[1:])
    print(table)
    print(write_results(name, data, table, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
