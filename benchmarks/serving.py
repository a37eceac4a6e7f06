"""The seed serving workload, three arms back to back: no prefix reuse, HBM prefix caching,
HBM + LMCache tier.

    python -m benchmarks.serving                       # CPU scale (v41-mini)
    python -m benchmarks.serving --preset gpu          # H200 scale (v41-bench, bf16)
    python -m benchmarks.serving --preset gpu --model v4-bench ...   # another model, same arms
    python -m benchmarks.serving --preset cpu --arms speculative     # the arms with drafts

Each prompt is one of ``--prefixes`` shared prefixes plus a unique tail; ``--output-len``
tokens each; ``--concurrency`` requests in flight; a PAGE pool too small to hold the tails.
Every arm runs the prompts twice on a fresh engine (and, for the tier arm, a fresh owned
LMCache server): pass 1 fills the caches, pass 2 is measured. In pass 2 the prefixes can come
from HBM, the tails only from the tier (the pool cannot keep them), so the ceiling of reused
prompt tokens is every stored image boundary: floor((len - 1) / block) * block per prompt.

Reported per arm: req/s, TTFT and ITL (p50, mean), prompt tokens by source, per-load latency
(p50/p99) and GB/s against a plain copy of the same bytes measured in the same run, step-thread
time spent in the tier connector per step, and a calibrated model: t(c) = a*c + b (engine time
per request against computed prompt tokens per request), fitted on the two arms that move no
bytes, predicting the tier arm's req/s.

``--arms speculative`` runs each of the three arms twice, without drafts (k = 0) and with
``--speculative-tokens`` k (default 1) drafts from the model's own drafter, on a model that has
one: models/v41-recall (trained target and DSpark stage, blocks of 3: k <= 3) on CPU,
v41-bench-draft (v41-bench plus one random draft layer: its acceptance is a random draft's) on
the GPU; sizes of its own
(``SPECULATIVE``), each overridable; ``--repeats`` rounds of the six arms (2 on CPU, 1 on the
GPU), k = 0 and k back to back, alternating which goes first. On the recall model the prompts
are recall-task text (``--workload recall``: filler prefixes, recall questions as tails), which
its drafter was trained on. Reported per arm: req/s, output tokens/s, ITL p50 (accepted
drafts arrive in the step that verified them: a gap of ~0), acceptance rate and mean tokens per
verify span of the measured pass, tier tokens, and whether both passes' outputs equal the
configuration's k = 0 outputs (greedy: in fp32 they must; the run exits 1 otherwise).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch

from atom import LLM, SamplingParams
from atom.thread_cpu import cpu_used, thread_cpu_seconds
from benchmarks.common import md_table, write_results
from benchmarks.gpu_pmon import PerProcessGpu
from benchmarks.pass_parts import gc_clock, paired_spread, pass_parts, rounded, spread_text
from benchmarks.recall_task import SPLIT_SEEDS, filler, split
from benchmarks.step_log import STEPS_HEADER, StepLog, steps_table
from benchmarks.tier_probe import tier_holds
from benchmarks.workload import pct, shared_prefix_prompts, summarize

PRESETS = {
    "cpu": dict(
        model="v41-mini",
        requests=16,
        prefixes=4,
        prefix_len=1024,
        tail_len=768,
        output_len=16,
        concurrency=8,
        max_batched_tokens=2048,
        pool_blocks=160,
        device="cpu",
        dtype="float32",
        l1_gb=1.0,
        name="serving_cpu",
    ),
    "gpu": dict(
        model="v41-bench",
        # 16 running requests need up to 16 x 28 blocks plus images in flight; 64 requests'
        # tails (64 x 12 blocks) must not fit. A run takes about 5 minutes on the H200.
        requests=64,
        prefixes=4,
        prefix_len=4096,
        tail_len=3000,
        output_len=64,
        concurrency=16,
        max_batched_tokens=8192,
        pool_blocks=700,
        device="cuda",
        dtype="bfloat16",
        l1_gb=16.0,
        name="serving_h200",
    ),
}

REPO = Path(__file__).resolve().parent.parent
RECALL = REPO / "models" / "v41-recall"

# --arms speculative: models with draft layers and sizes of their own (a flag still overrides)
SPECULATIVE = {
    "cpu": dict(
        # 16 requests' tail blocks (2 each: 32) do not fit beside 8 running requests (48) and
        # the prefixes (8); 64 output tokens: decoding, where drafts act, is a real share
        model=str(RECALL),
        prefix_len=512,
        tail_len=768,
        output_len=64,
        pool_blocks=64,
        repeats=2,
        name="serving_speculative_cpu",
    ),
    "gpu": dict(
        # half the requests of the three-arm run, one round: six arms in one step's time
        model="v41-bench-draft",
        requests=32,
        repeats=1,
        name="serving_speculative_h200",
    ),
}

PASS1_KEYS = (
    "wall_s",
    "hbm_hit_tokens",
    "tier_hit_tokens",
    "computed_prompt_tokens",
    "preemptions",
)

CONNECTOR_HOOKS = (
    "update",
    "lookup",
    "settle_lookup",
    "start_load",
    "before_forward",
    "after_step",
    "request_finished",
    "no_forward",  # a step that runs no forward sends what the hooks queued
    "while_forward",  # runs while the step's forward is queued on the device
)


def partings(reference, others: list[list[int]]) -> list[list]:
    """Where each of ``others`` first parts from its ``reference`` output (outputs made with
    top-2 logprobs): [output index, the reference's top-2 logprob gap there] per parted pair.
    A small gap is a near-tie that bf16 rounding of another batch shape may flip."""
    out = []
    for ref, other in zip(reference, others):
        j = next((j for j, (x, y) in enumerate(zip(ref.token_ids, other)) if x != y), None)
        if j is None:
            continue
        top = ref.logprobs[j].top if ref.logprobs else ()
        out.append([j, round(top[0][1] - top[1][1], 4) if len(top) >= 2 else None])
    return out


def parting_text(parts: list[list]) -> str:
    gaps = sorted(g for _, g in parts if g is not None)
    return (
        f"{len(parts)} parted; first parting output indices {sorted(j for j, _ in parts)}; "
        f"top-2 logprob gaps there, sorted: {gaps}"
    )


def exactness(arms: list[dict], kept: list[dict]) -> dict:
    """Every pass of every arm against the no-reuse arm's outputs (the recomputation), token for
    token: per pass, the requests whose tokens differ and the tokens that differ in all."""
    ref = kept[0]["pass2"]
    passes, differing = {}, 0
    for arm, keep in zip(arms, kept):
        for which in ("pass1", "pass2"):
            got = keep.get(which)
            if got is None or (keep is kept[0] and which == "pass2"):
                continue
            diff = [
                sum(a != b for a, b in zip(x, y)) + abs(len(x) - len(y)) for x, y in zip(got, ref)
            ]
            passes[f"{arm['arm']} {which}"] = {
                "requests_differing": sum(d > 0 for d in diff),
                "tokens_differing": sum(diff),
            }
            differing += sum(diff)
    against = f"{arms[0]['arm']} (pass 2)"
    return {"against": against, "passes": passes, "differing_tokens": differing}


def exactness_text(exact: dict, invariant: bool) -> str:
    mode = "batch-invariant mode" if invariant else "default arithmetic"
    rows = [
        [name, v["requests_differing"], v["tokens_differing"]]
        for name, v in exact["passes"].items()
    ]
    return (
        f"\nEvery pass against {exact['against']}, token for token ({mode}; "
        f"{exact['differing_tokens']} tokens differ in all):\n\n"
        + md_table(["pass", "requests differing", "tokens differing"], rows)
        + "\n"
    )


def save_stats(metrics, device: str) -> dict:
    """Saves over both passes against a plain copy of their mean size: latency (submission to
    the store's end: for an engine-driven save, its commit answered) and the source blocks'
    hold (submission to their release: the copy's completion for an engine-driven save)."""
    m = metrics._metrics
    lat = m["atom_tier_transfer_seconds"].samples(op="save")
    hold = m["atom_tier_save_hold_seconds"].samples()
    if not lat:
        return {}
    size = m["atom_tier_bytes_total"].get(direction="save") / len(lat)
    copy_s = plain_copy_seconds(int(size), device, to_host=True)
    out = {
        "saves": len(lat),
        "save_mean_mib": round(size / 2**20, 2),
        "save_p50_ms": round(1000 * pct(lat, 50), 2),
        "save_p99_ms": round(1000 * pct(lat, 99), 2),
        "save_copy_ms": round(1000 * copy_s, 3),
        "save_p50_over_copy": round(pct(lat, 50) / copy_s, 1),
    }
    if hold:
        out["save_hold_p50_ms"] = round(1000 * pct(hold, 50), 2)
        out["save_hold_p99_ms"] = round(1000 * pct(hold, 99), 2)
        out["save_hold_p50_over_copy"] = round(pct(hold, 50) / copy_s, 1)
    return out


def plain_copy_seconds(nbytes: int, device: str, repeats: int = 20, to_host=False) -> float:
    """Median time of a plain copy of ``nbytes`` into the pool's memory (host->device from
    pinned memory on GPU, memcpy on CPU), or out of it (``to_host``: device->pinned host)."""
    if device.startswith("cuda"):
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if to_host:
            src, dst = dst, src
        times = []
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1000)
        return statistics.median(times)
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def owned_server_process(engine) -> psutil.Process | None:
    """The LMCache server process the engine started (None for an external one)."""
    server = getattr(getattr(engine, "tier", None), "server", None)
    proc = getattr(server, "proc", None)
    return psutil.Process(proc.pid) if proc is not None else None


def cpu_seconds(proc: psutil.Process | None) -> float:
    if proc is None:
        return 0.0
    t = proc.cpu_times()
    return t.user + t.system


PHASE_ORDER = {
    p: i
    for i, p in enumerate(
        ("queued", "plan", "issue", "issue_cpu", "wait", "reserve", "copy", "to_commit", "commit")
    )
}


def phase_medians(metrics) -> dict:
    """p50 ms of every phase of the engine-driven loads and saves, over both passes
    (``atom_tier_load_phase_seconds``, ``atom_tier_save_phase_seconds``): where a load's or a
    save's latency goes."""
    out = {}
    for key, name in (("load", "load_phase"), ("save", "save_phase")):
        hist = metrics._metrics.get(f"atom_tier_{name}_seconds")
        if hist is None:
            continue
        meds = {}
        for labels in sorted(hist._series):
            got = hist.samples(**dict(labels))
            if got:
                meds[dict(labels)["phase"]] = round(1000 * pct(got, 50), 3)
        if meds:  # in the order the phases happen
            out[f"{key}_phase_p50_ms"] = dict(
                sorted(meds.items(), key=lambda kv: PHASE_ORDER[kv[0]])
            )
    return out


def phase_text(arms: list[dict]) -> str:
    """Each tier arm's loads and saves against a plain copy of their mean size, the
    connector's step-thread time, and the engine-driven transfers' phases."""
    lines = []
    for arm in arms:
        if arm.get("loads"):
            lines.append(
                f"{arm['arm']}: {arm['loads']} loads of {arm['load_mean_mib']} MiB on average, "
                f"p50 {arm['load_p50_ms']} ms, p99 {arm['load_p99_ms']} ms; "
                f"{arm['load_p50_over_copy']}x a plain copy of their bytes at p50 "
                f"({arm['plain_copy_ms']} ms, from pinned memory on a GPU).\n"
            )
        if arm.get("saves"):
            hold = ""
            if "save_hold_p50_ms" in arm:
                hold = (
                    f"; source blocks held p50 {arm['save_hold_p50_ms']} ms, "
                    f"p99 {arm['save_hold_p99_ms']} ms ({arm['save_hold_p50_over_copy']}x)"
                )
            lines.append(
                f"{arm['arm']}: {arm['saves']} saves (both passes) of {arm['save_mean_mib']} MiB "
                f"on average, p50 {arm['save_p50_ms']} ms, p99 {arm['save_p99_ms']} ms "
                f"({arm['save_p50_over_copy']}x a plain copy of their bytes, {arm['save_copy_ms']} "
                f"ms, to pinned memory on a GPU){hold}.\n"
            )
        if "connector_exposed_ms_per_step" in arm:
            lines.append(
                f"{arm['arm']}: the connector's step-thread time outside while_forward "
                f"{arm['connector_exposed_ms_per_step']} ms a step "
                f"({arm['connector_ms_per_step']} ms with it).\n"
            )
        for key in ("load", "save"):
            meds = arm.get(f"{key}_phase_p50_ms")
            if meds:
                parts = ", ".join(f"{p} {v:g}" for p, v in meds.items())
                lines.append(f"{arm['arm']}: engine-driven {key} phases, p50 ms: {parts}.\n")
    return "".join(lines)


def instrument(connector, profiler=None) -> dict:
    """Accumulate step-thread time spent inside the connector's hooks, wall and CPU (its
    thread's own; wall beyond it is waiting: for the interpreter lock, a lock, a call), and,
    given a ``cProfile.Profile``, profile them (what it adds is inside the times too)."""
    spent = {"s": 0.0, "cpu_s": 0.0, **{name: 0.0 for name in CONNECTOR_HOOKS}}
    spent |= {f"{name}_cpu": 0.0 for name in CONNECTOR_HOOKS}
    spent |= {f"{name}_calls": 0 for name in CONNECTOR_HOOKS}
    spent |= {"windows": 0, "windows_hidden": 0}
    stream = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stream = torch.cuda.current_stream()
    for name in CONNECTOR_HOOKS:
        inner = getattr(connector, name, None)
        if inner is None:  # a connector without this hook (an older one)
            continue

        def timed(*a, _inner=inner, _name=name, **k):
            c0, t0 = time.thread_time(), time.perf_counter()
            if profiler is not None:
                profiler.enable()
            try:
                return _inner(*a, **k)
            finally:
                if profiler is not None:
                    profiler.disable()
                dt, dc = time.perf_counter() - t0, time.thread_time() - c0
                spent["s"] += dt
                spent[_name] += dt
                spent["cpu_s"] += dc
                spent[f"{_name}_cpu"] += dc
                spent[f"{_name}_calls"] += 1
                if _name == "while_forward" and stream is not None:
                    # the forward still running when the hook returned: its time was hidden
                    spent["windows"] += 1
                    spent["windows_hidden"] += not stream.query()

        setattr(connector, name, timed)
    return spent


def record_lookups(connector) -> dict:
    """request id -> the tier's lookup answer in tokens (None: no answer), kept as each
    request finishes."""
    answers: dict = {}
    inner = connector.request_finished

    def finished(seq):
        st = connector.request_state(seq)
        answers[seq.request_id] = None if st is None else st.answer
        return inner(seq)

    connector.request_finished = finished
    return answers


def recall_prompts(
    num_requests: int, num_prefixes: int, prefix_len: int, tail_len: int
) -> list[list[int]]:
    """The shared-prefix workload in recall-task text: prefix i is seeded filler, each tail a
    recall question (the held-out "eval" split) of ``tail_len`` tokens."""
    base = SPLIT_SEEDS["preamble"]
    prefixes = [filler(random.Random(base + i), prefix_len) for i in range(num_prefixes)]
    tails = split("eval", num_requests, tail_len)
    return [prefixes[i % num_prefixes] + t.prompt for i, t in enumerate(tails)]


def shown_model(model: str) -> str:
    """A preset's name, or a model directory relative to the repository when inside it."""
    path = Path(model).resolve()
    return str(path.relative_to(REPO)) if path.is_dir() and path.is_relative_to(REPO) else model


def spec_counts(eng) -> tuple[int, int, int] | None:
    spec = eng.spec_stats
    return None if spec is None else (spec.proposed, spec.accepted, spec.verifies)


def run_arm(
    name: str,
    prompts: list[list[int]],
    args,
    fill: bool = True,
    keep: dict | None = None,
    passes: int = 1,
    **engine,
) -> dict:
    """Pass 1 (unless ``fill`` is False: nothing to fill) then the measured pass 2 (``passes``
    times over, back to back in the same engine: the wall is their sum, each in
    ``pass_walls_s``); ``keep`` receives both passes' output tokens ("pass1", "pass2": the last
    measured pass) and the blocks an image takes."""
    arm = Arm(name, prompts, args, fill=fill, keep=keep, **engine)
    with PerProcessGpu() as gpu:  # which processes used the GPU during the pass (CUDA hosts)
        for _ in range(passes):
            arm.measure()
    return arm.finish(gpu)


class Arm:
    """One arm's engine, from its build to its summary: built, warmed and filled (pass 1) by
    the constructor, then ``measure`` runs measured passes (as many as the caller wants, and
    interleaved with another arm's if it wants), ``finish`` summarizes and shuts it down.

    Per-engine counters (steps, hooks, lookups, server CPU) count only this engine's work.
    The CPU of the process's other threads is read around each measured pass, so an arm whose
    passes alternate with another engine's is not charged for that engine's threads' work in
    between (both engines' threads run in this one process)."""

    def __init__(
        self,
        name: str,
        prompts: list[list[int]],
        args,
        fill: bool = True,
        keep: dict | None = None,
        weights_from: LLM | None = None,
        **engine,
    ):
        self.name, self.prompts, self.args, self.keep = name, prompts, args, keep
        self.engine_kw = engine
        self.llm = llm = LLM(
            args.model,
            device=args.device,
            dtype=args.dtype,
            max_num_seqs=args.concurrency,
            max_num_batched_tokens=args.max_batched_tokens,
            num_blocks=args.pool_blocks,
            tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
            batch_invariant=getattr(args, "batch_invariant", False),
            **engine,
        )
        if weights_from is not None:  # one copy of the weights for both arms' engines
            from benchmarks.shared_weights import share

            share(weights_from.engine.runtime.model, llm.engine.runtime.model)
        self.eng = eng = llm.engine
        self.params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
        # pass 1 (not the measured pass) also returns top-2 logprobs: where a later output
        # parts from it, the gap says whether that was a near-tie
        params1 = SamplingParams(max_tokens=args.output_len, ignore_eos=True, logprobs=2)
        llm.generate([[7] * 8], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        eng.reset_prefix_cache()
        t0 = time.perf_counter()
        log1 = StepLog(eng)
        self.first = first = llm.generate(prompts, params1) if fill else None
        self.pass1 = pass1 = time.perf_counter() - t0
        self.pass1_summary = None
        if first is not None:  # the cold pass: what filling the caches cost
            self.pass1_summary = {
                k: v for k, v in summarize(first, pass1).items() if k in PASS1_KEYS
            } | {"step_kinds": log1.summary(pass1)}
        log1.detach()
        self.conn = conn = eng.scheduler.connector
        while conn is not None and conn.busy():  # pass 1's stores drain before pass 2
            eng.wait_for_progress(0.05)
            conn.update()
        if getattr(args, "cold_hbm", False):
            eng.reset_prefix_cache()
        self.held = tier_holds(eng, prompts) if conn is not None and fill else None
        self.profiler = cProfile.Profile() if getattr(args, "profile_hooks", False) else None
        self.spent = instrument(conn, self.profiler) if conn is not None else {"s": 0.0}
        self.answers = record_lookups(conn) if conn is not None else {}
        self.server = owned_server_process(eng)
        self.server_cpu0 = cpu_seconds(self.server)
        self.steps0 = eng.steps
        self.log = StepLog(eng, busy=conn.busy if conn is not None else None)
        self.spec0 = spec_counts(eng)
        self.rounds0 = transfer_rounds(eng)
        self.calls0 = lookup_path_calls(conn)
        self.walls: list[float] = []
        self.parts: list[dict] = []  # per measured pass: where its wall went (pass_parts.py)
        self.every: list = []
        self.outs: list = []
        self.threads: dict[str, float] = {}

    def measure(self) -> float:
        """One measured pass; returns its wall seconds (its parts: ``self.parts``)."""
        threads0 = thread_cpu_seconds()
        clock, n0 = gc_clock(), len(self.log.rows)
        gc0, counts0 = clock.read()
        t0 = time.perf_counter()
        self.outs = self.llm.generate(self.prompts, self.params)
        wall = time.perf_counter() - t0
        gc1, counts1 = clock.read()
        counts = tuple(b - a for a, b in zip(counts0, counts1))
        self.parts.append(pass_parts(self.log.rows[n0:], wall, gc1 - gc0, counts))
        for k, v in cpu_used(threads0, thread_cpu_seconds()).items():
            self.threads[k] = self.threads.get(k, 0.0) + v
        self.walls.append(wall)
        self.every += self.outs
        return wall

    def finish(self, gpu: PerProcessGpu | None = None) -> dict:
        """The arm's summary (printed too); shuts its engine down."""
        # the summary's inputs, under the names it reads them by
        args, eng, conn, prompts, keep = self.args, self.eng, self.conn, self.prompts, self.keep
        first, outs, every, walls = self.first, self.outs, self.every, self.walls
        spent, profiler, answers, held = self.spent, self.profiler, self.answers, self.held
        server, spec0, rounds0, calls0 = self.server, self.spec0, self.rounds0, self.calls0
        name, engine, pass1, llm, threads = (
            self.name,
            self.engine_kw,
            self.pass1,
            self.llm,
            self.threads,
        )
        wall = sum(walls)
        if keep is not None:
            keep["pass1"] = [o.token_ids for o in first] if first is not None else None
            keep["pass1_outputs"] = first
            keep["pass2"] = [o.token_ids for o in outs]
            keep["units_per_image"] = eng.spec.units_per_image
        server_cpu = cpu_seconds(server) - self.server_cpu0 if server is not None else None
        steps = eng.steps - self.steps0
        itls = [x for o in every for x in o.itl_s]
        res = {
            "arm": name,
            **summarize(every, wall, itls),
            "pass_walls_s": [round(w, 4) for w in walls],
            "pass1_wall_s": round(pass1, 3),
            "pass1": self.pass1_summary,
            "steps": steps,
            "step_kinds": self.log.summary(wall),
            "engine": {k: str(v) for k, v in engine.items()},
            # CPU ms per step of the threads beside the step thread (tier, client library, torch)
            "thread_cpu_ms_per_step": per_thread_ms(threads, steps),
        }
        if (
            gpu is not None and gpu.lines
        ):  # the engine's and the owned server's SM % (nvidia-smi pmon, 1 s samples)
            pids = {"engine": os.getpid()} | ({"server": server.pid} if server is not None else {})
            res["gpu_sm_pct"] = gpu.summary(pids)
        if rounds0 is not None:
            res["transfer_rounds_per_step"] = round(
                (transfer_rounds(eng) - rounds0) / max(steps, 1), 2
            )
        if calls0 is not None:  # the lookup thread's server calls in the measured passes
            res["lookup_thread_calls"] = {
                k: v - calls0[k] for k, v in lookup_path_calls(conn).items()
            }
        if held is not None:
            block = eng.scheduler.block_size
            res["tier_held_after_pass1"] = sum(held)
            res["tier_held_by_request"] = held
            res["tier_held_ceiling"] = sum((len(p) - 1) // block * block for p in prompts)
            res["lookup_answers_by_request"] = [answers.get(o.request_id) for o in outs]
        if first is not None:
            res["same_tokens_as_pass1"] = all(
                a.token_ids == b.token_ids for a, b in zip(first, outs)
            )
            res["parting_from_pass1"] = partings(first, [o.token_ids for o in outs])
        if spec0 is not None:  # drafts verified in the measured pass
            proposed, accepted, verifies = (b - a for a, b in zip(spec0, spec_counts(eng)))
            res["speculative"] = {
                "draft_tokens": proposed,
                "accepted_tokens": accepted,
                "verify_spans": verifies,
                "acceptance_rate": round(accepted / max(1, proposed), 4),
                "tokens_per_verify": round((accepted + verifies) / max(1, verifies), 4),
            }
        tp = eng.tier_health().get("tensor_parallel") if conn is not None else None
        if tp:  # every rank's parts, bytes and latencies, over both passes
            res["tensor_parallel"] = tp
        if conn is not None:
            lat = eng.metrics._metrics["atom_tier_transfer_seconds"].samples(op="load")
            nbytes = eng.metrics._metrics["atom_tier_bytes_total"].get(direction="load")
            n_loads = len(lat)
            res["loads"] = n_loads
            res["connector_ms_per_step"] = round(1000 * spent["s"] / max(steps, 1), 4)
            if server_cpu is not None:  # an owned server shares this machine's cores
                res["server_cpu_s"] = round(server_cpu, 3)
            res["connector_ms_per_step_by_hook"] = {
                name: round(1000 * spent[name] / max(steps, 1), 4) for name in CONNECTOR_HOOKS
            }
            # the hooks' time outside while_forward: what a step waits for on a GPU, where
            # while_forward overlaps the forward queued on the device (on a CPU it does not)
            res["connector_exposed_ms_per_step"] = round(
                1000 * (spent["s"] - spent["while_forward"]) / max(steps, 1), 4
            )
            if spent["windows"]:  # the share of while_forward calls the forward outlasted
                res["while_forward_hidden"] = round(spent["windows_hidden"] / spent["windows"], 4)
            # the step thread's CPU time inside the hooks (wall less this: waiting)
            res["connector_cpu_ms_per_step"] = round(1000 * spent["cpu_s"] / max(steps, 1), 4)
            res["connector_cpu_ms_per_step_by_hook"] = {
                name: round(1000 * spent[f"{name}_cpu"] / max(steps, 1), 4)
                for name in CONNECTOR_HOOKS
            }
            # calls per hook (a hook's time per step is its calls times their cost: the
            # scheduler asks a waiting request's lookup again each step it stays waiting)
            res["connector_calls_by_hook"] = {
                name: spent[f"{name}_calls"] for name in CONNECTOR_HOOKS
            }
            if n_loads:
                size = nbytes / n_loads
                copy_s = plain_copy_seconds(int(size), args.device)
                res.update(
                    {
                        "load_mean_mib": round(size / 2**20, 2),
                        "load_p50_ms": round(1000 * pct(lat, 50), 2),
                        "load_p99_ms": round(1000 * pct(lat, 99), 2),
                        "load_gbps_p50": round(size / pct(lat, 50) / 1e9, 3),
                        "plain_copy_ms": round(1000 * copy_s, 3),
                        "plain_copy_gbps": round(size / copy_s / 1e9, 2),
                        "load_p50_over_copy": round(pct(lat, 50) / copy_s, 1),
                    }
                )
            res.update(save_stats(eng.metrics, args.device))
            res.update(phase_medians(eng.metrics))
            if profiler is not None:  # where the hooks' step-thread time goes, by function
                out = io.StringIO()
                pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(30)
                res["hook_profile"] = out.getvalue()
            res["tier_metrics"] = {
                line.split(" ")[0]: float(line.split(" ")[1])
                for line in eng.metrics.render().splitlines()
                if line.startswith(
                    (
                        "atom_tier_loads_total",
                        "atom_tier_local_loads_total",
                        "atom_tier_saves_total",
                        "atom_tier_lookups_total",
                        "atom_tier_local_saves_total",
                        "atom_tier_save_reserves_ahead_total",
                        "atom_tier_transfer_rounds_total",
                    )
                )
            }
        llm.shutdown()
        print({k: v for k, v in res.items() if k != "tier_metrics"}, flush=True)
        return res


def calls_cell(calls: dict | None) -> str:
    return "" if not calls else f"{calls['lookups']} / {calls['frees']} / {calls['session_ends']}"


def lookup_path_calls(conn) -> dict | None:
    """The server calls the tier's lookup thread made so far: lookups (each round-trip of the
    lookup path), frees of read locks, session ends (None without a lookup thread)."""
    lookups = getattr(conn, "lookups", None) if conn is not None else None
    if lookups is None or not hasattr(lookups, "server_calls"):
        return None
    return {
        "lookups": lookups.server_calls,
        "frees": lookups.locks_freed,
        "session_ends": lookups.sessions_ended,
    }


def transfer_rounds(eng) -> int | None:
    """The tier's transfer-thread polling rounds so far (None without a tier)."""
    metric = eng.metrics._metrics.get("atom_tier_transfer_rounds_total")
    return int(metric.read()) if metric is not None else None


def per_thread_ms(used: dict[str, float], steps: int, floor_ms: float = 0.005) -> dict:
    """CPU ms per step by thread name (names over ``floor_ms``), the busiest first; numbered
    pool threads (``ThreadPoolExecutor-0_3``) are summed under their pool's name."""
    merged: dict[str, float] = {}
    for name, seconds in used.items():
        key = name.rsplit("_", 1)[0] if name.startswith("ThreadPoolExecutor") else name
        merged[key] = merged.get(key, 0.0) + seconds
    per = {k: 1000 * v / max(steps, 1) for k, v in merged.items()}
    return {k: round(v, 3) for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v > floor_ms}


def sm_pct(arm: dict) -> str:
    """The engine's and the owned server's mean SM % over the pass ("" on CPU)."""
    got = arm.get("gpu_sm_pct") or {}
    return " / ".join(str(got[k]["sm_pct_mean"]) for k in ("engine", "server") if k in got)


def busiest_helpers(per_thread: dict, n: int = 3) -> str:
    """The ``n`` busiest threads but the step thread, as "name ms; ..."."""
    rest = [(k, v) for k, v in per_thread.items() if k != "MainThread"][:n]
    return "; ".join(f"{k} {v:g}" for k, v in rest)


def idle_table(arms: list[dict]) -> str:
    """The idle comparison's table: one row per arm."""
    rows = [
        [a["arm"], a["req_per_s"], a["wall_s"], a["ttft_p50_ms"], a.get("itl_p50_ms", "")]
        + [a["tier_hit_tokens"], a.get("loads", ""), a.get("connector_ms_per_step", "")]
        + [a.get("server_cpu_s", ""), a.get("transfer_rounds_per_step", "")]
        + [calls_cell(a.get("lookup_thread_calls"))]
        + [sm_pct(a)]
        + [busiest_helpers(a.get("thread_cpu_ms_per_step", {}))]
        for a in arms
    ]
    return md_table(
        [
            "arm",
            "req/s",
            "wall s",
            "TTFT p50 ms",
            "ITL p50 ms",
            "tier tokens",
            "loads",
            "connector ms/step",
            "server CPU s",
            "transfer rounds/step",
            "lookups / frees / session ends",
            "GPU SM % engine / server",
            "other threads, CPU ms/step",
        ],
        rows,
    )


def idle(args) -> None:
    """The tier attached but never needed: one wave of requests in a pool twice the preset's,
    HBM-only against HBM + tier, interleaved ``--repeats`` times (A B A B) to expose drift;
    each arm's measured pass runs ``--passes`` times in its engine (a longer arm without
    another engine start). The overhead of each A B pair is reported, and their spread."""
    prompts = shared_prefix_prompts(args.concurrency, args.prefixes, args.prefix_len, args.tail_len)
    args.pool_blocks *= 2
    tier = tier_engine(args)
    arms = []
    passes = args.passes
    for rep in range(args.repeats):
        arms.append(run_arm(f"HBM only #{rep + 1}", prompts, args, passes=passes))
        arms.append(run_arm(f"HBM + idle tier #{rep + 1}", prompts, args, passes=passes, **tier))
    hbm = statistics.mean(a["wall_s"] for a in arms[0::2])
    tiered = statistics.mean(a["wall_s"] for a in arms[1::2])
    pairs = [b["wall_s"] / a["wall_s"] - 1 for a, b in zip(arms[0::2], arms[1::2])]
    summary = {
        "hbm_only_wall_s": hbm,
        "idle_tier_wall_s": tiered,
        "idle_tier_overhead": tiered / hbm - 1,
        "pair_overheads": [round(x, 5) for x in pairs],
        "pair_spread": max(pairs) - min(pairs),
        "tier_loads": sum(a.get("loads", 0) for a in arms[1::2]),
    }
    table = idle_table(arms)
    table += (
        "\n\nserver CPU s: CPU time the owned LMCache server used during the measured pass (it "
        "shares the engine's cores). Lookups / frees / session ends: the server calls the tier's "
        "lookup thread made in the measured passes. Other threads: this process's threads but "
        "the step thread (MainThread), the three busiest, CPU ms per step (each holds the "
        "interpreter lock while it runs Python). GPU SM %: nvidia-smi pmon's 1 s samples of "
        "each process, mean over the pass (the server's share is what its CUDA context took)."
        f"\n\nIdle-tier overhead (mean wall of the tier arms over the HBM-only arms - 1): "
        f"{100 * summary['idle_tier_overhead']:+.2f}%; by A B pair: "
        + ", ".join(f"{100 * x:+.2f}%" for x in pairs)
        + f" (spread {100 * summary['pair_spread']:.2f} points); loads in the tier arms: "
        f"{summary['tier_loads']}. Each arm: {passes} measured pass(es) of "
        f"{len(prompts)} requests in one engine.\n"
        "\nWhere the time goes, by step kind (step thread off CPU: its wall time less its CPU "
        "time, i.e. blocked, as on the interpreter lock another thread holds; other threads: "
        "their CPU time during the step):\n\n" + md_table(STEPS_HEADER, steps_table(arms)) + "\n"
    )
    print(table)
    cmd = (
        f"python -m benchmarks.serving --preset {args.preset} --arms idle --repeats {args.repeats}"
        + (f" --passes {passes}" if passes > 1 else "")
    )
    print(
        write_results(
            f"{args.name}_idle", {"args": vars(args), "arms": arms, "summary": summary}, table, cmd
        )
    )


def tier_engine(args) -> dict:
    """A tier arm's engine settings (the idle comparison's B, the speculative arms' tier)."""
    return dict(
        offload="lmcache_mp",
        lmcache={
            "l1_size_gb": args.l1_gb,
            "load_mode": args.load_mode,
            "save_mode": getattr(args, "save_mode", "lmcache_driven"),
            "load_copy": getattr(args, "load_copy", "copy_engine"),
            "load_streams": getattr(args, "load_streams", 1),
            "tp_rank_collapse": getattr(args, "rank_collapse", "auto"),
        },
    )


def idle_interleaved(args) -> None:
    """The idle comparison with both engines alive (the tier arm's shares the HBM-only arm's
    weights) and their measured passes alternating, ``--interleave`` rounds of one pass each
    (A B, then B A, ...: neither arm always runs first). Each round's overhead (B's wall over
    A's - 1) compares passes seconds apart, so drift between engine starts (which moved the
    HBM-only arm alone by 7% on an H100) does not enter it; the report gives their mean with
    a 95% confidence interval (1.96 standard errors), the median and the range."""
    prompts = shared_prefix_prompts(args.concurrency, args.prefixes, args.prefix_len, args.tail_len)
    args.pool_blocks *= 2
    hbm = Arm("HBM only", prompts, args)
    tiered = Arm("HBM + idle tier", prompts, args, weights_from=hbm.llm, **tier_engine(args))
    rounds = []
    for r in range(args.interleave):
        first, second = (hbm, tiered) if r % 2 == 0 else (tiered, hbm)
        walls = {first.name: first.measure(), second.name: second.measure()}
        rounds.append(walls[tiered.name] / walls[hbm.name] - 1)
    arms = [hbm.finish(), tiered.finish()]
    # which part of the passes carries the rounds' spread (pass_parts.py); its whole-pass
    # entry is the rounds' overhead, with its 95% confidence half-width
    spread = paired_spread(hbm.parts, tiered.parts)
    mean, half = spread["wall"]["mean"], spread["wall"]["ci95_half_width"]
    summary = {
        "rounds": len(rounds),
        "round_overheads": [round(x, 5) for x in rounds],
        "idle_tier_overhead": mean,
        "ci95_half_width": half,
        "median": statistics.median(rounds),
        "min": min(rounds),
        "max": max(rounds),
        "hbm_only_wall_s": arms[0]["wall_s"],
        "idle_tier_wall_s": arms[1]["wall_s"],
        "tier_loads": arms[1].get("loads", 0),
        "spread": spread,
        # each round's parts (seconds), so that a single round can be traced to its cause
        "passes": {
            arm.name: [{k: rounded(v) for k, v in p.items()} for p in arm.parts]
            for arm in (hbm, tiered)
        },
    }
    table = idle_table(arms)
    table += (
        f"\n\nIdle-tier overhead over {len(rounds)} interleaved rounds (one measured pass of "
        f"{len(prompts)} requests per arm each, the order alternating): mean "
        f"{100 * mean:+.2f}% (95% confidence interval {100 * (mean - half):+.2f}% to "
        f"{100 * (mean + half):+.2f}%), median {100 * summary['median']:+.2f}%, range "
        f"{100 * summary['min']:+.2f}% to {100 * summary['max']:+.2f}%; loads in the tier "
        f"arm: {summary['tier_loads']}. Both engines in one process (the tier arm shares the "
        "HBM-only arm's weights); other threads' CPU is counted during each arm's own passes."
        "\n\n" + spread_text(summary["spread"], hbm.name, tiered.name) + "\n\n"
        "Where the time goes, by step kind:\n\n" + md_table(STEPS_HEADER, steps_table(arms)) + "\n"
    )
    print(table)
    cmd = (
        f"python -m benchmarks.serving --preset {args.preset} --arms idle "
        f"--interleave {args.interleave}"
    )
    print(
        write_results(
            f"{args.name}_idle_interleaved",
            {"args": vars(args), "arms": arms, "summary": summary},
            table,
            cmd,
        )
    )


def speculative(args, prompts: list[list[int]]) -> int:
    """The three arms without and with drafts, ``--repeats`` rounds (k = 0 and k back to back
    per configuration, in A B, B A, ... order); 1 if, in fp32, any output differs from the
    configuration's first k = 0 run."""
    k = args.speculative_tokens
    tier = tier_engine(args)
    configs = [
        ("no prefix reuse", dict(fill=False, enable_prefix_caching=False)),
        ("HBM prefix caching", {}),
        ("HBM + tier", tier),
    ]
    runs, kept = [], {}
    for rep in range(args.repeats):
        for config, engine in configs:
            for kk in (0, k) if rep % 2 == 0 else (k, 0):
                name = f"{config}, k={kk}"
                keep: dict = {}
                run = run_arm(
                    f"{name} #{rep + 1}", prompts, args, keep=keep, speculative_tokens=kk, **engine
                )
                run.update(config=config, k=kk, repeat=rep + 1)
                run["blocks_per_image"] = keep["units_per_image"]
                run["output_tokens_per_s"] = round(run["output_tokens"] / run["wall_s"], 2)
                kept.setdefault(name, []).append(keep)
                runs.append(run)
    n = len(prompts)
    failures = []
    for run in runs:  # every run's outputs against its configuration's first k=0 run
        base = kept[f"{run['config']}, k=0"][0]
        mine = kept[f"{run['config']}, k={run['k']}"][run["repeat"] - 1]
        equal = {
            p: sum(a == b for a, b in zip(mine[p], base[p]))
            for p in ("pass1", "pass2")
            if mine[p] is not None
        }
        run["outputs_equal_to_k0"] = equal  # of n prompts
        if base["pass1_outputs"] is not None and run["k"] != 0:
            run["parting_from_k0_pass1"] = partings(base["pass1_outputs"], mine["pass1"])
        if any(m != n for m in equal.values()):
            failures.append(f"{run['arm']}: outputs equal to k=0's, of {n}: {equal}")
    reference = kept[f"{configs[0][0]}, k=0"][0]["pass2"]
    arms = []  # per (configuration, k): the mean over the repeats
    for config, _ in configs:
        for kk in (0, k):
            mine = [r for r in runs if r["config"] == config and r["k"] == kk]
            last = mine[-1]
            equal_ref = min(
                sum(a == b for a, b in zip(keep["pass2"], reference))
                for keep in kept[f"{config}, k={kk}"]
            )
            arms.append(
                {
                    "arm": f"{config}, k={kk}",
                    "config": config,
                    "k": kk,
                    "req_per_s": round(statistics.fmean(r["req_per_s"] for r in mine), 4),
                    "req_per_s_by_repeat": [r["req_per_s"] for r in mine],
                    "output_tokens_per_s": round(
                        statistics.fmean(r["output_tokens_per_s"] for r in mine), 2
                    ),
                    "ttft_p50_ms": round(statistics.fmean(r["ttft_p50_ms"] for r in mine), 1),
                    "itl_p50_ms": round(statistics.fmean(r["itl_p50_ms"] for r in mine), 2),
                    "itl_mean_ms": round(statistics.fmean(r["itl_mean_ms"] for r in mine), 2),
                    "steps": last["steps"],
                    "speculative": last.get("speculative"),
                    "same_speculative_counts_every_repeat": all(
                        r.get("speculative") == last.get("speculative") for r in mine
                    ),
                    **{
                        key: last[key]
                        for key in (
                            "output_tokens",
                            "hbm_hit_tokens",
                            "tier_hit_tokens",
                            "computed_prompt_tokens",
                            "preemptions",
                            "blocks_per_image",
                        )
                    },
                    "preemptions_max": max(r["preemptions"] for r in mine),
                    "outputs_equal_to_k0": {
                        p: f"{min(r['outputs_equal_to_k0'][p] for r in mine)}/{n}"
                        for p in mine[0]["outputs_equal_to_k0"]
                    },
                    "pass2_equal_to_no_reuse_k0": f"{equal_ref}/{n}",
                }
            )
    summary = {}
    for config, _ in configs:
        pairs = [
            [r for r in runs if r["config"] == config and r["repeat"] == rep + 1]
            for rep in range(args.repeats)
        ]
        ratio = [
            next(r for r in pair if r["k"])["req_per_s"]
            / next(r for r in pair if not r["k"])["req_per_s"]
            for pair in pairs
        ]
        summary[config] = {
            "req_per_s_ratio_by_repeat": [round(x, 4) for x in ratio],
            "req_per_s_ratio_mean": round(statistics.fmean(ratio), 4),
        }
    rows = []
    for a in arms:
        spec = a["speculative"] or {}
        eq = a["outputs_equal_to_k0"]
        rows.append(
            [a["arm"], a["req_per_s"], a["output_tokens_per_s"], a["ttft_p50_ms"]]
            + [a["itl_p50_ms"], a["itl_mean_ms"]]
            + [f"{spec['acceptance_rate']:.3f}" if spec else ""]
            + [f"{spec['tokens_per_verify']:.2f}" if spec else ""]
            + [spec.get("draft_tokens", ""), a["steps"]]
            + [a["hbm_hit_tokens"], a["tier_hit_tokens"], a["computed_prompt_tokens"]]
            + [a["preemptions_max"], a["blocks_per_image"]]
            + [" / ".join(eq.get(p, "-") for p in ("pass1", "pass2"))]
            + [a["pass2_equal_to_no_reuse_k0"]]
        )
    table = md_table(
        [
            "arm",
            "req/s",
            "output tok/s",
            "TTFT p50 ms",
            "ITL p50 ms",
            "ITL mean ms",
            "acceptance",
            "tokens / verify",
            "drafts verified",
            "steps",
            "HBM tokens",
            "tier tokens",
            "computed tokens",
            "preemptions",
            "blocks / image",
            "outputs = k=0 (pass 1 / pass 2)",
            "pass 2 = no reuse k=0",
        ],
        rows,
    )
    table += "\n\nWith drafts over without, req/s (same configuration, same round):\n\n" + md_table(
        ["configuration", "mean", "by round"],
        [
            [
                c,
                f"{v['req_per_s_ratio_mean']:.2f}x",
                ", ".join(f"{x:.2f}x" for x in v["req_per_s_ratio_by_repeat"]),
            ]
            for c, v in summary.items()
        ],
    )
    table += (
        f"\n\nModel {shown_model(args.model)}, {args.workload} prompts: {args.requests} requests, "
        f"{args.prefixes} prefixes of {args.prefix_len} tokens + tails of {args.tail_len}, "
        f"{args.output_len} greedy output tokens each, {args.concurrency} in flight, a pool of "
        f"{args.pool_blocks} blocks; k={k}; {args.repeats} rounds, each arm on a fresh engine "
        "(and a fresh owned LMCache server), k=0 and k back to back, their order alternating. "
        "Rates and latencies: means over the rounds of each arm's measured pass (pass 2); "
        "acceptance, tokens / verify, drafts verified, steps and tokens by source: the last "
        "round's (the same in every round: "
        + ("yes" if all(a["same_speculative_counts_every_repeat"] for a in arms) else "NO")
        + "); preemptions: the most in any round; outputs: the fewest equal in any round, "
        "against the configuration's first k=0 run. ITL: accepted drafts arrive with the token "
        "that verified them (a gap of ~0), so the p50 moves between the step time and 0 with "
        "acceptance; output tok/s is the rate. Blocks / image: PAGE blocks one state image "
        "takes (more with drafts when the draft layers' rings and the k extra rows per ring "
        "cross a block: fewer images and prefixes then fit in the same pool). "
        + ("Outputs all equal to k=0: yes.\n" if not failures else "OUTPUTS DIFFER.\n")
    )
    for run in runs:  # pass 1 with drafts against pass 1 without (which has top-2 logprobs)
        if run.get("parting_from_k0_pass1"):
            table += (
                f"\n{run['arm']}, pass 1 against k=0's: "
                + parting_text(run["parting_from_k0_pass1"])
                + "\n"
            )
    table += (
        "\nSteps of the measured pass by kind, first round (decode: every span one token or a "
        "verify span):\n\n"
        + md_table(STEPS_HEADER, steps_table([r for r in runs if r["repeat"] == 1]))
        + "\n"
    )
    cmd = f"python -m benchmarks.serving {shlex.join(sys.argv[1:])}"
    print(table)
    data = {
        "args": vars(args),
        "arms": arms,
        "summary": summary,
        "failures": failures,
        "runs": runs,
    }
    print(write_results(args.name, data, table, cmd))
    strict = args.dtype == "float32"  # greedy drafts are exact in fp32; bf16 near-ties may flip
    for f in failures:
        print(("FAIL: " if strict else "note: ") + f, file=sys.stderr)
    return 1 if failures and strict else 0


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument(
        "--arms",
        choices=("main", "idle", "tier", "speculative"),
        default="main",
        help="main: the three arms on a pool too small for the tails; idle: HBM-only against "
        "HBM + an attached tier on a workload that fits the pool (the idle-tier overhead); "
        "tier: the HBM + tier arm of main alone (diagnosis: its steps and sources); "
        "speculative: the three arms without and with drafts, on a model with draft layers",
    )
    ap.add_argument(
        "--speculative-tokens",
        type=int,
        default=1,
        help="speculative: drafts per decode step in the arms with drafts (1-5)",
    )
    ap.add_argument(
        "--workload",
        choices=("auto", "random", "recall"),
        default="auto",
        help="prompts of main, tier and speculative: random tokens, or recall-task text "
        "(filler prefixes, recall questions as tails); auto: recall for a recall model",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="idle: A/B pairs to interleave (default 2); speculative: rounds of the six arms "
        "(default: 2 on cpu, 1 on gpu)",
    )
    ap.add_argument(
        "--passes",
        type=int,
        default=1,
        help="idle: measured passes per arm, back to back in its engine (a longer arm)",
    )
    ap.add_argument(
        "--interleave",
        type=int,
        default=0,
        help="idle: both arms' engines alive at once (one copy of the weights), this many rounds "
        "of one measured pass each, alternating which arm goes first (A B, B A, ...): the "
        "overhead per round and its 95%% confidence interval, drift cancelled pass by pass",
    )
    ap.add_argument(
        "--cold-hbm",
        action="store_true",
        help="drop the HBM prefix cache before each arm's measured pass: reused prefixes then "
        "come from the tier alone (the HBM arms reuse nothing), whatever pass 1 left in HBM",
    )
    ap.add_argument(
        "--load-mode",
        choices=("auto", "engine_driven", "lmcache_driven"),
        default="auto",
        help="who copies tier loads: the engine, from the server's shared-memory L1, or the "
        "server (lmcache.load_mode; auto: the engine on one rank and across ranks with rank "
        "collapse, the server across ranks without it)",
    )
    ap.add_argument(
        "--save-mode",
        choices=("auto", "engine_driven", "lmcache_driven"),
        default="lmcache_driven",
        help="who copies tier saves: the engine, into space the server reserved in its "
        "shared-memory L1, or the server (lmcache.save_mode; default lmcache_driven)",
    )
    ap.add_argument(
        "--load-copy",
        choices=("copy_engine", "kernel"),
        default="copy_engine",
        help="how engine-driven loads copy on a GPU: the copy engines (one batched runtime "
        "call per load) or one gather kernel per load (lmcache.load_copy)",
    )
    ap.add_argument(
        "--load-streams",
        type=int,
        default=1,
        help="copy streams an engine-driven load's copies alternate between "
        "(lmcache.load_streams; default 1)",
    )
    ap.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks of every arm's engine (the tier arm then loads on every rank)",
    )
    ap.add_argument(
        "--profile-hooks",
        action="store_true",
        help="profile the connector's hooks on the step thread (cProfile; printed with "
        "--arms tier, kept in the JSON): where their time per step goes, by function",
    )
    ap.add_argument(
        "--rank-collapse",
        choices=("auto", "true", "false"),
        default="auto",
        help="lmcache.tp_rank_collapse of the tier arm (with --tensor-parallel-size > 1)",
    )
    ap.add_argument(
        "--batch-invariant",
        action="store_true",
        help="every arm's engine in the batch-invariant mode (EngineConfig.batch_invariant); "
        "main then checks that every pass equals the no-reuse arm token for token and exits 1 "
        "where one does not",
    )
    for key, value in PRESETS["cpu"].items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None)
    args = ap.parse_args()
    defaults = dict(PRESETS[args.preset])
    if args.arms == "speculative":
        if not 1 <= args.speculative_tokens <= 5:
            ap.error("--speculative-tokens must be in [1, 5]")
        defaults.update(SPECULATIVE[args.preset])
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.repeats is None:
        args.repeats = 2
    if args.workload == "auto":
        args.workload = "recall" if "recall" in Path(args.model).name else "random"
    if args.arms == "idle":
        idle_interleaved(args) if args.interleave else idle(args)
        return
    make = recall_prompts if args.workload == "recall" else shared_prefix_prompts
    prompts = make(args.requests, args.prefixes, args.prefix_len, args.tail_len)
    if args.arms == "speculative":
        sys.exit(speculative(args, prompts))
    tier = tier_engine(args)
    if args.arms == "tier":
        arm = run_arm("HBM + tier", prompts, args, **tier)
        table = md_table(STEPS_HEADER, steps_table([arm])) + "\n\n" + phase_text([arm])
        if "hook_profile" in arm:
            table += "\n\nThe connector's hooks, profiled (cProfile, by own time):\n\n```\n"
            table += arm["hook_profile"] + "```\n"
        cmd = f"python -m benchmarks.serving {shlex.join(sys.argv[1:])}"
        print(table)
        print(write_results(f"{args.name}_tier", {"args": vars(args), "arms": [arm]}, table, cmd))
        return
    block = 256
    ceiling = sum((len(p) - 1) // block * block for p in prompts)
    kept = [{}, {}, {}]
    arms = [
        run_arm("no prefix reuse", prompts, args, False, kept[0], enable_prefix_caching=False),
        run_arm("HBM prefix caching", prompts, args, keep=kept[1]),
        run_arm("HBM + tier", prompts, args, keep=kept[2], **tier),
    ]
    exact = exactness(arms, kept)
    # calibrated model on the arms that move no bytes: time per request = a * computed + b
    xs = [a["computed_prompt_tokens"] / a["requests"] for a in arms[:2]]
    ys = [a["wall_s"] / a["requests"] for a in arms[:2]]
    a = (ys[0] - ys[1]) / (xs[0] - xs[1]) if xs[0] != xs[1] else 0.0
    b = ys[0] - a * xs[0]
    tier = arms[2]
    c_tier = tier["computed_prompt_tokens"] / tier["requests"]
    predicted = 1 / (a * c_tier + b)
    model = {
        "a_s_per_token": a,
        "b_s_per_request": b,
        "tier_predicted_req_per_s": predicted,
        "tier_measured_over_predicted": tier["req_per_s"] / predicted,
    }
    reused = tier["hbm_hit_tokens"] + tier["tier_hit_tokens"]
    summary = {
        "ceiling_tokens": ceiling,
        "tier_arm_reused_tokens": reused,
        "reused_over_ceiling": reused / ceiling,
        "tier_over_hbm_req_per_s": tier["req_per_s"] / arms[1]["req_per_s"],
        "tier_over_no_reuse_req_per_s": tier["req_per_s"] / arms[0]["req_per_s"],
        "calibrated_model": model,
        "exactness": exact,
    }
    rows = []
    for arm in arms:
        rows.append(
            [
                arm["arm"],
                arm["req_per_s"],
                arm["ttft_p50_ms"],
                arm["ttft_mean_ms"],
                arm.get("itl_p50_ms", ""),
                arm.get("itl_mean_ms", ""),
                arm["hbm_hit_tokens"],
                arm["tier_hit_tokens"],
                arm["computed_prompt_tokens"],
                arm["preemptions"],
                arm.get("load_p50_ms", ""),
                arm.get("load_p99_ms", ""),
                arm.get("load_gbps_p50", ""),
                arm.get("plain_copy_gbps", ""),
                arm.get("connector_ms_per_step", ""),
            ]
        )
    table = md_table(
        [
            "arm",
            "req/s",
            "TTFT p50 ms",
            "TTFT mean ms",
            "ITL p50 ms",
            "ITL mean ms",
            "HBM tokens",
            "tier tokens",
            "computed tokens",
            "preemptions",
            "load p50 ms",
            "load p99 ms",
            "load GB/s",
            "plain copy GB/s",
            "connector ms/step",
        ],
        rows,
    )
    table += (
        f"\n\nReused prompt tokens in the tier arm: {reused} of a ceiling of {ceiling} "
        f"({100 * reused / ceiling:.2f}%). HBM + tier vs HBM-only: "
        f"{summary['tier_over_hbm_req_per_s']:.2f}x req/s; vs no reuse: "
        f"{summary['tier_over_no_reuse_req_per_s']:.2f}x.\n"
        f"The tier held {tier.get('tier_held_after_pass1', 0)} of those tokens after pass 1 "
        f"(a direct lookup of every prompt); tokens it held that pass 2 recomputed for lack of "
        f"room to load them: {tier['tier_tokens_recomputed']}.\n"
        f"Calibrated model t(c) = {a * 1e3:.4f} ms/token * c + {b * 1e3:.1f} ms: predicts "
        f"{predicted:.3f} req/s for the tier arm; measured {tier['req_per_s']:.3f} "
        f"({100 * model['tier_measured_over_predicted']:.1f}% of predicted).\n"
    )
    for arm in arms:  # pass 2 against pass 1 (which has top-2 logprobs)
        if arm.get("parting_from_pass1"):
            table += (
                f"{arm['arm']}, pass 2 against pass 1: {parting_text(arm['parting_from_pass1'])}\n"
            )
    table += phase_text(arms)
    table += exactness_text(exact, args.batch_invariant)
    table += (
        "\nSteps of the measured pass by kind (decode: every span one token; prefill: none; "
        "outside steps: the loop waiting with nothing to run):\n\n"
        + md_table(STEPS_HEADER, steps_table(arms))
        + "\n"
    )
    cmd = f"python -m benchmarks.serving {shlex.join(sys.argv[1:])}"  # with any overrides
    print(table)
    print(
        write_results(args.name, {"args": vars(args), "arms": arms, "summary": summary}, table, cmd)
    )
    if args.batch_invariant and exact["differing_tokens"]:
        sys.exit(1)  # the mode promises every pass the no-reuse arm's tokens


if __name__ == "__main__":
    main()
