"""Train a draft adapter: a model's draft layer taught to predict its own target's greedy choices.

    python -m tools.train_draft_adapter --model v41-bench-draft --device cuda --minutes 5 \\
        --out OUT                                   # a first run
    python -m tools.train_draft_adapter ... --resume OUT --out OUT2 --run 1   # continue it

What it trains (``atom.models.deepseek_v41.draft_adapter``): the draft layer starts as a copy of
the target's last layer (``init_from_last_layer``, ``enorm`` / ``hnorm`` at the measured scales
of the embeddings and the target's streams), its large linears get rank-``--rank`` deltas and its
small tensors (norms, mHC mixers, sinks, the router) are trained whole; the target is frozen.
The result is one small file (``adapter.safetensors``, a few MB at rank 16 on v41-bench-draft)
that ``EngineConfig.draft_adapter`` / ``--draft-adapter`` applies to the same target.

Data, as speculative decoding meets it: prompts of ``--prompt-len`` random tokens below
``--prompt-vocab`` (the distribution ``benchmarks.speculative`` draws its prompts from, with other
seeds: run ``r`` draws prompts from ``torch.Generator`` seed ``1000 + r``, the benchmark's are
seed 0, held-out ones seed 999) continued for ``--gen-len`` greedy tokens by the engine (the
model as it serves, k = 0). Over each prompt + continuation the target's sparse reference forward
(``reference_target_forward``: the selection inference runs) gives the last layer's streams and
the target's argmax; the draft at position p reads the token at p + 1 and the streams at p and
is trained (cross-entropy) to the target's argmax at p + 1, the token speculative decoding
accepts. Positions after the prompt weigh 1, prompt positions ``--prompt-weight``.

Runs are bounded (``--minutes`` / ``--max-steps``) so one fits a GPU call; each writes OUT/
``adapter.safetensors`` (at the model's dtype: bf16 on the GPU, about 6 MB at rank 16 on
v41-bench-draft) and ``train_state.json`` (steps so far, every run's recipe and numbers);
``--resume DIR`` continues from such a directory on fresh data (give each run its own
``--run``). The adapter is the whole checkpoint: AdamW's moments start afresh each run, after
``--warmup`` steps of warm-up again. Reported per run:
teacher-forced agreement on held-out prompts' continuations (the draft's argmax equals the
target's) before and after, loss, steps, tokens per second. The engine's acceptance at k = 1..3
is ``benchmarks.speculative --draft-adapter OUT/adapter.safetensors``'s to measure.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from atom.models.deepseek_v41 import draft_adapter as da

log = logging.getLogger("train_draft_adapter")

EVAL_SEED = 999  # held-out prompts; the benchmark's are seed 0, run r's seed 1000 + r


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m tools.train_draft_adapter",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--model", default="v41-bench-draft", help="a preset or directory with a draft layer"
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--seed", type=int, default=0, help="the target preset's seed")
    ap.add_argument("--out", required=True, help="directory for the adapter and its state")
    ap.add_argument("--resume", default=None, help="a directory an earlier run wrote")
    ap.add_argument("--run", type=int, default=0, help="this run's index (its prompts' seed)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=20, help="steps of linear warm-up")
    ap.add_argument("--minutes", type=float, default=5.0, help="training loop budget")
    ap.add_argument("--max-steps", type=int, default=0, help="a step budget (0: minutes only)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--prompts", type=int, default=64, help="training prompts this run")
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=256)
    ap.add_argument("--prompt-vocab", type=int, default=256)
    ap.add_argument("--prompt-weight", type=float, default=0.1)
    ap.add_argument("--concurrency", type=int, default=32, help="engine sequences generating")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument(
        "--name",
        default=None,
        help="also write benchmarks/results/NAME.md/.json (every run so far, this one last)",
    )
    return ap.parse_args(argv)


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens below ``vocab`` (as ``benchmarks.speculative``'s)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(count)]


def continuations(args, prompts: list[list[int]]) -> list[list[int]]:
    """The engine's greedy continuations (k = 0, the model as it serves)."""
    from atom import LLM, SamplingParams

    blocks = -(-(args.prompt_len + args.gen_len + 8) // 256) * args.concurrency + 16
    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        block_size=256,
        num_blocks=blocks,
        max_num_seqs=args.concurrency,
        max_num_batched_tokens=max(2048, args.prompt_len),
    )
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=args.gen_len, ignore_eos=True))
    finally:
        llm.shutdown()
    del llm
    gc.collect()  # the engine's weights, pool and graphs go before the trainer's model comes
    return [list(o.token_ids) for o in outs]


def build_target(args):
    """The model (target and draft layer) at the engine's dtype, from the same seed or
    checkpoint as the engine builds it; frozen. The forwards run the torch expressions (no
    Triton kernels, the per-expert MoE loop): gradients flow through every one of them."""
    from atom import kernels
    from atom.models.common.moe import configure_grouped_mm
    from atom.models.registry import build_model, resolve_config

    kernels.configure(False, [], [])
    configure_grouped_mm(False)

    config, path = resolve_config(args.model)
    if not getattr(config, "num_nextn_predict_layers", 0):
        raise SystemExit(f"{args.model} has no draft layer (num_nextn_predict_layers=0)")
    on_gpu = args.device.startswith("cuda")
    kv = "bf16" if args.dtype == "bfloat16" else "fp32"
    model = build_model(
        config,
        path,
        dtype=getattr(torch, args.dtype),
        kv_dtype=kv,
        index_dtype="fp8" if on_gpu else kv,
        device=args.device,
        seed=args.seed,
        weight_dtype="bf16",
    )
    return model.requires_grad_(False)


@torch.no_grad()
def target_pass(model, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [N, S], the target's streams [N, S, hc, d] at the model's dtype, its argmax [N, S])
    from the sparse reference forward, one sequence at a time."""
    from tools.train_draft import reference_target_forward

    streams, argmax = [], []
    for q in seqs:
        logits, x = reference_target_forward(model, q)
        streams.append(x.to(model.model.embed_tokens.weight.dtype))
        argmax.append(logits.argmax(-1))
        del logits
    ids = torch.tensor(seqs, device=model.device)
    return ids, torch.stack(streams), torch.stack(argmax)


def draft_logits(model, ids: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The draft at every position p < S - 1: float32 logits [N, S - 1, V] for the target's
    choice at p + 1 (``tools.train_draft.draft_forward``, grad-enabled)."""
    from tools.train_draft import draft_forward

    return draft_forward(model, ids[:, 1:], streams[:, :-1])[0]


def weights_of(prompt_len: int, length: int, prompt_weight: float, device) -> torch.Tensor:
    """Loss weight of draft position p (its label at p + 1): 1 where p + 1 is past the prompt."""
    w = torch.full((length - 1,), prompt_weight, device=device)
    w[prompt_len - 1 :] = 1.0
    return w


@torch.no_grad()
def agreement(model, data, prompt_len: int, batch: int) -> dict:
    """Teacher-forced agreement of the draft's argmax with the target's, on the continuation
    (positions p + 1 >= prompt_len) and on the prompt."""
    ids, streams, argmax = data
    hits = {"continuation": [0, 0], "prompt": [0, 0]}
    for i in range(0, ids.shape[0], batch):
        pred = draft_logits(model, ids[i : i + batch], streams[i : i + batch]).argmax(-1)
        same = pred == argmax[i : i + batch, 1:]
        for name, part in (
            ("prompt", same[:, : prompt_len - 1]),
            ("continuation", same[:, prompt_len - 1 :]),
        ):
            hits[name][0] += int(part.sum())
            hits[name][1] += part.numel()
    return {k: round(a / max(1, n), 4) for k, (a, n) in hits.items()}


def load_trainable(model, tensors: dict[str, torch.Tensor]) -> None:
    """An earlier run's adapter into the parametrized layer (not merged: training goes on)."""
    named = da.trainable(model, 0)
    if set(tensors) != set(named):
        raise SystemExit(
            f"--resume: the adapter's tensors differ from this layer's: missing "
            f"{sorted(set(named) - set(tensors))}, unexpected {sorted(set(tensors) - set(named))}"
        )
    with torch.no_grad():
        for key, value in tensors.items():
            p = named[key]
            if p.shape != value.shape:
                raise SystemExit(
                    f"--resume: {key} is {list(value.shape)}, expected {list(p.shape)}"
                )
            p.copy_(value.to(p.device, p.dtype))


def main(argv=None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    state = {"steps": 0, "runs": []}
    if args.resume:
        state = json.loads((Path(args.resume) / "train_state.json").read_text())
        if any(r["run"] == args.run for r in state["runs"]):
            raise SystemExit(f"--run {args.run} was used already: its prompts were trained on")
        if state["rank"] != args.rank:
            raise SystemExit(f"--rank {args.rank}, the resumed adapter has rank {state['rank']}")

    train_prompts = random_prompts(
        args.prompts, args.prompt_len, args.prompt_vocab, 1000 + args.run
    )
    eval_prompts = random_prompts(args.eval_prompts, args.prompt_len, args.prompt_vocab, EVAL_SEED)
    conts = continuations(args, train_prompts + eval_prompts)
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    t_gen = time.time() - t0
    log.info("%d greedy continuations of %d tokens in %.1f s", len(conts), args.gen_len, t_gen)

    model = build_target(args)
    seqs = [p + c for p, c in zip(train_prompts + eval_prompts, conts)]
    train = target_pass(model, seqs[: args.prompts])
    held = target_pass(model, seqs[args.prompts :])
    t_target = time.time() - t0 - t_gen
    log.info("target streams for %d sequences in %.1f s", len(seqs), t_target)

    # the scales enorm / hnorm start at (a resumed run's come from its adapter)
    embed_rms = float(model.model.embed_tokens.weight.float().pow(2).mean().sqrt())
    stream_rms = float(train[1].float().pow(2).mean(-1).sqrt().median())
    da.init_from_last_layer(model, 0, embed_rms=embed_rms, stream_rms=stream_rms)
    da.add_low_rank(model, 0, args.rank, seed=0)
    if args.resume:
        tensors, _ = da.read_adapter(Path(args.resume) / "adapter.safetensors")
        load_trainable(model, tensors)
    named = da.trainable(model, 0)
    params = list(named.values())
    for p in params:
        p.requires_grad_(True)
    n_params = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    before = agreement(model, held, args.prompt_len, args.batch)
    log.info("trainable %d parameters; held-out agreement before: %s", n_params, before)

    ids, streams, argmax = train
    weights = weights_of(args.prompt_len, ids.shape[1], args.prompt_weight, ids.device)
    gen = torch.Generator().manual_seed(args.run)
    deadline = time.time() + 60 * args.minutes
    step, losses, t_loop = 0, [], time.time()
    while time.time() < deadline and (not args.max_steps or step < args.max_steps):
        total = state["steps"] + step
        for group in opt.param_groups:  # warm-up each run: the moments start afresh
            group["lr"] = args.lr * min(1.0, (step + 1) / args.warmup)
        pick = torch.randperm(ids.shape[0], generator=gen)[: args.batch].to(ids.device)
        logits = draft_logits(model, ids[pick], streams[pick])
        ce = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), argmax[pick, 1:].reshape(-1), reduction="none"
        )
        loss = (ce.view(logits.shape[:2]) * weights).sum() / (weights.sum() * len(pick))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step == 0:  # a path that drops the graph would leave a tensor untrained silently
            dead = [name for name, p in named.items() if p.grad is None]
            if dead:
                raise SystemExit(f"no gradient reaches {len(dead)} trainable tensors: {dead}")
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        if step % args.log_every == 0:
            rate = step * args.batch * (ids.shape[1] - 1) / (time.time() - t_loop)
            mem = torch.cuda.max_memory_allocated() / 2**30 if ids.is_cuda else 0.0
            log.info(
                "step %d loss %.4f (%.0f draft positions/s, peak %.1f GiB)",
                total + 1,
                losses[-1],
                rate,
                mem,
            )
    loop_s = time.time() - t_loop
    after = agreement(model, held, args.prompt_len, args.batch)
    log.info("held-out agreement after %d steps: %s", step, after)

    record = {
        "run": args.run,
        "steps": step,
        "loss_first": losses[0] if losses else None,
        "loss_last_10": sum(losses[-10:]) / max(1, len(losses[-10:])),
        "agreement_before": before,
        "agreement_after": after,
        "prompts": f"{args.prompts} x {args.prompt_len} tokens below {args.prompt_vocab}, "
        f"torch.Generator seed {1000 + args.run}",
        "gen_len": args.gen_len,
        "lr": args.lr,
        "batch": args.batch,
        "prompt_weight": args.prompt_weight,
        "seconds": {
            "generate": round(t_gen, 1),
            "target": round(t_target, 1),
            "train": round(loop_s, 1),
            "all": round(time.time() - t0, 1),
        },
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
    }
    state.update(
        model=args.model,
        seed=args.seed,
        rank=args.rank,
        dtype=args.dtype,
        steps=state["steps"] + step,
    )
    state["runs"].append(record)
    recipe = {k: state[k] for k in ("model", "seed", "rank", "dtype", "steps")}
    recipe["runs"] = [
        {k: r[k] for k in ("run", "steps", "lr", "batch", "prompts")} for r in state["runs"]
    ]
    dtype = getattr(torch, args.dtype)
    da.save_adapter(model, 0, out / "adapter.safetensors", recipe, dtype=dtype)
    (out / "train_state.json").write_text(json.dumps(state, indent=2))
    print(json.dumps(record, indent=2))
    if args.name:
        print(write_record(args, state, argv))
    return 0


def write_record(args, state: dict, argv) -> Path:
    """The runs so far as a results file (``benchmarks.common.write_results``)."""
    from benchmarks.common import md_table, write_results

    rows = [
        [
            r["run"],
            r["steps"],
            f"{r['loss_first']:.2f} -> {r['loss_last_10']:.2f}",
            " / ".join(str(r["agreement_before"][k]) for k in ("continuation", "prompt")),
            " / ".join(str(r["agreement_after"][k]) for k in ("continuation", "prompt")),
            " / ".join(str(r["seconds"][k]) for k in ("generate", "target", "train")),
        ]
        for r in state["runs"]
    ]
    table = md_table(
        [
            "run",
            "steps",
            "loss first -> last 10",
            "held-out agreement before (continuation / prompt)",
            "after",
            "seconds (generate / target / train)",
        ],
        rows,
    )
    command = "python -m tools.train_draft_adapter " + " ".join(argv or sys.argv[1:])
    return write_results(args.name, state, table, command)


if __name__ == "__main__":
    sys.exit(main())
