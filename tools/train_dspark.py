"""Give the trained recall model (models/v41-recall) one trained DSpark stage.

The stage of models/v41-recall was made by

    python -m tools.train_dspark --minutes 18 --self-generated 192 --gen-len 96 --self-mix 0.5 \
        --eval-seqs 32 --eval-every 250 --reference-seqs 16 --measure 32 --threads 2

(two CPU threads, shared for part of the run with another job's test run: the engine's greedy
continuations (96 tokens) of 192 recall prompts from train seeds, 222 s, their sparse reference
targets 108 s; then 380 steps in 1,082 s (18 minutes), 191 on those sequences and 189 on 47
fresh dense-target batches of recall training sequences; 1,488 s to the written checkpoint, the
engine measurement 366 s more; record: models/v41-recall/dspark_training.json). lr 2e-3 and the
random init were picked by 3-minute probes (``--no-write``, 16 held-out sequences, dense target,
slot 0 / 1 / 2): the layer-9 copy at lr 1e-3, 153 steps, 0.784 / 0.785 / 0.779; the random init
at lr 1e-3, 101 steps, 0.817 / 0.802 / 0.802; at lr 2e-3, 157 steps, 0.818 / 0.807 / 0.804
(answers slot 0: 0.52, 0.50, 0.73).

Held-out teacher-forced agreement per block slot (32 sequences of 384 tokens, eval seeds),
slot 0 / 1 / 2, before (the random init) -> after: dense target 0.006 / 0.011 / 0.011 ->
0.866 / 0.855 / 0.848 (chance 0.21), on answer positions 0.05 / 0 / 0 -> 0.75 / 0.75 / 0.75
(chance 0.16 / 0.14 / 0.14); sparse reference target (16 of them), as inference runs,
0.739 / 0.726 / 0.710 (chance 0.32), answers 0.77 / 0.72 / 0.65 (chance 0.37 / 0.34 / 0.34).
The engine (``measure``: split("eval", 32, 192), 64 greedy tokens, CPU float32): acceptance
at k = 1 0.674 (1.67 tokens per verify), k = 2 0.533 (2.06), k = 3 0.453 (2.34), every output
equal to k = 0's; teacher-forced agreement on the blocks drafted after a generated token
0.730 / 0.715 / 0.677 (chance 0.34), on the prompt 0.791 / 0.767 / 0.754.

What is trained: DSpark, DeepSeek-V4.1's block drafter (``atom.models.deepseek_v41.dspark``:
read its module doc), one stage (``dspark.0.*``) drafting blocks of ``--block-size`` tokens.
The target (the ten main layers, the embedding and the head) is loaded from the directory and
frozen; the model is rebuilt from the directory's config with ``num_nextn_predict_layers: 0``
and the DSpark keys (``DSPARK``: one stage, block 3, Markov rank 32, the target's 4 experts
choosing 2, target layers 7, 8, 9, noise token 258).

Choices. Target layers [7, 8, 9]: the inputs of the last three layers. Layer 7 is the last
compressed-attention layer (ratios 1 x5, 2 x3, then window-only 8 and 9), so by its input
layers 0-6 have read the far records through compressed rows and the indexer, and the inputs of
8 and 9 are the streams closest to the head (what the target's own next-token choice is made
from; the MTP draft read layer 9's output). Other choices were not measured. Noise token 258:
``benchmarks.recall_task`` uses ids 0-255 (records), 256 / 257 (bos / eos), 260-319 (query,
ans, keys, values, filler); 258 and 259 are never produced (tokenizer.json names them "<258>",
"<259>"), so the noise id is never a real input. Expert counts: the target's (4 / 2); no
measurement suggested otherwise.

Distillation. For every position p of a training sequence (p + B < S), the block
[t(p+1), noise, ...] at positions p+1 .. p+B attends the stage's window of target KV (from the
target hidden of positions max(0, p - 63) .. p) and its own block, as ``draft_block`` does; the
label of slot i is the target's own distribution at position p+1+i (it predicts p+2+i), the
loss KL to it plus ``--ce`` times the cross-entropy to its argmax, answer positions (p+1+i an
``<ans>`` token) weighted ``--answer-weight``. The Markov head is teacher-forced: slot 0's
previous token is t(p+1) (as in ``draft_block``), slot i's is the sequence's own token at
p+1+i, the token the target's label distribution at p+1+i was computed after (at inference the
draft for slot i - 1 is that token exactly when it is accepted). ``stage_forward`` is the
batched, grad-enabled mirror of ``dspark.draft_block`` over every position of a batch (each
block one tile of ``attend_tiles``, as ``dspark_paged.draft_blocks`` runs it; checked against
``draft_block`` with ``forced`` = the same tokens at start, fp32). The confidence head is
trained alongside on detached inputs (binary CE of "slot i's argmax equals the target's"); the
engine does not read it. The MoE router's balancing bias (``e_score_correction_bias``) gets no
gradient and stays at its init.

Data: recall-task training sequences (``tools.train_recall.batch``, train seeds) through the
dense target (``target_forward``: ``dense.dense_forward`` that also returns the target hidden),
each target batch reused ``--reuse`` times on average from a pool; and with
``--self-generated N`` the engine's own greedy continuations (``--gen-len`` tokens, k = 0) of N
recall prompts (train seeds 5,000,000 + i, as tools/train_draft.py), labels and hidden from the
sparse reference forward (``reference.reference_with_hidden``, what inference runs), a fraction
``--self-mix`` of the steps.

Initialisation: the model's random init (``init_weights(0)``; ``--init random``, used), or
(``--init layer9``, ``init_stage``) the stage's block as a copy of layer 9 (window-only, like the
stage: mHC, norms, attention, MoE), ``norm`` the model's final norm, ``main_proj`` reads the
layer-9 input part of the target hidden ([0, 0, I]) and ``main_norm`` is layer 9's
``input_layernorm``, so the window keys start as layer 9's own would be (up to the stream mix);
the Markov head and the confidence head start at zero (the Markov embedding random).

Evaluation (held-out recall sequences, eval-split seeds): teacher-forced agreement per block
slot (slot i agrees when its argmax equals the target's argmax at p+1+i), over all positions
and the answer ones, with the dense target (as trained) and the sparse reference target (as
inference runs); chance: always the most frequent target argmax of those positions. ``measure``:
held-out prompts (``split("eval", N, 192)``), 64 greedy tokens from the engine, teacher-forced
agreement on the continuation and the engine's acceptance at k = 1, 2, 3 (outputs checked
equal to k = 0's). Writing: the stage's tensors are added to model.safetensors under atom's
own names (``checkpoint_tensors``: ``dspark.0.*``), bf16 as the target's are stored (float32
for the float32 parameters: biases, sinks, mHC mixers, the Markov and confidence heads); every
other tensor's bytes are kept (the MTP draft layer, ``model.layers.10.*``, stays: the loader
leaves a draft layer the config does not build unread); config.json gets the DSpark keys and
``num_nextn_predict_layers: 0``; dspark_training.json records the run. (The loader does not
leave unbuilt DSpark stages unread: a model built from this directory without them, e.g. the
MTP layer's, loads through ``weights.load_weights``, which leaves unbuilt drafters unread.)
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

from atom.models.common.mhc import collapse, identity_pre
from atom.models.deepseek_v41.dense import _attention as dense_attention
from atom.models.deepseek_v41.dspark import draft_block
from atom.models.deepseek_v41.dspark_paged import _attend as dspark_attend
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.reference import reference_with_hidden
from atom.models.deepseek_v41.weights import checkpoint_tensors, load_weights
from benchmarks.recall_task import SPLIT_SEEDS, split
from tools.train_draft import (
    DENSE,
    agreement,
    engine,
    generate,
    held_out,
    load_checkpoint,
    read_config,
    self_generated_prompts,
)
from tools.train_recall import batch

NOISE_TOKEN = 258  # never produced by benchmarks.recall_task (module doc)
DSPARK = {
    "dspark_stages": 1,
    "dspark_block_size": 3,
    "dspark_noise_token_id": NOISE_TOKEN,
    "dspark_target_layer_ids": [7, 8, 9],
    "dspark_markov_rank": 32,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
}


def load_model(
    directory: Path, *, dense: bool, stage_from: str = "init", dspark: dict | None = None
) -> DeepseekV41ForCausalLM:
    """The model of ``directory`` in float32 with the DSpark stage (``dspark``: its keys,
    default ``DSPARK``), no MTP draft layer: the target's tensors from the checkpoint; the
    stage's from it too (``stage_from="checkpoint"``, the config's own DSpark keys) or left at
    the random init."""
    extra = DENSE if dense else {}
    if stage_from == "checkpoint":
        model = DeepseekV41ForCausalLM(read_config(directory, num_nextn_predict_layers=0, **extra))
        assert len(model.dspark), "the directory's config has no DSpark stages"
        load_weights(model, directory)
        return model
    plain = {"num_nextn_predict_layers": 0, "dspark_stages": 0}
    target = DeepseekV41ForCausalLM(read_config(directory, **plain, **extra))
    load_checkpoint(target, directory)  # the checkpoint's drafters are left unread
    cfg = {**plain, **(dspark or DSPARK)}
    model = DeepseekV41ForCausalLM(read_config(directory, **cfg, **extra)).init_weights(0)
    missing, unexpected = model.load_state_dict(target.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("dspark.") for k in missing), (missing, unexpected)
    return model


# ---- forwards ------------------------------------------------------------------------------


@torch.no_grad()
def target_forward(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dense.dense_forward`` (no indexer loss) that also returns DSpark's target hidden:
    ids [N, S] -> (float32 logits [N, S, V], hidden [N, S, targets * d])."""
    n, s = ids.shape
    targets = model.config.dspark_target_layer_ids
    hist = torch.full((n, 3), -1, dtype=torch.int64, device=ids.device)
    grams = torch.cat([hist, ids], dim=1).unfold(1, 4, 1).reshape(n * s, 4)
    x = model._embed(ids.reshape(-1))
    pre = identity_pre(x)
    rows: dict = {}
    hidden: list = []
    for i, layer in enumerate(model.model.layers):

        def attend(u, a=layer.self_attn):
            return dense_attention(a, u.view(n, s, -1), rows, model.index_dtype, []).reshape(
                n * s, -1
            )

        tap = (lambda h: hidden.append(h.mean(dim=1))) if i in targets else None
        x, pre = layer.block(x, pre, model.engram_rows(grams), attend, tap)
    return model._head(x, pre).view(n, s, -1), torch.cat(hidden, -1).view(n, s, -1)


def stage_forward(model, ids: torch.Tensor, hidden: torch.Tensor):
    """Batched, grad-enabled ``dspark.draft_block`` with the Markov head teacher-forced:
    ids [N, S], hidden [N, S, targets * d] (the target hidden of every position) -> for every
    block position p = 0 .. S - B - 1: (logits [N, P, B, V] float32, slot i predicting p+2+i;
    confidence logits [N, P, B] (from detached inputs); the Markov tokens [N, P, B]: t(p+1),
    then the sequence's tokens at p+2 .. p+B)."""
    c = model.config
    st = model.dspark[0]
    n, s = ids.shape
    b, win = c.dspark_block_size, c.sliding_window
    p_n = s - b
    dev = ids.device
    main_x = st.main_x(hidden.reshape(n * s, -1))
    tkv = st.target_kv(main_x, torch.arange(s, device=dev).repeat(n)).view(n, s, -1)
    p = torch.arange(p_n, device=dev)
    ring_pos = p[:, None] - win + 1 + torch.arange(win, device=dev)  # [P, W], oldest first
    ring = tkv[:, ring_pos.clamp(min=0)].reshape(n * p_n, win, -1)
    valid = torch.cat([ring_pos >= 0, torch.ones(p_n, b, dtype=torch.bool, device=dev)], 1)
    mask = valid[None, :, None, :].expand(n, p_n, b, win + b).reshape(n * p_n, b, win + b)
    slots = p[:, None] + 1 + torch.arange(b, device=dev)  # [P, B]: positions p+1 .. p+B
    block_ids = torch.full((n, p_n, b), c.dspark_noise_token_id, dtype=torch.int64, device=dev)
    block_ids[:, :, 0] = ids[:, 1 : p_n + 1]
    block_pos = slots[None].expand(n, -1, -1).reshape(-1)
    x = model._embed(block_ids.reshape(-1))
    pre = identity_pre(x)
    x, pre = st.block(
        x, pre, None, lambda u: dspark_attend(st, u, ring, mask.contiguous(), block_pos)
    )
    h = collapse(x, pre)
    logits = F.linear(st.norm(h).float(), model.lm_head.weight.float()).view(n, p_n, b, -1)
    markov_ids = ids[:, slots]  # slot i: the token at p+1+i
    bias, e = st.markov(markov_ids)
    logits = logits + bias
    conf_in = torch.cat([h.view(n, p_n, b, -1).detach(), e.detach()], -1).float()
    conf = st.confidence(conf_in).squeeze(-1)
    return logits, conf, markov_ids


def block_labels(model, target_logits: torch.Tensor, asks: torch.Tensor):
    """The labels of ``stage_forward``'s slots: target logits at p+1+i [N, P, B, V] and
    whether p+1+i is an answer position [N, P, B]."""
    b = model.config.dspark_block_size
    s = target_logits.shape[1]
    slots = torch.arange(s - b)[:, None] + 1 + torch.arange(b)
    return target_logits[:, slots], asks[:, slots]


# ---- initialisation ------------------------------------------------------------------------


@torch.no_grad()
def init_stage(model) -> None:
    """The stage from the target's last layer (module doc)."""
    st, last = model.dspark[0], model.model.layers[-1]
    for name in ("attn_hc", "input_layernorm", "self_attn", "ffn_hc", "post_attention_layernorm"):
        getattr(st, name).load_state_dict(getattr(last, name).state_dict())
    st.mlp.load_state_dict(last.mlp.state_dict())
    st.norm.load_state_dict(model.model.norm.state_dict())
    d, targets = model.config.hidden_size, model.config.dspark_target_layer_ids
    w = torch.zeros(d, d * len(targets))
    if model.config.num_hidden_layers - 1 in targets:
        at = targets.index(model.config.num_hidden_layers - 1)
        w[:, at * d : (at + 1) * d] = torch.eye(d)
    else:
        w[:, -d:] = torch.eye(d)
    st.main_proj.weight.copy_(w)
    st.main_norm.load_state_dict(last.input_layernorm.state_dict())
    st.markov_head.weight.zero_()
    st.confidence.weight.zero_()


# ---- evaluation ----------------------------------------------------------------------------


def slot_agreements(drafted, greedy, mask) -> list[dict]:
    """Per block slot: ``agreement`` over the masked positions. drafted / greedy / mask
    [..., B]."""
    return [
        agreement(drafted[..., i].flatten(), greedy[..., i].flatten(), mask[..., i].flatten())
        for i in range(drafted.shape[-1])
    ]


def summarize(drafted, greedy, answers) -> dict:
    """Per-slot agreement overall and on answer positions (``answers`` None: left out), and the
    mean number of leading
    slots that agree (teacher-forced: an upper-bound proxy of accepted drafts per block)."""
    agree = drafted == greedy
    lead = agree.int().cumprod(-1).sum(-1).float().mean().item()
    res = {"all": slot_agreements(drafted, greedy, torch.ones_like(agree))}
    if answers is not None:
        res["answers"] = slot_agreements(drafted, greedy, answers)
    return {**res, "leading_agreed_slots": round(lead, 4)}


@torch.no_grad()
def evaluate(model, ids, asks, target, chunk=8) -> dict:
    """Dense target (cached ``target``: logits, hidden): per-slot agreement (``summarize``)."""
    da, ta, am = [], [], []
    for i in range(0, ids.shape[0], chunk):
        logits, hidden = target[0][i : i + chunk], target[1][i : i + chunk]
        out, _, _ = stage_forward(model, ids[i : i + chunk], hidden)
        lab, ans = block_labels(model, logits, asks[i : i + chunk])
        da.append(out.argmax(-1))
        ta.append(lab.argmax(-1))
        am.append(ans)
    return summarize(torch.cat(da), torch.cat(ta), torch.cat(am))


@torch.no_grad()
def evaluate_reference(model, ids, asks) -> dict:
    """The same with the sparse reference target (``reference_with_hidden``, the saved
    config's top-k), one sequence at a time."""
    da, ta, am = [], [], []
    for row in range(ids.shape[0]):
        logits, hidden = reference_with_hidden(model, ids[row])
        out, _, _ = stage_forward(model, ids[row : row + 1], hidden[None])
        lab, ans = block_labels(model, logits[None], asks[row : row + 1])
        da.append(out.argmax(-1))
        ta.append(lab.argmax(-1))
        am.append(ans)
    return summarize(torch.cat(da), torch.cat(ta), torch.cat(am))


@torch.no_grad()
def cache_target(model, ids, chunk=8):
    parts = [target_forward(model, ids[i : i + chunk]) for i in range(0, ids.shape[0], chunk)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


@torch.no_grad()
def check_mirror(model, ids, hidden, positions) -> float:
    """Max |logits| difference of ``stage_forward`` against ``dspark.draft_block`` (Markov head
    forced through the same tokens) at ``positions`` of sequence 0; confidence too."""
    out, conf, markov = stage_forward(model, ids[:1], hidden[:1])
    b = model.config.dspark_block_size
    err = 0.0
    for p in positions:
        forced = markov[0, p, 1:].tolist() + [0]  # slot i + 1's previous token; last unused
        _, ref, ref_conf = draft_block(model, hidden[0, : p + 1], int(ids[0, p + 1]), p, forced)
        err = max(err, (out[0, p] - ref).abs().max().item())
        err = max(err, (conf[0, p] - ref_conf).abs().max().item())
        assert ref.shape[0] == b
    return err


@torch.no_grad()
def continuation_agreement(model, prompts, continuations) -> dict:
    """Teacher-forced per-slot agreement (sparse reference target) on prompt + continuation
    sequences, split by whether slot i's label position p+1+i is a generated token's (the
    positions speculative decoding drafts at: p+1 >= len(prompt) for slot 0) or the prompt's."""
    da, ta, gen = [], [], []
    b = model.config.dspark_block_size
    for prompt, cont in zip(prompts, continuations):
        ids = torch.tensor(prompt + cont)
        logits, hidden = reference_with_hidden(model, ids)
        out, _, _ = stage_forward(model, ids[None], hidden[None])
        slots = torch.arange(ids.numel() - b)[:, None] + 1 + torch.arange(b)
        da.append(out[0].argmax(-1))
        ta.append(logits[slots].argmax(-1))
        gen.append(slots >= len(prompt))
    da, ta, gen = torch.cat(da), torch.cat(ta), torch.cat(gen)
    drafting = gen[:, 0]  # the block's first slot after a generated token: decoding drafts there
    return {
        "continuation": summarize(da[drafting], ta[drafting], None),
        "prompt": summarize(da[~drafting], ta[~drafting], None),
    }


def measure(directory: Path, count: int, prompt_len: int, gen_len: int, ks=(1, 2, 3)) -> dict:
    """Held-out prompts (``split("eval", count, prompt_len)``): their greedy continuations from
    the engine (k = 0), teacher-forced agreement on them, and the engine's acceptance at each k
    (greedy output checked equal to k = 0's)."""
    t0 = time.time()
    prompts = [e.prompt for e in split("eval", count, prompt_len)]
    blocks = 64
    outs = generate(engine(directory, k=0, seqs=8, blocks=blocks), prompts, gen_len)
    model = load_model(directory, dense=False, stage_from="checkpoint")
    res = {"prompts": f"split('eval', {count}, {prompt_len})", "gen_len": gen_len}
    got = continuation_agreement(model, prompts, outs)
    res["agreement"] = got
    for k in ks:
        llm = engine(directory, k=k, seqs=8, blocks=blocks)
        spec_outs = generate(llm, prompts, gen_len)
        spec = llm.engine.stats()["speculative"]
        res[f"k{k}"] = {
            "acceptance_rate": round(spec["acceptance_rate"], 4),
            "same_output_as_k0": spec_outs == outs,
            **{key: spec[key] for key in ("draft_tokens", "accepted_tokens", "tokens_per_verify")},
        }
        print({f"k{k}": res[f"k{k}"]}, flush=True)
    res["seconds"] = round(time.time() - t0, 1)
    return res


# ---- data ----------------------------------------------------------------------------------


@torch.no_grad()
def sparse_targets(model, seqs: list[list[int]], group: int) -> list:
    """The sparse reference target over each sequence, stacked per group of equal length into
    pool items (ids [N, S], no answer mask, logits, hidden)."""
    items = []
    for i in range(0, len(seqs), group):
        part = seqs[i : i + group]
        assert len({len(q) for q in part}) == 1
        outs = [reference_with_hidden(model, q) for q in part]
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


# ---- saving --------------------------------------------------------------------------------


def write_stage(model, directory: Path) -> dict:
    """Add the stage's tensors (``dspark.*``, as ``checkpoint_tensors`` names them) to
    model.safetensors (``model``: the bf16 model, its float32 parameters float32), keeping
    every other tensor's bytes; config.json gets the DSpark keys and
    ``num_nextn_predict_layers: 0``. Returns the check's counts."""
    f = directory / "model.safetensors"
    with safe_open(str(f), framework="pt") as sf:
        metadata = sf.metadata()
        kept = {k: sf.get_tensor(k) for k in sf.keys() if not k.startswith("dspark.")}
    stage = {
        k: v.detach().contiguous().clone()
        for k, v in checkpoint_tensors(model).items()
        if k.startswith("dspark.")
    }
    mode = f.stat().st_mode & 0o777
    save_file({**kept, **stage}, str(f), metadata=metadata)
    f.chmod(mode)
    with safe_open(str(f), framework="pt") as sf:
        names = set(sf.keys())
        for k, v in kept.items():
            w = sf.get_tensor(k)
            assert w.dtype == v.dtype and w.shape == v.shape, k
            assert torch.equal(w.view(torch.uint8), v.view(torch.uint8)), k
    assert names == set(kept) | set(stage)
    cfg_path = directory / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_nextn_predict_layers"] = 0
    c = model.config
    cfg.update({k: getattr(c, k) for k in DSPARK})
    cfg_path.write_text(json.dumps(cfg, indent=2))
    mtp = sum(1 for k in kept if k.startswith(f"model.layers.{c.num_hidden_layers}."))
    return {
        "tensors_kept_byte_identical": len(kept),
        "of_which_mtp_draft_layer": mtp,
        "stage_tensors": len(stage),
    }


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
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--reuse", type=int, default=4, help="steps per fresh target batch")
    ap.add_argument("--pool", type=int, default=48, help="target batches kept")
    ap.add_argument("--answer-weight", type=float, default=8.0)
    ap.add_argument("--ce", type=float, default=0.5, help="weight of CE to the target argmax")
    ap.add_argument("--block-size", type=int, default=DSPARK["dspark_block_size"])
    ap.add_argument(
        "--target-layers", type=int, nargs="+", default=DSPARK["dspark_target_layer_ids"]
    )
    ap.add_argument("--markov-rank", type=int, default=DSPARK["dspark_markov_rank"])
    ap.add_argument(
        "--init",
        choices=("random", "layer9"),
        default="random",
        help="the stage's start: the model's random init, or a copy of layer 9 (init_stage)",
    )
    ap.add_argument("--eval-seqs", type=int, default=32)
    ap.add_argument("--eval-length", type=int, default=384)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--reference-seqs", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true", help="train and measure only")
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
    dspark = {
        **DSPARK,
        "dspark_block_size": args.block_size,
        "dspark_target_layer_ids": args.target_layers,
        "dspark_markov_rank": args.markov_rank,
    }

    model = load_model(directory, dense=True, dspark=dspark)
    model.requires_grad_(False)
    if args.init == "layer9":
        init_stage(model)
    probe, _ = batch(0, 2, args.lengths[1], model.device, args.far, records)
    p_logits, p_hidden = target_forward(model, probe)
    generated: list = []
    gen_info: dict = {}
    if args.self_generated:
        t_gen = time.time()
        prompts = self_generated_prompts(
            args.self_generated, args.gen_prompt_lengths, args.batch, args.seed
        )
        outs = generate(engine(directory, k=0, seqs=16, blocks=48), prompts, args.gen_len)
        gen_s = round(time.time() - t_gen, 1)
        sparse_model = load_model(directory, dense=False, dspark=dspark)
        sparse_model.requires_grad_(False)
        generated = sparse_targets(sparse_model, [q + o for q, o in zip(prompts, outs)], args.batch)
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
    params = list(model.dspark.parameters())
    for p in params:
        p.requires_grad_(True)
    n_params = sum(p.numel() for p in params)
    print({"stage_params": n_params, "dspark": dspark}, flush=True)
    s = probe.shape[1]
    positions = [0, 5, 63, 64, 200, s - args.block_size - 2]
    mirror_err = check_mirror(model, probe, p_hidden, positions)
    print({"stage_forward_vs_draft_block_max_abs": mirror_err}, flush=True)
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
            logits, hidden = target_forward(model, ids)
            pool.append((ids, targets != -100, logits, hidden))
            pool = pool[-args.pool :]
            fresh += 1
            item = pool[-1]
        else:
            item = pool[rng.randrange(len(pool))]
        ids, asks, logits, hidden = item
        frac = progress()
        lr = args.lr * min(1.0, (step + 1) / 50) * (0.05 + 0.95 * (1 - frac))
        for g in opt.param_groups:
            g["lr"] = lr
        out, conf, _ = stage_forward(model, ids, hidden)
        lab, ans = block_labels(model, logits, asks)
        logq = F.log_softmax(out, -1)
        logp = F.log_softmax(lab, -1)
        kl = (logp.exp() * (logp - logq)).sum(-1)
        greedy = lab.argmax(-1)
        ce = F.nll_loss(logq.flatten(0, 2), greedy.flatten(), reduction="none").view_as(kl)
        w = 1.0 + (args.answer_weight - 1.0) * ans.float()
        per = kl + args.ce * ce
        agree = out.detach().argmax(-1) == greedy
        conf_loss = F.binary_cross_entropy_with_logits(conf, agree.float())
        loss = (per * w).sum() / w.sum() + conf_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 25 == 0:
            rec = {
                "step": step,
                "s": round(time.time() - t0, 1),
                "fresh_batches": fresh,
                "len": ids.shape[1] + 1,
                "loss": round(loss.item(), 4),
                "kl_per_slot": [round(v, 4) for v in kl.mean((0, 1)).tolist()],
                "train_agree_per_slot": [round(v, 4) for v in agree.float().mean((0, 1)).tolist()],
                "conf_bce": round(conf_loss.item(), 4),
                "self_generated": is_gen,
                "lr": round(lr, 6),
            }
            if args.eval_every and step % args.eval_every == 0:
                ev = evaluate(model, ev_ids, ev_asks, ev_target)
                rec["eval_all_per_slot"] = [a["agreement"] for a in ev["all"]]
                rec["eval_answers_per_slot"] = [a["agreement"] for a in ev["answers"]]
            log.append(rec)
            print(rec, flush=True)
    train_s = round(time.time() - t0, 1)
    print({"steps": step, "fresh_batches": fresh, "gen_steps": gen_steps, "train_s": train_s})

    # the model as stored (bf16 weights; float32 parameters stay float32)
    stored = DeepseekV41ForCausalLM(model.config, dtype=torch.bfloat16)
    stored.load_state_dict(model.state_dict())
    model.load_state_dict(stored.state_dict())
    if args.no_write:
        final = evaluate(model, ev_ids, ev_asks, ev_target)
        print({"eval_bf16": final}, flush=True)
        sparse = load_model(directory, dense=False, dspark=dspark)
        sparse.load_state_dict(model.state_dict())
        n_ref = args.reference_seqs
        ref = evaluate_reference(sparse, ev_ids[:n_ref], ev_asks[:n_ref])
        print({"eval_sparse_reference": ref}, flush=True)
        return
    written = write_stage(stored, directory)
    print(written, flush=True)
    loaded = load_model(directory, dense=True, stage_from="checkpoint")
    for a, b in zip(loaded.dspark.parameters(), params):
        assert torch.equal(a, b)
    final = evaluate(loaded, ev_ids, ev_asks, ev_target)
    print({"eval_dense": final}, flush=True)
    sparse = load_model(directory, dense=False, stage_from="checkpoint")
    ref = evaluate_reference(sparse, ev_ids[: args.reference_seqs], ev_asks[: args.reference_seqs])
    print({"eval_sparse_reference": ref}, flush=True)
    command = "python -m tools.train_dspark " + " ".join(
        f"--{k.replace('_', '-')}"
        + ("" if v is True else f" {' '.join(map(str, v)) if isinstance(v, list) else v}")
        for k, v in vars(args).items()
        if v is not False
    )
    measured = measure(directory, args.measure, 192, 64) if args.measure else None
    if measured:
        print({"measured": measured}, flush=True)
    (directory / "dspark_training.json").write_text(
        json.dumps(
            {
                "command": command,
                "dspark": dspark,
                "init": args.init,
                "self_generated": gen_info or None,
                "self_generated_steps": gen_steps,
                "engine_measurement": measured,
                "steps": step,
                "fresh_target_batches": fresh,
                "train_seconds": train_s,
                "total_seconds": round(time.time() - t_start, 1),
                "stage_params": n_params,
                "stage_forward_vs_draft_block_max_abs": mirror_err,
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
            },
            indent=1,
        )
    )
    print("wrote", directory, flush=True)


if __name__ == "__main__":
    main()
