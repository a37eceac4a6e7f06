"""Shared helpers for benchmarks: environment facts and result files."""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> dict:
    # ATOM_GIT_REV: the commit a snapshot without .git was made from (the GPU runs)
    rev = os.environ.get("ATOM_GIT_REV", "")
    try:
        rev = (
            rev
            or subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                check=False,
            ).stdout.strip()
        )
    except OSError:
        rev = ""
    env = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git": rev,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "device": "cpu",
    }
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
    return env


def card_name(name: str, device: str) -> str:
    """``name`` with its card tag made true: the GPU names say ``h200`` (the card the project
    measures on), and a run on another NVIDIA card (``device`` as torch names it, e.g.
    "NVIDIA H100 80GB HBM3") says that card's tag instead, so an H100's numbers never land
    in an H200's file."""
    m = re.search(r"\b([A-Z]\d{2,4})\b", device) if "h200" in name else None
    return name.replace("h200", m.group(1).lower()) if m else name


def write_results(name: str, data: dict, table: str, command: str) -> Path:
    """Write ``<name>.json`` and ``<name>.md`` under benchmarks/results/ (``name``'s card tag
    as ``card_name`` makes it true)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    env = environment()
    name = card_name(name, env["device"])
    data = {"command": command, "environment": env, **data}
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    md = (
        f"# {name}\n\nCommand: `{command}`\n\n"
        f"Environment: {env['device']}, torch {env['torch']}, {env['cpu_threads']} CPU threads, "
        f"git {env['git']}, {env['date']}\n\n{table}\n"
    )
    (RESULTS / f"{name}.md").write_text(md)
    return RESULTS / f"{name}.md"


def command_line(module: str, args) -> str:
    """The command that reproduces a run: ``python -m benchmarks.<module>`` with every parsed
    argument spelled out (lists space-separated), for the results files."""
    flags = " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items()
    )
    return f"python -m benchmarks.{module} {flags}"


def md_table(headers: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        out.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(out)


def bound_runtime(
    model: str,
    dtype: torch.dtype,
    device: str,
    blocks: int,
    slots: int,
    graphs: bool = False,
    weight_dtype: str = "auto",
    speculative_tokens: int = 0,
):
    """A model runtime (random weights, seed 0; fp8 index rows, KV stored in the compute dtype)
    bound to a fresh pool of ``blocks`` blocks and ``slots`` state slots; ``graphs``: with
    decode CUDA graphs for up to ``slots`` sequences (on CUDA; ``rt.cuda_graphs`` toggles; with
    ``speculative_tokens`` k, verify graphs of spans up to k + 1 tokens too);
    ``weight_dtype`` as ``EngineConfig.weight_dtype`` (auto: as the preset stores them)."""
    from atom.models.registry import default_block_size, load_runtime

    rt = load_runtime(
        model,
        dtype=dtype,
        kv_dtype="fp32" if dtype == torch.float32 else "bf16",
        index_dtype="fp8",
        block_size=default_block_size(model),
        device=device,
        seed=0,
        weight_dtype=weight_dtype,
        speculative_tokens=speculative_tokens,
    )
    if graphs and hasattr(rt, "enable_decode_graphs"):
        rt.enable_decode_graphs(slots)
    spec = rt.spec
    extra_blocks = getattr(rt, "reserved_blocks", 0)
    extra_slots = getattr(rt, "reserved_slots", 0)
    pool = torch.zeros(spec.pool_shape(blocks + extra_blocks), dtype=spec.pool_dtype, device=device)
    state = torch.zeros(slots + extra_slots, spec.state_bytes, dtype=torch.uint8, device=device)
    rt.bind(pool, state)
    return rt


def graph_timer(fn, calls: int):
    """Capture ``fn(i)`` for i in range(calls) in one CUDA graph (after a warm-up of each call
    and one on a side stream: the compiles); returns a function that replays it once and gives
    the device ms per call (a small kernel timed eagerly measures its launch, not itself)."""
    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()

    def replay() -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / calls

    replay.graph = graph  # kept alive with the timer
    return replay


def graph_median(fn, calls: int, iters: int) -> float:
    """The median over ``iters`` replays of ``graph_timer(fn, calls)``: device ms per call."""
    replay = graph_timer(fn, calls)
    return statistics.median(replay() for _ in range(iters))
