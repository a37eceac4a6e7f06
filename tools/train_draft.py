"""Give the trained recall model (models/v41-recall) one trained draft (MTP) layer.

models/v41-recall now drafts with a DSpark stage (tools/train_dspark.py; its config.json has
``num_nextn_predict_layers: 0`` and ``dspark_stages: 1``). The MTP layer this tool trained is
still in model.safetensors (``model.layers.10.*``, left unread by the loader under that config);
this tool builds the model with ``num_nextn_predict_layers: 1, dspark_stages: 0`` to read it, and
writing a draft layer sets those two keys in config.json, making the MTP layer the drafter again.
The numbers below are the MTP layer's, measured before DSpark with the recall model of atom's
earlier V4.1 forward (code 527c86f, ceeb3eb); the MTP layer now stored is the one retrained with
the model for the published forward (code 9fe3cb0, 8 minutes: draft_training.json).

The draft layer of models/v41-recall was made by two runs, the second continuing the first:

    python -m tools.train_draft --steps 1450 --answer-weight 16 --reference-seqs 96

(one CPU thread: 1,450 steps on 363 fresh target batches of 8 sequences, 1,365 s of training,
1,441 s in all. Held-out agreement, 96 sequences of 384 tokens: dense target 0.879 overall,
0.548 on answer positions, against chance 0.347 / 0.083 (0.657 / 0.225 at the initialisation);
sparse reference target, as inference runs, 0.865 / 0.285 against chance 0.366 / 0.090.
Record: draft_training.json's "previous".) Then

    python -m tools.train_draft --init-from-committed --self-generated 384 --gen-len 96 \
        --self-mix 0.5 --minutes 7 --lr 3e-4 --answer-weight 16 --eval-seqs 32 \
        --reference-seqs 16 --measure 32 --threads 2

(two CPU threads, 881 s in all, the measurement included: the engine's greedy continuations
(96 tokens) of 384 recall prompts from train seeds, 292 s, their sparse reference targets 89 s;
then 807 steps, 409 on those sequences and 398 on the recall training sequences as before,
420 s.) That first
draft agreed with the target well on recall sequences but not on the target's own greedy
outputs after a prompt (repetitive answer-like tokens, unlike the training data), which is what
speculative decoding drafts on. Measured on split("eval", 32, 192) and 64 greedy tokens
(``measure``), before -> after: teacher-forced agreement on the continuation 0.237 -> 0.643
(chance 0.285), on the prompt 0.913 -> 0.913; the engine's acceptance rate at k = 1
0.217 -> 0.640, at k = 3 0.086 -> 0.266 (greedy outputs equal to k = 0's in every case).
Recall-sequence agreement stayed where it was (dense, 32 held-out sequences: 0.873 / 0.553
before, 0.880 / 0.526 after). Record: draft_training.json.

On answer positions the agreement with the sparse target is half that with the dense one. The
draft predicts the value from the target's streams at the key token alone (its attention is
window-only, the records lie beyond the window), so the likely reason is that the sparse
target's streams there carry the looked-up value less often; it is not only the draft having
been trained on dense streams: fine-tuning it for 4 minutes on the sparse target's streams (a
probe, not kept) moved its sparse answer agreement on 32 held-out sequences from 0.28 to 0.32,
within noise.

The target (the ten main layers, the embedding and the head) is loaded from the directory and
frozen; the model is rebuilt with ``num_nextn_predict_layers: 1`` and only the draft layer
(``mtp.0``, stored as ``model.layers.10.*``) is trained, by distillation. Draft semantics
(DeepSeek MTP, ``atom.models.deepseek_v41.draft``): the draft at position p reads the token at
p + 1 and the target's last-layer streams at p and predicts the token at p + 2; its job is to
agree with the target's greedy choice there, since speculative decoding accepts a draft token
when it equals the target's argmax. So the label of draft position p is the target's own
distribution at p + 1 (loss: KL to it, plus cross-entropy to its argmax), on every position of
recall-task training sequences (``tools.train_recall.batch``: train seeds), with the answer
positions (p + 1 the ``<ans>`` token) weighted up, since they are a few per sequence.

Target logits and streams come from the dense forward (``dense.dense_forward``, mirrored here
as ``target_forward`` to also return the streams); the draft runs through ``draft_forward``, a
batched, grad-enabled mirror of ``draft.reference_draft_forward`` (checked against it at start).
Computing the frozen target dominates a step, so each target batch is kept in a pool and
trained on ``--reuse`` times on average.

Self-generated data (``--self-generated N``): ``make_example`` prompts (seeds 5,000,000 + i of
the train split, lengths ``--gen-prompt-lengths`` in groups of ``--batch`` sharing one) are
continued for ``--gen-len`` greedy tokens by the engine (CPU, float32, k = 0), and the labels
and streams over prompt + continuation come from ``reference_target_forward`` (the sparse path
inference runs), computed once; a fraction ``--self-mix`` of the steps trains on them (no
answer weighting), the rest on the recall sequences as above. ``--init-from-committed`` starts
from the checkpoint's draft layer instead of the layer-9 copy; the previous record is kept
under "previous" in draft_training.json. ``--measure N`` runs ``measure`` after writing.

Initialisation: the draft layer is window-only like the target's last layers (8 and 9), so it
starts as a copy of layer 9 (mHC, norms, attention, MoE), with the model's final norm as
``shared_head.norm`` and its ``head_hc`` from the ``pre`` part of layer 9's FFN mixer;
``enorm`` / ``hnorm`` are set to the measured RMS of the embeddings / the streams so both keep
their scale, and ``eh_proj`` starts as [I, I] (the residual passed through, the next token's
embedding added, as the model's own input is).

Evaluation (held-out sequences, seeds from the eval split's range, disjoint from training):
teacher-forced agreement, the fraction of draft positions p whose argmax equals the target's
argmax at p + 1, over all positions and over the answer positions; chance is the agreement of
always predicting the most frequent target argmax (of that set of positions). Measured with the
dense target (what was trained on) and with the sparse reference forward (the saved config's
top-k, what inference runs). The draft's tensors are written into model.safetensors as the
target's are stored (bf16, float32 biases and sinks; the target's tensors byte-identical,
checked), config.json gets ``num_nextn_predict_layers: 1``, and draft_training.json records
the run.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from atom.models.common.mhc import identity_pre
from atom.models.deepseek_v41 import reference
from atom.models.deepseek_v41.config import V41Config
from atom.models.deepseek_v41.dense import _attention as dense_attention
from atom.models.deepseek_v41.draft import reference_draft_forward
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.weights import checkpoint_tensors, load_weights
from benchmarks.recall_task import SPLIT_SEEDS, make_example, make_training_sequence
from tools.train_recall import batch

DENSE = {"index_topk": 1 << 16, "candidate_topk_blocks": 1 << 13}


def read_config(directory: Path, **overrides) -> V41Config:
    data = json.loads((directory / "config.json").read_text())
    return V41Config.from_dict({**data, **overrides}, source=str(directory / "config.json"))


def load_checkpoint(model: DeepseekV41ForCausalLM, directory: Path) -> None:
    """``weights.load_weights``: the drafters the config does not build (the MTP layer under
    ``model.layers.10.*``, the DSpark stage ``dspark.0.*``) are left unread."""
    load_weights(model, directory)


def load_model(directory: Path, *, dense: bool, draft_from: str = "init") -> DeepseekV41ForCausalLM:
    """The model of ``directory`` in float32 with one draft layer: the target's tensors from the
    checkpoint; the draft layer's from it too (``draft_from="checkpoint"``) or left at the
    random init (the checkpoint's draft layer, if any, is then not read)."""
    extra = {**(DENSE if dense else {}), "dspark_stages": 0}  # the MTP layer, not DSpark
    target = DeepseekV41ForCausalLM(read_config(directory, num_nextn_predict_layers=0, **extra))
    load_checkpoint(target, directory)  # the checkpoint's drafters are left unread
    model = DeepseekV41ForCausalLM(read_config(directory, num_nextn_predict_layers=1, **extra))
    if draft_from == "checkpoint":
        load_checkpoint(model, directory)
        return model
    model.init_weights(0)
    missing, unexpected = model.load_state_dict(target.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("mtp.") for k in missing), (missing, unexpected)
    return model


# ---- forwards ------------------------------------------------------------------------------


@torch.no_grad()
def target_forward(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dense.dense_forward`` (no indexer loss) that also returns the last layer's streams:
    ids [B, S] -> (float32 logits [B, S, V], streams [B, S, hc, d])."""
    b, s = ids.shape
    hist = torch.full((b, 3), -1, dtype=torch.int64, device=ids.device)
    grams = torch.cat([hist, ids], dim=1).unfold(1, 4, 1).reshape(b * s, 4)
    x = model._embed(ids.reshape(-1))
    pre = identity_pre(x)
    rows: dict = {}
    for layer in model.model.layers:

        def attend(u, a=layer.self_attn):
            return dense_attention(a, u.view(b, s, -1), rows, model.index_dtype, []).reshape(
                b * s, -1
            )

        x, pre = layer.block(x, pre, model.engram_rows(grams), attend)
    return model._head(x, pre).view(b, s, -1), x.view(b, s, *x.shape[1:])


@torch.no_grad()
def reference_target_forward(model, ids) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.reference_forward`` (the model's own top-k selection: what inference runs)
    that also returns the streams: ids [S] -> (logits [S, V], streams [S, hc, d])."""
    dev = model.device
    ids = torch.as_tensor(ids, dtype=torch.int64, device=dev)
    pos = torch.arange(ids.numel(), device=dev)
    grams = torch.cat([torch.full((3,), -1, dtype=torch.int64, device=dev), ids]).unfold(0, 4, 1)
    engram_rows = model.engram_rows(grams)
    rows: dict = {}
    selections: dict = {}
    x = model._embed(ids)
    pre = identity_pre(x)
    for layer in model.model.layers:
        x, pre = layer.block(
            x,
            pre,
            engram_rows,
            lambda u, a=layer.self_attn: reference._attention(
                a, u, pos, rows, selections, model.index_dtype
            ),
        )
    return model._head(x, pre), x


def draft_forward(model, next_ids: torch.Tensor, residual: torch.Tensor, layer: int = 0):
    """Batched, grad-enabled ``draft.reference_draft_forward``: next_ids [B, S] (the token at
    p + 1 for each position p), residual [B, S, hc, d] (the target's streams at p) ->
    (float32 logits [B, S, V] predicting the token at p + 2, output streams [B, S, hc, d])."""
    b, s = next_ids.shape
    block = model.mtp[layer]

    def attend(u):  # window-only: the dense path's attention without compressed rows
        return dense_attention(block.self_attn, u.view(b, s, -1), {}, model.index_dtype, [])

    e = model.model.embed_tokens(next_ids.reshape(-1))
    x = block.draft(
        e, residual.reshape(b * s, *residual.shape[2:]), lambda u: attend(u).view(-1, u.shape[-1])
    )
    return block.logits(x, model.lm_head).view(b, s, -1), x.view(b, s, *x.shape[1:])


def draft_pairs(ids: torch.Tensor, logits: torch.Tensor, streams: torch.Tensor):
    """A target pass over ids [B, S] -> the draft's inputs and labels for positions
    p = 0 .. S - 2: (next ids [B, S-1], streams at p, target logits at p + 1)."""
    return ids[:, 1:], streams[:, :-1], logits[:, 1:]


# ---- initialisation ------------------------------------------------------------------------


@torch.no_grad()
def init_draft(model, embed_rms: float, stream_rms: float) -> None:
    """The draft layer from the target's last layer (module doc)."""
    block, last = model.mtp[0], model.model.layers[-1]
    for name in ("attn_hc", "input_layernorm", "self_attn", "ffn_hc", "post_attention_layernorm"):
        getattr(block, name).load_state_dict(getattr(last, name).state_dict())
    block.mlp.load_state_dict(last.mlp.state_dict())
    # the head reader starts as the pre part of the last FFN's mixer (whose pre the main head
    # collapses the streams with)
    hc, mixer = model.config.hc_mult, last.ffn_hc
    block.head_hc.fn.copy_(mixer.fn[:hc])
    block.head_hc.base.copy_(mixer.base[:hc])
    block.head_hc.scale.copy_(mixer.scale[:1])
    block.shared_head.norm.load_state_dict(model.model.norm.state_dict())
    block.enorm.weight.fill_(embed_rms)
    block.hnorm.weight.fill_(stream_rms)
    d = model.config.hidden_size
    eye = torch.eye(d, dtype=block.eh_proj.weight.dtype)
    block.eh_proj.weight.copy_(torch.cat([eye, eye], dim=1))


# ---- data ----------------------------------------------------------------------------------


def held_out(count: int, length: int, far: int, records) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out sequences (seeds from the eval split's range; training seeds are < 10M):
    inputs [N, length - 1] and a mask of the positions whose next token is an answer."""
    base = SPLIT_SEEDS["eval"]
    seqs, answers = zip(
        *(make_training_sequence(base + i, length, far, records) for i in range(count))
    )
    ids = torch.tensor(seqs)[:, :-1]
    asks = torch.zeros_like(ids, dtype=torch.bool)
    for row, positions in enumerate(answers):
        asks[row, [p - 1 for p in positions]] = True  # position of <ans>: predicts the value
    return ids, asks


def agreement(draft_argmax, target_argmax, mask) -> dict:
    """Teacher-forced agreement on the masked positions and its chance baseline (always the
    most frequent target argmax of those positions)."""
    d, t = draft_argmax[mask], target_argmax[mask]
    mode = torch.bincount(t).argmax()
    return {
        "positions": int(t.numel()),
        "agreement": round((d == t).float().mean().item(), 4),
        "chance": round((t == mode).float().mean().item(), 4),
    }


@torch.no_grad()
def evaluate(model, ids, asks, target=None, chunk=8) -> dict:
    """Agreement over all draft positions and the answer ones (draft p: target at p + 1 is
    an ``<ans>`` position). ``target``: cached (logits, streams) of the dense target."""
    da, ta, am = [], [], []
    for i in range(0, ids.shape[0], chunk):
        part = ids[i : i + chunk]
        logits, streams = target[0][i : i + chunk], target[1][i : i + chunk]
        nxt, res, lab = draft_pairs(part, logits, streams)
        out, _ = draft_forward(model, nxt, res)
        da.append(out.argmax(-1))
        ta.append(lab.argmax(-1))
        am.append(asks[i : i + chunk, 1:])
    da, ta, am = torch.cat(da), torch.cat(ta), torch.cat(am)
    return {"all": agreement(da, ta, torch.ones_like(am)), "answers": agreement(da, ta, am)}


@torch.no_grad()
def evaluate_reference(model, ids, asks) -> dict:
    """The same agreement with the sparse reference target and atom's own
    ``reference_draft_forward``, one sequence at a time."""
    da, ta, am = [], [], []
    for row in range(ids.shape[0]):
        logits, streams = reference_target_forward(model, ids[row])
        out, _ = reference_draft_forward(model, ids[row, 1:], streams[:-1])
        da.append(out.argmax(-1))
        ta.append(logits[1:].argmax(-1))
        am.append(asks[row, 1:])
    da, ta, am = torch.cat(da), torch.cat(ta), torch.cat(am)
    return {"all": agreement(da, ta, torch.ones_like(am)), "answers": agreement(da, ta, am)}


@torch.no_grad()
def cache_target(model, ids, chunk=8):
    parts = [target_forward(model, ids[i : i + chunk]) for i in range(0, ids.shape[0], chunk)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


# ---- the target's own greedy continuations (self-generated data) -------------------------


def engine(directory: Path, *, k: int = 0, seqs: int = 16, blocks: int = 48):
    """The engine on CPU in float32 (as the measurements run it), ``k`` draft tokens."""
    from atom import LLM

    return LLM(
        str(directory),
        device="cpu",
        dtype="float32",
        block_size=256,
        num_blocks=blocks,
        max_num_seqs=seqs,
        speculative_tokens=k,
    )


def generate(llm, prompts: list[list[int]], length: int) -> list[list[int]]:
    """Greedy continuations of ``length`` tokens (ignore_eos) from the engine."""
    from atom import SamplingParams

    outs = llm.generate(prompts, SamplingParams(max_tokens=length, ignore_eos=True))
    return [list(o.token_ids) for o in outs]


def self_generated_prompts(count: int, lengths, group: int, seed: int) -> list[list[int]]:
    """Recall prompts (``make_example``) from the train split's range (seeds 5,000,000 + i, away
    from the ones ``tools.train_recall.batch`` uses first; eval seeds are >= 10M), in groups of
    ``group`` sharing a length drawn from ``lengths`` (so a group stacks into one batch)."""
    rng = random.Random(seed + 1)
    base = SPLIT_SEEDS["train"] + 5_000_000
    assert base + count < SPLIT_SEEDS["eval"]
    prompts, length = [], 0
    for i in range(count):
        if i % group == 0:
            length = rng.randrange(lengths[0], lengths[1] + 1, 16)
        prompts.append(make_example(base + i, length, records=(2, 8)).prompt)
    return prompts


@torch.no_grad()
def sparse_targets(model, seqs: list[list[int]], group: int) -> list:
    """The sparse reference target (what inference runs) over each sequence, stacked per group
    of equal length into pool items (ids [B, S], no answer mask, logits, streams)."""
    items = []
    for i in range(0, len(seqs), group):
        part = seqs[i : i + group]
        assert len({len(q) for q in part}) == 1
        outs = [reference_target_forward(model, q) for q in part]
        ids = torch.tensor(part)
        items.append(
            (
                ids,
                torch.zeros_like(ids, dtype=torch.bool),
                torch.stack([o[0] for o in outs]),
                torch.stack([o[1] for o in outs]),
            )
        )
    return items


@torch.no_grad()
def continuation_agreement(model, prompts, continuations) -> dict:
    """Teacher-forced agreement (sparse reference target, ``reference_draft_forward``) on the
    prompt + continuation sequences, split into the draft positions whose label (the target's
    argmax at p + 1) is the target's choice after a generated token (p + 1 >= len(prompt): the
    positions speculative decoding drafts at) and the rest (the prompt)."""
    da, ta, gen = [], [], []
    for prompt, cont in zip(prompts, continuations):
        ids = torch.tensor(prompt + cont)
        logits, streams = reference_target_forward(model, ids)
        out, _ = reference_draft_forward(model, ids[1:], streams[:-1])
        da.append(out.argmax(-1))
        ta.append(logits[1:].argmax(-1))
        g = torch.zeros(ids.numel() - 1, dtype=torch.bool)
        g[len(prompt) - 1 :] = True  # p + 1 a generated token: the positions decoding drafts at
        gen.append(g)
    da, ta, gen = torch.cat(da), torch.cat(ta), torch.cat(gen)
    return {"continuation": agreement(da, ta, gen), "prompt": agreement(da, ta, ~gen)}


def measure(directory: Path, count: int, prompt_len: int, gen_len: int) -> dict:
    """Before/after numbers on held-out prompts (``split("eval", count, prompt_len)``): their
    greedy continuations from the engine (k = 0), teacher-forced agreement on them, and the
    engine's acceptance at k = 1 and k = 3 (greedy output checked equal to k = 0's)."""
    from benchmarks.recall_task import split

    t0 = time.time()
    prompts = [e.prompt for e in split("eval", count, prompt_len)]
    blocks = 64
    outs = generate(engine(directory, k=0, seqs=8, blocks=blocks), prompts, gen_len)
    model = load_model(directory, dense=False, draft_from="checkpoint")
    res = {"prompts": f"split('eval', {count}, {prompt_len})", "gen_len": gen_len}
    res["agreement"] = continuation_agreement(model, prompts, outs)
    for k in (1, 3):
        llm = engine(directory, k=k, seqs=8, blocks=blocks)
        spec_outs = generate(llm, prompts, gen_len)
        spec = llm.engine.stats()["speculative"]
        res[f"k{k}"] = {
            "acceptance_rate": round(spec["acceptance_rate"], 4),
            "same_output_as_k0": spec_outs == outs,
            **{key: spec[key] for key in ("draft_tokens", "accepted_tokens", "tokens_per_verify")},
        }
    res["seconds"] = round(time.time() - t0, 1)
    return res


# ---- saving --------------------------------------------------------------------------------


def write_draft(model, directory: Path) -> dict:
    """Add the draft layer's tensors to model.safetensors (``model`` is the bf16 model: its
    tensors' dtypes as the target's are stored, bf16 but for the float32 biases and sinks),
    keeping every other tensor's bytes, and set num_nextn_predict_layers: 1 in config.json
    (and dspark_stages: 0 where it has DSpark stages: this makes the MTP layer the drafter).
    Returns the check's counts."""
    f = directory / "model.safetensors"
    first = model.config.num_hidden_layers
    prefix = f"model.layers.{first}."
    with safe_open(str(f), framework="pt") as sf:
        metadata = sf.metadata()
        kept = {k: sf.get_tensor(k) for k in sf.keys() if not k.startswith(prefix)}
    draft = {
        k: v.detach().contiguous().clone()
        for k, v in checkpoint_tensors(model).items()
        if k.startswith(prefix)
    }
    mode = f.stat().st_mode & 0o777
    save_file({**kept, **draft}, str(f), metadata=metadata)
    f.chmod(mode)
    with safe_open(str(f), framework="pt") as sf:
        names = set(sf.keys())
        for k, v in kept.items():
            w = sf.get_tensor(k)
            assert w.dtype == v.dtype and w.shape == v.shape, k
            assert torch.equal(w.view(torch.uint8), v.view(torch.uint8)), k
    assert names == set(kept) | set(draft)
    cfg_path = directory / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_nextn_predict_layers"] = 1
    if cfg.get("dspark_stages"):  # a model drafts with one of them (tools/train_dspark.py)
        cfg["dspark_stages"] = 0
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return {"target_tensors_unchanged": len(kept), "draft_tensors": len(draft)}


# ---- main ----------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="models/v41-recall")
    ap.add_argument("--minutes", type=float, default=20.0, help="training loop budget")
    ap.add_argument("--steps", type=int, default=0, help="a step budget instead of --minutes")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lengths", type=int, nargs=2, default=[128, 384])
    ap.add_argument("--far", type=int, default=80)
    ap.add_argument("--records", type=int, nargs=2, default=[2, 8])
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--reuse", type=int, default=4, help="steps per fresh target batch")
    ap.add_argument("--pool", type=int, default=48, help="target batches kept")
    ap.add_argument("--answer-weight", type=float, default=8.0)
    ap.add_argument("--ce", type=float, default=0.5, help="weight of CE to the target argmax")
    ap.add_argument("--eval-seqs", type=int, default=96)
    ap.add_argument("--eval-length", type=int, default=384)
    ap.add_argument("--reference-seqs", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-write", action="store_true", help="train and measure only")
    ap.add_argument(
        "--init-from-committed",
        action="store_true",
        help="continue from the checkpoint's draft layer instead of the layer-9 copy",
    )
    ap.add_argument(
        "--self-generated",
        type=int,
        default=0,
        help="recall prompts (train seeds) continued greedily by the engine, added to the data",
    )
    ap.add_argument("--gen-len", type=int, default=96, help="tokens generated per prompt")
    ap.add_argument("--gen-prompt-lengths", type=int, nargs=2, default=[96, 384])
    ap.add_argument(
        "--self-mix", type=float, default=0.5, help="fraction of steps on self-generated data"
    )
    ap.add_argument(
        "--measure",
        type=int,
        default=0,
        help="held-out engine measurement (split('eval', N, 192), 64 tokens) after writing",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    directory = Path(args.model)
    records = tuple(args.records)
    t_start = time.time()

    model = load_model(
        directory, dense=True, draft_from="checkpoint" if args.init_from_committed else "init"
    )
    model.requires_grad_(False)
    probe, _ = batch(0, args.batch, args.lengths[1], model.device, args.far, records)
    logits, streams = target_forward(model, probe)
    embed_rms = model.model.embed_tokens.weight.pow(2).mean().sqrt().item()
    stream_rms = streams.pow(2).mean(-1).sqrt().median().item()
    if not args.init_from_committed:
        init_draft(model, embed_rms, stream_rms)
    generated: list = []
    gen_info: dict = {}
    if args.self_generated:
        t_gen = time.time()
        prompts = self_generated_prompts(
            args.self_generated, args.gen_prompt_lengths, args.batch, args.seed
        )
        outs = generate(engine(directory, k=0, seqs=16, blocks=48), prompts, args.gen_len)
        gen_s = round(time.time() - t_gen, 1)
        sparse_model = load_model(directory, dense=False, draft_from="checkpoint")
        sparse_model.requires_grad_(False)
        seqs = [q + o for q, o in zip(prompts, outs)]
        generated = sparse_targets(sparse_model, seqs, args.batch)
        del sparse_model
        gen_info = {
            "prompts": args.self_generated,
            "seeds": f"{SPLIT_SEEDS['train'] + 5_000_000}.."
            f"{SPLIT_SEEDS['train'] + 5_000_000 + args.self_generated - 1}",
            "make": "benchmarks.recall_task.make_example, records (2, 8)",
            "prompt_lengths": args.gen_prompt_lengths,
            "gen_len": args.gen_len,
            "engine": "LLM(device=cpu, float32, block_size 256, max_num_seqs 16), greedy, k=0",
            "generate_seconds": gen_s,
            "sparse_target_seconds": round(time.time() - t_gen - gen_s, 1),
            "batches": len(generated),
        }
        print({"self_generated": gen_info}, flush=True)
    params = list(model.mtp.parameters())
    for p in params:
        p.requires_grad_(True)
    n_params = sum(p.numel() for p in params)
    print({"embed_rms": round(embed_rms, 4), "stream_rms": round(stream_rms, 4)}, flush=True)
    print({"draft_params": n_params}, flush=True)
    # the batched mirror agrees with atom's reference_draft_forward
    with torch.no_grad():
        nxt, res, _ = draft_pairs(probe[:1], logits[:1], streams[:1])
        mine = draft_forward(model, nxt, res)[0][0]
        ref = reference_draft_forward(model, nxt[0], res[0])[0]
        mirror_err = (mine - ref).abs().max().item()
    print({"draft_forward_vs_reference_max_abs": mirror_err}, flush=True)
    assert mirror_err < 1e-3, mirror_err

    ev_ids, ev_asks = held_out(args.eval_seqs, args.eval_length, args.far, records)
    ev_target = cache_target(model, ev_ids)
    initial = evaluate(model, ev_ids, ev_asks, ev_target)
    print({"eval_at_init": initial}, flush=True)

    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    pool: list = []
    t0, step, fresh, log = time.time(), 0, 0, []
    budget = args.minutes * 60

    def progress() -> float:  # the fraction of the budget spent
        return step / args.steps if args.steps else (time.time() - t0) / budget

    gen_steps = 0
    while progress() < 1:
        is_gen = bool(generated) and rng.random() < args.self_mix
        if is_gen:
            item = generated[rng.randrange(len(generated))]
            gen_steps += 1
        elif step % args.reuse == 0 or not pool:
            length = rng.randrange(args.lengths[0], args.lengths[1] + 1, 16)
            ids, targets = batch(fresh, args.batch, length, model.device, args.far, records)
            logits, streams = target_forward(model, ids)
            pool.append((ids, targets != -100, logits, streams))
            pool = pool[-args.pool :]
            fresh += 1
            item = pool[-1]
        else:
            item = pool[rng.randrange(len(pool))]
        ids, asks, logits, streams = item
        frac = progress()
        lr = args.lr * min(1.0, (step + 1) / 50) * (0.05 + 0.95 * (1 - frac))
        for g in opt.param_groups:
            g["lr"] = lr
        nxt, res, lab = draft_pairs(ids, logits, streams)
        out, _ = draft_forward(model, nxt, res)
        logq = F.log_softmax(out, -1)
        logp = F.log_softmax(lab, -1)
        kl = (logp.exp() * (logp - logq)).sum(-1)
        ce = F.nll_loss(logq.flatten(0, 1), lab.argmax(-1).flatten(), reduction="none")
        ans = asks[:, 1:]
        w = 1.0 + (args.answer_weight - 1.0) * ans.float()
        per = kl + args.ce * ce.view_as(kl)
        loss = (per * w).sum() / w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 25 == 0:
            agree = out.argmax(-1) == lab.argmax(-1)
            rec = {
                "step": step,
                "s": round(time.time() - t0, 1),
                "fresh_batches": fresh,
                "len": ids.shape[1] + 1,
                "loss": round(loss.item(), 4),
                "kl": round(kl.mean().item(), 4),
                "kl_answers": round(kl[ans].mean().item(), 4) if ans.any() else None,
                "train_agree": round(agree.float().mean().item(), 4),
                "train_agree_answers": (
                    round(agree[ans].float().mean().item(), 4) if ans.any() else None
                ),
                "self_generated": is_gen,
                "lr": round(lr, 6),
            }
            if step % 200 == 0:
                rec["eval"] = evaluate(model, ev_ids, ev_asks, ev_target)
            log.append(rec)
            print(rec, flush=True)
    train_s = round(time.time() - t0, 1)
    print({"steps": step, "fresh_batches": fresh, "gen_steps": gen_steps, "train_s": train_s})

    # the model as stored (bf16 weights, float32 biases and sinks, as train_recall saves it)
    stored = DeepseekV41ForCausalLM(model.config, dtype=torch.bfloat16)
    stored.load_state_dict(model.state_dict())
    model.load_state_dict(stored.state_dict())
    if args.no_write:
        final = evaluate(model, ev_ids, ev_asks, ev_target)
        print({"eval_bf16": final}, flush=True)
        return
    written = write_draft(stored, directory)
    print(written, flush=True)
    loaded = load_model(directory, dense=True, draft_from="checkpoint")
    for a, b in zip(loaded.mtp.parameters(), params):
        assert torch.equal(a, b)
    final = evaluate(loaded, ev_ids, ev_asks, ev_target)
    print({"eval_dense": final}, flush=True)
    sparse = load_model(directory, dense=False, draft_from="checkpoint")
    ref = evaluate_reference(sparse, ev_ids[: args.reference_seqs], ev_asks[: args.reference_seqs])
    print({"eval_sparse_reference": ref}, flush=True)
    command = "python -m tools.train_draft " + " ".join(
        f"--{k.replace('_', '-')}"
        + ("" if v is True else f" {' '.join(map(str, v)) if isinstance(v, list) else v}")
        for k, v in vars(args).items()
        if v is not False
    )
    measured = measure(directory, args.measure, 192, 64) if args.measure else None
    if measured:
        print({"measured": measured}, flush=True)
    record_path = directory / "draft_training.json"
    previous = json.loads(record_path.read_text()) if args.init_from_committed else None
    record_path.write_text(
        json.dumps(
            {
                "command": command,
                "init_from_committed": args.init_from_committed,
                "self_generated": gen_info or None,
                "self_generated_steps": gen_steps,
                "engine_measurement": measured,
                "steps": step,
                "fresh_target_batches": fresh,
                "train_seconds": train_s,
                "total_seconds": round(time.time() - t_start, 1),
                "draft_params": n_params,
                "init": {"embed_rms": embed_rms, "stream_rms": stream_rms},
                "held_out": {
                    "sequences": args.eval_seqs,
                    "length": args.eval_length,
                    "seeds": f"{SPLIT_SEEDS['eval']}..{SPLIT_SEEDS['eval'] + args.eval_seqs - 1}",
                    "make": "benchmarks.recall_task.make_training_sequence",
                },
                "agreement_at_init_dense": initial,
                "agreement_dense": final,
                "agreement_sparse_reference": {"sequences": args.reference_seqs, **ref},
                "written": written,
                "log": log,
                "device": "cpu",
                "threads": args.threads,
                **({"previous": previous} if previous else {}),
            },
            indent=1,
        )
    )
    print("wrote", directory, flush=True)


if __name__ == "__main__":
    main()
