"""What each rank runs in tests/distributed (module level: spawned processes import it).

Every worker joins the group, builds the same whole v41-tiny model (fp32, seed 0) as its
unsplit twin, and its split model; both run in the same process on the same inputs, so the
TP=1 result each rank compares against is computed locally.
"""

from __future__ import annotations

import hashlib
import os
import time

import torch
from safetensors import safe_open

from atom.distributed import ParallelState, build_v41_tp
from atom.models.common.tensor_parallel import split_plan
from atom.models.deepseek_v41.config import LayerMode
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.presets import preset_config
from atom.models.deepseek_v41.reference import reference_forward
from atom.models.deepseek_v41.weights import deepseek_names
from tests.model.harness import Harness
from tests.model.ties import DecisionTrace

PRESET, SEED, BLOCK = "v41-tiny", 0, 16
TOL = 1e-4  # relative to the largest |logit|
TIE_TOL = 1e-4  # a choice whose margin is below this may flip between TP=1 and TP=2


class SeqTrace(DecisionTrace):
    """``DecisionTrace`` for batches of several sequences: choices keyed by (sequence,
    position) instead of position (``seq_of``: the sequence of each token of the next forward,
    set by the caller)."""

    STRIDE = 1 << 20

    def __init__(self, tol: float):
        super().__init__(tol)
        self.seq_of: list[int] = []

    def _paged_attention(self, orig, attn, u, angles, seqs, decode, *args):
        key = [s * self.STRIDE + p for s, p in zip(self.seq_of, angles.positions.tolist())]
        self._block, self._tokens = attn.layer, key
        if attn.mode in (LayerMode.FULL, LayerMode.REINDEX):
            self._queries = [[key[i] for i in b.tok.tolist()] for b in seqs]
            if decode is not None:
                self._queries.append([key[i] for i in decode.idx.tolist()])
        return orig(attn, u, angles, seqs, decode, *args)


def _join(rank: int, world: int, init_method: str, timeout_s: float = 30) -> ParallelState:
    return ParallelState.init(rank, world, init_method=init_method, timeout_s=timeout_s)


def _whole() -> DeepseekV41ForCausalLM:
    return DeepseekV41ForCausalLM(preset_config(PRESET)).init_weights(SEED).eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    vocab = preset_config(PRESET).vocab_size
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (23, 40, 9)]


def paged_equivalence(rank: int, world: int, init_method: str, decode_steps: int) -> dict:
    """Three sequences: one forward prefilling all three (sequence 1 its first 16 tokens), one
    mixing sequence 1's second chunk with the others' first decode, then batched decode steps
    (next token: TP=1's argmax, fed to both). Per forward: TP=2 logits against TP=1 (near-tie
    choices of TP=1 forced into TP=2 and reported), and a digest of this rank's pool, slot
    bytes and logits (the test compares the ranks'). Then the reference (dense) path."""
    state = _join(rank, world, init_method)
    whole = _whole()
    split = build_v41_tp(whole.config, state, seed=SEED)
    h1, h2 = Harness(whole, BLOCK, 16, 4), Harness(split, BLOCK, 16, 4)
    seqs = _prompts()
    tables = [h1.blocks(4) for _ in seqs]  # the same block ids in both pools
    done = [0] * len(seqs)
    trace = SeqTrace(TIE_TOL)
    chunks = [{0: 23, 1: 16, 2: 9}, {0: 24, 1: 40, 2: 10}]
    chunks += [{i: None for i in range(len(seqs))}] * decode_steps
    report: dict = {"rel": [], "digests": [], "forced": [], "decisions": 0}
    for ends in chunks:
        work, seq_of = [], []
        for i, end in ends.items():
            end = end or done[i] + 1
            work.append((seqs[i], done[i], end, i, tables[i]))
            seq_of += [i] * (end - done[i])
        trace.seq_of = seq_of
        with trace.recording():
            ref = h1.step(work)
        with trace.forcing():
            got = h2.step(work)
        report["rel"].append(_rel(got, ref))
        report["digests"].append(_digest(h2.pool, h2.slot_bytes, got))
        for k, (i, end) in enumerate(ends.items()):
            done[i] = end or done[i] + 1
            if len(seqs[i]) == done[i]:
                seqs[i].append(int(ref[k].argmax()))
    report["forced"] = [
        (f.kind, f.layer, divmod(f.position, SeqTrace.STRIDE), f.gap) for f in trace.forced
    ]
    report["decisions"] = trace.decisions
    ref_trace = DecisionTrace(TIE_TOL)
    with ref_trace.recording():
        ref = reference_forward(whole, seqs[1])
    with ref_trace.forcing():
        got = reference_forward(split, seqs[1])
    report["reference_rel"] = _rel(got, ref)
    report["reference_forced"] = [(f.kind, f.layer, f.position, f.gap) for f in ref_trace.forced]
    report["reference_digest"] = _digest(got)
    report["heads"] = [layer.self_attn.heads for layer in split.model.layers]
    return report


def load_split(rank: int, world: int, init_method: str, checkpoints: list[str]) -> dict:
    """Each checkpoint (the whole seed-0 model, HF or DeepSeek names) loaded split: per-rank
    shapes and values against the stored tensors, and a forward against the whole model."""
    state = _join(rank, world, init_method)
    whole = _whole()
    h1 = Harness(whole, BLOCK, 8, 2)
    ids = _prompts()[1]
    ref = h1.step([(ids, 0, len(ids), 0, h1.blocks(3))])
    report: dict = {"shapes": {}, "rel": [], "digests": []}
    for path in checkpoints:
        model = build_v41_tp(whole.config, state, checkpoint=path)
        params = dict(model.named_parameters())
        split = split_plan(model)
        stored = {}
        with safe_open(f"{path}/model.safetensors", framework="pt") as f:
            names = {k: k for k in f.keys()}
            for ours, theirs in deepseek_names(whole.state_dict()).items():
                if theirs in names:
                    names[ours] = theirs
            for name, want in whole.state_dict().items():
                stored[name] = f.get_tensor(names[name])
                assert torch.equal(stored[name], want), name
        for name, p in model.state_dict().items():
            t = stored[name]
            if name in split:
                d = split[name]
                n = t.shape[d] // world
                t = t.narrow(d, rank * n, n)
            assert p.shape == t.shape and torch.equal(p, t), (name, p.shape, t.shape)
        report["shapes"] = {n: list(params[n].shape) for n in split if ".layers.2." in n}
        h2 = Harness(model, BLOCK, 8, 2)
        got = h2.step([(ids, 0, len(ids), 0, h2.blocks(3))])
        report["rel"].append(_rel(got, ref))
        report["digests"].append(_digest(h2.pool, h2.slot_bytes, got))
    return report


def dies_mid_run(rank: int, world: int, init_method: str, timeout_s: float) -> dict:
    """One forward together, then the last rank exits (``os._exit``); the others' next
    forward must raise (within the group's timeout), not hang."""
    state = _join(rank, world, init_method, timeout_s)
    model = build_v41_tp(preset_config(PRESET), state, seed=SEED)
    h = Harness(model, BLOCK, 8, 2)
    ids = _prompts()[0]
    table = h.blocks(2)
    h.step([(ids, 0, 20, 0, table)])
    if rank == world - 1:
        os._exit(3)
    t0 = time.monotonic()
    try:
        for p in range(20, 23):
            h.step([(ids, p, p + 1, 0, table)])
    except Exception as e:  # the collective's failure
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


def hangs_mid_run(rank: int, world: int, init_method: str, timeout_s: float) -> dict:
    """One forward together, then the last rank stops taking part (it waits in a barrier of
    the control group, whose timeout is long): the others' next forward must raise once the
    forward group's ``timeout_s`` has passed; then they join the barrier, releasing it."""
    state = _join(rank, world, init_method, timeout_s)
    model = build_v41_tp(preset_config(PRESET), state, seed=SEED)
    h = Harness(model, BLOCK, 8, 2)
    ids = _prompts()[0]
    table = h.blocks(2)
    h.step([(ids, 0, 20, 0, table)])
    t0 = time.monotonic()
    if rank == world - 1:
        state.barrier()
        return {"error": None, "seconds": time.monotonic() - t0}
    try:
        h.step([(ids, 20, 21, 0, table)])
        error = None
    except Exception as e:  # the collective's timeout
        error = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - t0
    state.barrier()
    return {"error": error, "seconds": seconds}
