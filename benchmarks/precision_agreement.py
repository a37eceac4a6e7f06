"""Greedy agreement of a model at stored precision with its dequantized twin, on a fixed prompt
set: ``weight_dtype fp8`` (FP8 linears, FP4 experts, their inputs rounded as DeepSeek's kernels
round them) against ``weight_dtype bf16`` (the same values, dequantized, inputs unrounded).

    python -m benchmarks.precision_agreement --model v41-tiny-fp8 --device cpu

For each seeded prompt the stored-precision engine generates ``--output-len`` greedy tokens.
Both engines then score that same sequence (prompt and continuation) with prompt
log-probabilities, so every position is predicted from the same context by both (teacher
forcing), and their top-1 tokens are compared position by position: over the continuation's
positions and over all positions. Where they part, the dequantized model's top-2 gap there says
how near a tie the parting was. Free-running agreement is reported too: the twin generates from
the same prompts, and the first position where its tokens leave the stored-precision ones.

``--task recall`` takes the prompts from the recall task's evaluation split instead (for the
trained model, ``--model models/v41-recall``: stored in float32, so ``weight_dtype fp8``
quantizes it at load): the answer token each precision gives, against the other's and the
task's answer, is the agreement on a prediction the model was trained to make (the filler
positions are near ties by construction: random tokens).

    python -m benchmarks.precision_agreement --model models/v41-recall --task recall \
        --prompts 128 --prompt-len 384 --output-len 1
"""

from __future__ import annotations

import argparse
import statistics

import torch

from atom import LLM, SamplingParams
from benchmarks.common import command_line, md_table, write_results

TOP = 5


def prompts_of(n: int, length: int, seed: int, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (length,), generator=g).tolist() for _ in range(n)]


def scored(llm: LLM, seqs: list[list[int]]):
    """Each sequence's prompt log-probabilities (entry j: the prediction of token j from the
    tokens before it; None for j = 0)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP)
    return [o.prompt_logprobs for o in llm.generate(seqs, params)]


def compare(stored, dense, start: int) -> tuple[int, int, list[float]]:
    """(positions, agreeing, the dense top-2 gaps where they part) from position ``start``."""
    n = agree = 0
    gaps = []
    for a, b in zip(stored[start:], dense[start:]):
        if a is None or b is None:
            continue
        n += 1
        if a.top[0][0] == b.top[0][0]:
            agree += 1
        else:
            dense_lp = dict(b.top)
            other = dense_lp.get(a.top[0][0], b.top[-1][1])  # below the top-k: at most its last
            gaps.append(b.top[0][1] - other)
    return n, agree, gaps


def first_parting(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="v41-tiny-fp8")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--task", choices=["random", "recall"], default="random")
    ap.add_argument("--name", default="")
    args = ap.parse_args()
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    answers = None
    if args.task == "recall":
        from benchmarks.recall_task import split

        examples = split("eval", args.prompts, args.prompt_len)
        prompts, answers = [e.prompt for e in examples], [e.answer[0] for e in examples]
    else:
        prompts = prompts_of(args.prompts, args.prompt_len, args.seed)
    kw = dict(device=args.device, dtype=dtype, max_num_batched_tokens=args.max_batched_tokens)
    greedy = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    runs = {}
    for weights in ("fp8", "bf16"):
        llm = LLM(model=args.model, weight_dtype=weights, **kw)
        outs = [o.token_ids for o in llm.generate(prompts, greedy)]
        runs[weights] = {"outs": outs}
        if weights == "fp8":
            seqs = [p + o for p, o in zip(prompts, outs)]
        runs[weights]["scores"] = scored(llm, seqs)
        llm.shutdown()
        print(f"{weights}: done", flush=True)
    s, d = runs["fp8"]["scores"], runs["bf16"]["scores"]
    cont = [compare(a, b, args.prompt_len) for a, b in zip(s, d)]
    full = [compare(a, b, 1) for a, b in zip(s, d)]
    partings = [first_parting(a, b) for a, b in zip(runs["fp8"]["outs"], runs["bf16"]["outs"])]
    rows = []
    for label, res in (("continuation positions", cont), ("all positions", full)):
        n = sum(r[0] for r in res)
        agree = sum(r[1] for r in res)
        gaps = sorted(g for r in res for g in r[2])
        rows.append(
            [
                label,
                n,
                f"{agree / max(n, 1):.4f}",
                len(gaps),
                f"{statistics.median(gaps):.3f}" if gaps else "",
                f"{gaps[-1]:.3f}" if gaps else "",
            ]
        )
    equal = sum(p is None for p in partings)
    parted = sorted(p for p in partings if p is not None)
    table = md_table(
        [
            "teacher-forced",
            "positions",
            "top-1 agreement",
            "partings",
            "median dense top-2 gap where parted",
            "largest",
        ],
        rows,
    )
    table += (
        f"\n\nFree-running greedy ({args.output_len} tokens): {equal} of {len(prompts)} outputs "
        "equal; where not, the first parting at output "
        + (", ".join(str(p) for p in parted) if parted else "-")
        + f".\n\n{args.model}, {dtype} compute on {args.device}: weight_dtype fp8 (stored: FP8 "
        "linears, FP4 experts, inputs rounded; a checkpoint stored unquantized: quantized at load) "
        "against bf16 (the same values dequantized; unquantized: the checkpoint's values), "
        f"{len(prompts)} {args.task} prompts of {args.prompt_len} tokens (seed {args.seed})."
    )
    data = {"rows": rows, "free_running_equal": equal, "partings": parted}
    if answers is not None:
        first = {w: [o[0] for o in runs[w]["outs"]] for w in runs}
        same = sum(a == b for a, b in zip(first["fp8"], first["bf16"]))
        right = {w: sum(t == a for t, a in zip(first[w], answers)) for w in first}
        table += (
            f"\n\nRecall task, evaluation split: the answer token equal at both precisions on "
            f"{same} of {len(prompts)} prompts; right at fp8 on {right['fp8']}, at bf16 on "
            f"{right['bf16']} (chance: 1 in 16)."
        )
        data["answers"] = {"equal": same, "right": right, "prompts": len(prompts)}
    print(table)
    if args.name:
        print(write_results(args.name, data, table, command_line("precision_agreement", args)))


if __name__ == "__main__":
    main()
