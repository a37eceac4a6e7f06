"""Train the recall model (benchmarks/recall_task.py) and write models/v41-recall/.

    python -m tools.train_recall --device cpu --threads 2 --minutes 38 --batch 16 \
        --lengths 96 384 --lr 2e-3 --far 80 --curriculum 0.4 --eval-length 384

(the command that made models/v41-recall for the published V4.1 forward: 528 steps on 2
shared cores, dense accuracy 0.305 on held-out prompts of 384 tokens; the model before it, of
atom's earlier forward, reached 0.676 in 1,268 steps of 42 minutes on unshared cores; on a GPU
pass ``--device cuda`` and a larger ``--batch``).

The model is the v41-recall preset shape. Training uses the dense forward (every compressed
row attended, indexers fitted to that attention by KL), with the context length drawn per
step; the saved config keeps the preset's small top-k, so inference is sparse. Each training
context queries every one of its records (``make_training_sequence``: dense supervision, the
first query laid out like an evaluation prompt); loss: cross-entropy on every answer value, plus
0.1 x the indexer KL. ``--curriculum`` ramps the record distance up from 0 and the context
length up from the shortest, so the lookup is learned on short contexts first. Weights are
written as bf16 safetensors with config.json, tokenizer.json and a training record.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from atom.models.deepseek_v41.dense import dense_forward
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.presets import preset_config
from atom.models.deepseek_v41.weights import save_weights
from benchmarks.recall_task import EOS, make_training_sequence, split, tokenizer_json


def batch(step: int, size: int, length: int, device, far: int, records=(2, 8)):
    """Inputs [B, L-1], targets [B, L-1] with -100 everywhere but the answer values."""
    seqs, answers = zip(
        *(make_training_sequence(step * size + i, length, far, records) for i in range(size))
    )  # train seeds < 10M, disjoint from eval
    ids = torch.tensor(seqs, device=device)
    targets = torch.full_like(ids, -100)
    for row, positions in enumerate(answers):
        targets[row, positions] = ids[row, positions]
    return ids[:, :-1], targets[:, 1:]


@torch.no_grad()
def dense_accuracy(model, examples, device, chunk=32) -> float:
    ok = 0
    for i in range(0, len(examples), chunk):
        part = examples[i : i + chunk]
        ids = torch.tensor([e.prompt + e.answer for e in part], device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits, _ = dense_forward(model, ids[:, :-1])
        n = len(part[0].answer)
        ok += (logits[:, -n:].argmax(-1) == ids[:, -n:]).all(-1).sum().item()
    return ok / len(examples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--minutes", type=float, default=6.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lengths", type=int, nargs=2, default=[192, 512])
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--records", type=int, nargs=2, default=[2, 8])
    ap.add_argument("--far", type=int, default=80, help="min distance record -> first query")
    ap.add_argument(
        "--curriculum",
        type=float,
        default=0.0,
        help="fraction of the budget over which --far ramps up from 0 and the longest context "
        "from the shortest (records first in the window, then out of it)",
    )
    ap.add_argument("--eval-length", type=int, default=768)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default="models/v41-recall")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    def shortest(far: int) -> int:  # the questions, one record per slot, and the far gap
        return -(-(far + 5 * args.records[1] + 2) // 16) * 16

    if args.lengths[1] < shortest(args.far) or (
        args.curriculum == 0 and args.lengths[0] < shortest(args.far)
    ):
        ap.error(
            f"--lengths {args.lengths} is too short for --far {args.far} and up to "
            f"{args.records[1]} records: use at least {shortest(args.far)}"
        )
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    sparse_cfg = preset_config("v41-recall")
    dense_cfg = preset_config("v41-recall", index_topk=1 << 16, candidate_topk_blocks=1 << 13)
    model = DeepseekV41ForCausalLM(dense_cfg, device=device).init_weights(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    evals = split("eval", 256, args.eval_length)
    rng = random.Random(args.seed)
    t0, step, log = time.time(), 0, []
    budget = args.minutes * 60
    while time.time() - t0 < budget:
        frac = (time.time() - t0) / budget
        lr = args.lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * (1 - frac))
        for g in opt.param_groups:
            g["lr"] = lr
        ramp = min(1.0, frac / args.curriculum) if args.curriculum > 0 else 1.0
        far = int(args.far * ramp)
        lo = max(args.lengths[0], shortest(far))
        length = rng.randrange(lo, max(lo, lo + int((args.lengths[1] - lo) * ramp)) + 1, 16)
        ids, targets = batch(step, args.batch, length, device, far, tuple(args.records))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits, kl = dense_forward(model, ids)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        loss = ce + 0.1 * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
            rec = {
                "step": step,
                "s": round(time.time() - t0, 1),
                "len": length,
                "far": far,
                "ce": round(ce.item(), 4),
                "kl": round(kl.item(), 4),
                "lr": lr,
            }
            if step % 200 == 0:
                rec["dense_acc"] = dense_accuracy(model, evals[:128], device)
            log.append(rec)
            print(rec, flush=True)
    final = dense_accuracy(model, evals, device)
    print({"final_dense_accuracy": final, "steps": step}, flush=True)
    out = Path(args.out)
    trained = DeepseekV41ForCausalLM(sparse_cfg, dtype=torch.bfloat16)
    trained.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
    save_weights(trained, out)
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json()))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    (out / "training.json").write_text(
        json.dumps(
            {
                "command": "python -m tools.train_recall "
                + " ".join(
                    f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                    for k, v in vars(args).items()
                ),
                "steps": step,
                "seconds": round(time.time() - t0, 1),
                "final_dense_accuracy_eval256": final,
                "log": log,
                "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
            },
            indent=1,
        )
    )
    print("wrote", out)


if __name__ == "__main__":
    main()
