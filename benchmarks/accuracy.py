"""The two-pass accuracy job on the trained recall model (models/v41-recall).

    python -m benchmarks.accuracy [--prompts 256] [--length 384] [--preamble 256] [--record]

A fixed evaluation set (seeded, disjoint from training) is run twice per configuration, each
pass on a fresh engine:
  tier only     pass 1 fills an LMCache server; pass 2 starts from an empty pool, so every
                reusable prefix comes from the tier;
  HBM + tier    a long shared preamble precedes every prompt; pass 2 first computes the
                preamble alone (HBM), then the prompts: preamble from HBM, the rest from the tier;
  control       the tier is off in both passes (pass 2 recomputes everything).
Greedy answers of one token; accuracy = the right value token. The job fails (exit 1) if any pass-2
answer differs from pass 1, or if the model's accuracy falls below its recorded value
(models/v41-recall/accuracy.json) by more than noise (3 binomial sigmas + 1 point).
``--record`` writes that record from this run instead of checking it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from atom import LLM, SamplingParams
from atom.kv_transfer.offload.lmcache_server import LMCacheServer
from benchmarks.common import md_table, write_results
from benchmarks.recall_task import preamble as make_preamble
from benchmarks.recall_task import split

MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "v41-recall"
GREEDY = SamplingParams(max_tokens=1, ignore_eos=True)  # the answer is one token


def engine(args, **kw) -> LLM:
    return LLM(
        str(args.model),
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.concurrency,
        max_num_batched_tokens=args.batched_tokens,
        num_blocks=args.pool_blocks,
        **kw,
    )


def run_pass(llm: LLM, prompts: list[list[int]]):
    t0 = time.perf_counter()
    outs = llm.generate(prompts, GREEDY)
    return outs, time.perf_counter() - t0


def accuracy(outs, answers) -> float:
    return sum(o.token_ids == a for o, a in zip(outs, answers)) / len(answers)


def two_pass(name: str, args, prompts, answers, server: LMCacheServer | None, warm=None):
    tier = {"offload": "lmcache_mp", "lmcache_url": server.url} if server else {}
    first = engine(args, **tier)
    out1, t1 = run_pass(first, prompts)
    first.shutdown()
    second = engine(args, **tier)
    if warm is not None:  # put the shared preamble in HBM
        second.generate([warm], SamplingParams(max_tokens=1, ignore_eos=True))
    out2, t2 = run_pass(second, prompts)
    second.shutdown()
    same = [a.token_ids == b.token_ids for a, b in zip(out1, out2)]
    row = {
        "config": name,
        "accuracy_pass1": accuracy(out1, answers),
        "accuracy_pass2": accuracy(out2, answers),
        "pass2_hbm_tokens": sum(o.hbm_hit_tokens for o in out2),
        "pass2_tier_tokens": sum(o.tier_hit_tokens for o in out2),
        "pass2_computed_tokens": sum(o.computed_prompt_tokens for o in out2),
        "pass2_prompt_tokens": sum(o.prompt_tokens for o in out2),
        "all_pass2_equal_pass1": all(same),
        "pass2_differing": sum(1 for s in same if not s),
        "pass1_s": round(t1, 1),
        "pass2_s": round(t2, 1),
    }
    print(row, flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=str(MODEL_DIR))
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--length", type=int, default=384)
    ap.add_argument("--preamble", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--batched-tokens", type=int, default=4096)
    ap.add_argument("--pool-blocks", type=int, default=256)
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--name", default="accuracy_cpu")
    args = ap.parse_args()
    examples = split("eval", args.prompts, args.length)
    prompts = [e.prompt for e in examples]
    answers = [e.answer for e in examples]
    preamble = make_preamble(args.preamble)
    with LMCacheServer(chunk_size=256, l1_size_gb=1.0, shared_l1=True) as server:
        rows = [
            two_pass("tier only", args, prompts, answers, server),
            two_pass(
                "HBM + tier",
                args,
                [preamble + p for p in prompts],
                answers,
                server,
                warm=preamble + [0],
            ),
            two_pass("control (tier off)", args, prompts, answers, None),
        ]
    table = md_table(
        [
            "config",
            "acc pass 1",
            "acc pass 2",
            "pass-2 HBM tokens",
            "pass-2 tier tokens",
            "pass-2 computed",
            "all pass-2 == pass-1",
        ],
        [
            [
                r["config"],
                f"{r['accuracy_pass1']:.4f}",
                f"{r['accuracy_pass2']:.4f}",
                r["pass2_hbm_tokens"],
                r["pass2_tier_tokens"],
                r["pass2_computed_tokens"],
                "yes" if r["all_pass2_equal_pass1"] else f"NO ({r['pass2_differing']} differ)",
            ]
            for r in rows
        ],
    )
    print(table)
    record_file = Path(args.model) / "accuracy.json"
    key = f"{args.device}/{args.dtype}/n{args.prompts}/len{args.length}/pre{args.preamble}"
    failures = [
        f"{r['config']}: {r['pass2_differing']} pass-2 answers differ from pass 1"
        for r in rows
        if not r["all_pass2_equal_pass1"]
    ]
    records = json.loads(record_file.read_text()) if record_file.exists() else {}
    if args.record:  # each configuration's own prompts (HBM + tier adds a preamble)
        records[key] = {
            "prompts": args.prompts,
            "length": args.length,
            "preamble": args.preamble,
            "accuracy": {r["config"]: r["accuracy_pass1"] for r in rows},
        }
        record_file.write_text(json.dumps(records, indent=1) + "\n")
        print(f"recorded {records[key]['accuracy']} for {key} in {record_file}")
    elif key in records:
        for r in rows:
            want = records[key]["accuracy"][r["config"]]
            noise = 3 * math.sqrt(max(want * (1 - want), 1e-4) / args.prompts) + 0.01
            for p in ("accuracy_pass1", "accuracy_pass2"):
                if r[p] < want - noise:
                    failures.append(
                        f"{r['config']} {p} {r[p]:.4f} < recorded {want:.4f} - {noise:.4f}"
                    )
    else:
        failures.append(f"no recorded accuracy for {key} in {record_file} (run with --record)")
    cmd = "python -m benchmarks.accuracy " + " ".join(
        f"--{k.replace('_', '-')} {v}"
        for k, v in vars(args).items()
        if k not in ("record", "model")
    )
    write_results(args.name, {"rows": rows, "failures": failures}, table, cmd)
    for f in failures:
        print("FAIL:", f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
