"""The two-pass accuracy job on the trained recall model (models/v41-recall).

    python -m benchmarks.accuracy [--prompts 256] [--length 384] [--preamble 256]
        [--output-len 8] [--draft-tokens 2] [--draft-prompts 64] [--record]

A fixed evaluation set (seeded, disjoint from training) is run twice per configuration, each
pass on a fresh engine:
  tier only     pass 1 fills an LMCache server; pass 2 starts from an empty pool, so every
                reusable prefix comes from the tier;
  HBM + tier    a long shared preamble precedes every prompt; pass 2 first computes the
                preamble alone (HBM), then the prompts: preamble from HBM, the rest from the tier;
  control       the tier is off in both passes (pass 2 recomputes everything);
  tier only + drafts, HBM + tier + drafts
                the first two again with speculative decoding (``--draft-tokens`` k drafts per
                step from the model's trained drafter: its DSpark stage, blocks of 3, so
                k <= 3), on the first ``--draft-prompts``.
Greedy outputs: the first ``--draft-prompts`` prompts generate ``--output-len`` tokens in every
configuration (decoding, and the drafts, run on them), the others their one-token answer;
accuracy = the first token is the right value token (the answer). The job fails (exit 1) if any
pass-2 output differs from pass 1, if a drafts configuration's outputs differ from its
configuration without drafts (greedy speculative decoding is exact in fp32), or if the model's
accuracy falls below its recorded value (models/v41-recall/accuracy.json) by more than noise
(3 binomial sigmas + 1 point). ``--record`` writes that record from this run instead of
checking it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from atom import LLM, SamplingParams
from atom.tier.server.lmcache_server import LMCacheServer
from benchmarks.common import md_table, write_results
from benchmarks.recall_task import preamble as make_preamble
from benchmarks.recall_task import split

MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "v41-recall"


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


def run_pass(llm: LLM, prompts: list[list[int]], lengths: list[int]):
    """Greedy outputs (``lengths[i]`` tokens for prompt i), seconds, and the engine's
    speculative counters (None without drafts)."""
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return outs, time.perf_counter() - t0, llm.engine.stats().get("speculative")


def accuracy(outs, answers) -> float:
    """The first output token is the answer (one token)."""
    return sum(o.token_ids[: len(a)] == a for o, a in zip(outs, answers)) / len(answers)


def two_pass(
    name: str, args, prompts, answers, server: LMCacheServer | None, warm=None, drafts: int = 0
):
    """Pass 1 and pass 2 on fresh engines; (row, pass-1 and pass-2 output tokens)."""
    tier = {"offload": "lmcache_mp", "lmcache_url": server.url} if server else {}
    if drafts:
        tier["speculative_tokens"] = drafts
    first = engine(args, **tier)
    # the first --draft-prompts prompts decode --output-len tokens, the others the answer
    lengths = [args.output_len if i < args.draft_prompts else 1 for i in range(len(prompts))]
    out1, t1, spec1 = run_pass(first, prompts, lengths)
    first.shutdown()
    second = engine(args, **tier)
    if warm is not None:  # put the shared preamble in HBM (one token: no drafts run)
        second.generate([warm], SamplingParams(max_tokens=1, ignore_eos=True))
    out2, t2, spec2 = run_pass(second, prompts, lengths)
    second.shutdown()
    same = [a.token_ids == b.token_ids for a, b in zip(out1, out2)]
    row = {
        "config": name,
        "k": drafts,
        "prompts": len(prompts),
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
    if drafts:
        row["speculative_pass1"], row["speculative_pass2"] = spec1, spec2
    print(row, flush=True)
    return row, ([o.token_ids for o in out1], [o.token_ids for o in out2])


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=str(MODEL_DIR))
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--length", type=int, default=384)
    ap.add_argument("--preamble", type=int, default=256)
    ap.add_argument(
        "--output-len",
        type=int,
        default=8,
        help="greedy tokens of each of the first --draft-prompts prompts (the answer first)",
    )
    ap.add_argument(
        "--draft-tokens",
        type=int,
        default=2,
        help="k of the drafts configurations (0: leave them out)",
    )
    ap.add_argument(
        "--draft-prompts",
        type=int,
        default=64,
        help="the first N prompts generate --output-len tokens (the others one) and are "
        "the drafts configurations' prompts",
    )
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
    if args.draft_tokens and args.draft_prompts < 1:
        ap.error("--draft-prompts must be >= 1 with --draft-tokens > 0")
    args.draft_prompts = n_draft = min(args.draft_prompts, args.prompts)
    with_preamble = [preamble + p for p in prompts]
    outputs = {}

    def run(name, prompts, answers, server, **kw):
        row, outputs[name] = two_pass(name, args, prompts, answers, server, **kw)
        return row

    with LMCacheServer(chunk_size=256, l1_size_gb=1.0, shared_l1=True) as server:
        rows = [
            run("tier only", prompts, answers, server),
            run("HBM + tier", with_preamble, answers, server, warm=preamble + [0]),
            run("control (tier off)", prompts, answers, None),
        ]
        if args.draft_tokens:  # a namespace of their own: the layout holds the drafts' rows
            k = args.draft_tokens
            rows += [
                run("tier only + drafts", prompts[:n_draft], answers[:n_draft], server, drafts=k),
                run(
                    "HBM + tier + drafts",
                    with_preamble[:n_draft],
                    answers[:n_draft],
                    server,
                    warm=preamble + [0],
                    drafts=k,
                ),
            ]
    for r in rows:  # outputs with drafts against the same configuration's without
        if r["k"]:
            base = r["config"].removesuffix(" + drafts")
            r["base_config"] = base
            want = outputs[base][0][: r["prompts"]]
            r["equal_to_no_drafts"] = [
                sum(a == b for a, b in zip(mine, want)) for mine in outputs[r["config"]]
            ]

    def spec_cell(r, key, fmt):
        if not r["k"]:
            return ""
        return " / ".join(format(r[f"speculative_pass{i}"][key], fmt) for i in (1, 2))

    table = md_table(
        [
            "config",
            "prompts",
            "acc pass 1",
            "acc pass 2",
            "pass-2 HBM tokens",
            "pass-2 tier tokens",
            "pass-2 computed",
            "all pass-2 == pass-1",
            "k",
            "acceptance (pass 1 / 2)",
            "tokens / verify (pass 1 / 2)",
            "outputs = no drafts (pass 1 / 2)",
        ],
        [
            [
                r["config"],
                r["prompts"],
                f"{r['accuracy_pass1']:.4f}",
                f"{r['accuracy_pass2']:.4f}",
                r["pass2_hbm_tokens"],
                r["pass2_tier_tokens"],
                r["pass2_computed_tokens"],
                "yes" if r["all_pass2_equal_pass1"] else f"NO ({r['pass2_differing']} differ)",
                r["k"],
                spec_cell(r, "acceptance_rate", ".3f"),
                spec_cell(r, "tokens_per_verify", ".2f"),
                (
                    " / ".join(f"{n}/{r['prompts']}" for n in r["equal_to_no_drafts"])
                    if r["k"]
                    else ""
                ),
            ]
            for r in rows
        ],
    )
    table += (
        f"\n\nGreedy outputs: {args.output_len} tokens for the first {n_draft} prompts, one "
        "(the answer) for the others; accuracy: the first token is the answer. Drafts "
        f"configurations: the model's trained drafter, k={args.draft_tokens} drafts per "
        f"decode step, on the first {n_draft} prompts; their outputs (both passes) are "
        "compared token for token with the same configuration's pass 1 without drafts; "
        "acceptance and tokens / verify are each pass's.\n"
    )
    print(table)
    record_file = Path(args.model) / "accuracy.json"
    key = f"{args.device}/{args.dtype}/n{args.prompts}/len{args.length}/pre{args.preamble}"
    failures = [
        f"{r['config']}: {r['pass2_differing']} pass-2 outputs differ from pass 1"
        for r in rows
        if not r["all_pass2_equal_pass1"]
    ]
    failures += [
        f"{r['config']}: outputs equal to {r['base_config']}'s without drafts: "
        f"{r['equal_to_no_drafts']} of {r['prompts']} (pass 1, pass 2)"
        for r in rows
        if r["k"] and any(n != r["prompts"] for n in r["equal_to_no_drafts"])
    ]
    records = json.loads(record_file.read_text()) if record_file.exists() else {}
    if args.record:  # each configuration's own prompts (HBM + tier adds a preamble)
        records[key] = {
            "prompts": args.prompts,
            "length": args.length,
            "preamble": args.preamble,
            "accuracy": {r["config"]: r["accuracy_pass1"] for r in rows if not r["k"]},
        }
        record_file.write_text(json.dumps(records, indent=1) + "\n")
        print(f"recorded {records[key]['accuracy']} for {key} in {record_file}")
    elif key in records:
        for r in rows:  # drafts configurations: equal outputs (checked above) say the rest
            if r["k"]:
                continue
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
