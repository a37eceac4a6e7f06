"""What one rank holds of a model's weights, by kind, at each tensor-parallel size: the bytes
atom allocates, counted exactly on a model built on ``meta`` and split as the ranks split it
(nothing is allocated, so the published configs count here on a CPU).

    python -m benchmarks.memory_plan --model v41-flash v4-flash --tp 1 2 4 8

Kinds: the routed experts, V4.1's Engram tables, the embedding and head, and the rest (the
attention, shared experts, norms, mHC, compressors, indexers, draft stages). At
``--weight-dtype fp8`` the linears and tables a checkpoint stores quantized keep their stored
bytes (FP8, FP4 experts, scales), as ``weight_dtype: fp8`` (and ``auto`` on a GPU) loads them.
The ``engram replicated bf16`` column is what one rank held of the Engram tables before they
were split and kept at FP8 (the tables whole and dequantized on every rank), from their shapes.
A world size the model cannot be split over is reported with the reason.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from benchmarks.common import command_line, md_table, write_results

GB = 1e9


def kind_of(name: str) -> str:
    if ".engram.embed." in name:
        return "engram tables"
    if ".experts." in name:
        return "routed experts"
    if name.split(".")[0] in ("embed", "head", "lm_head") or "embed_tokens" in name:
        return "embedding + head"
    return "other"


def rank_bytes(model: str, world: int, weight_dtype: str, overrides: dict | None = None) -> dict:
    """Bytes one rank holds by kind (rank 0; every rank holds equal slices) of ``model`` with
    ``overrides`` (the engine's ``model_overrides``)."""
    from atom.models.common.tensor_parallel import TensorParallelError, shard_model
    from atom.models.registry import family, keep_stored_precision, resolve_config

    config, _ = resolve_config(model, overrides)
    fam = family(config)
    net = fam.get("model")(config, device="meta", dtype=torch.bfloat16)
    if weight_dtype == "fp8":
        keep_stored_precision(net, fam)
    try:
        shard_model(net, 0, world, reduce=None)
    except TensorParallelError as exc:
        return {"refused": str(exc)}
    held: Counter = Counter()
    seen = set()
    for name, t in list(net.named_parameters()) + list(net.named_buffers()):
        if id(t) in seen or name.startswith("engram_hash."):  # hashing tables: not weights
            continue
        seen.add(id(t))
        held[kind_of(name)] += t.numel() * t.element_size()
    spec = getattr(config, "engram_spec", None)
    replicated = 0
    if spec is not None:
        replicated = sum(rows * spec.head_dim * 2 for rows in spec.num_embeddings)
    return {"bytes": dict(held), "total": sum(held.values()), "engram_replicated_bf16": replicated}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", default=["v41-flash", "v4-flash"])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--weight-dtype", default="fp8", choices=["fp8", "bf16"])
    ap.add_argument("--name", default="memory_plan_cpu")
    args = ap.parse_args(argv)
    kinds = ["routed experts", "engram tables", "embedding + head", "other"]
    rows, data = [], {}
    for model in args.model:
        for world in args.tp:
            got = rank_bytes(model, world, args.weight_dtype)
            data[f"{model}/tp{world}"] = got
            if "refused" in got:
                rows.append([model, world, *["-"] * (len(kinds) + 2), got["refused"][:80]])
                continue
            held = got["bytes"]
            replicated = got["engram_replicated_bf16"]
            before = got["total"] - held.get("engram tables", 0) + replicated
            rows.append(
                [model, world]
                + [f"{held.get(k, 0) / GB:.1f}" for k in kinds]
                + [f"**{got['total'] / GB:.1f}**", f"{before / GB:.1f}" if replicated else "-", ""]
            )
            print(model, world, {k: round(v / GB, 2) for k, v in held.items()}, flush=True)
    headers = ["model", "TP", *[f"{k} GB" for k in kinds], "per rank GB"]
    headers += ["per rank GB with engram replicated bf16", "note"]
    table = md_table(headers, rows)
    table += (
        f"\n\nweight_dtype {args.weight_dtype}; one rank's weight bytes (1 GB = 1e9 B), "
        "counted on a model built on meta and split as the ranks split it."
    )
    write_results(args.name, {"ranks": data}, table, command_line("memory_plan", args))
    print(table)


if __name__ == "__main__":
    main()
