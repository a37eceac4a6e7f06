"""Launch parameters of the model's kernels, timed side by side on the shapes they run at.

python -m benchmarks.kernel_sweep --tokens 4096 --rows 4096 --name kernel_sweep_h200

Prefill inputs have the shapes of a 16 x 256-token chunk of v41-bench late in a prompt (tiles
of 64 queries): sink attention over 192 window keys per tile (each query sees 128) and
``--topk`` compressed rows per query read from a PAGE-like plane of ``--rows`` rows per
sequence at random offsets; index scores of 32 heads x 128 over ``--rows`` float32 keys per
sequence, every row visible. Decode attention: ``--decode-batch`` rows, each over its own 128
window keys and ``--topk`` rows, split across programs (``sink_attention_decode``; the torch
expression's time is in the components profile). mHC's sinkhorn (hc 4, 20 rounds) runs on a
decode batch's 16 tokens and on a chunk's. Each configuration: median over ``--repeats``
replays of a CUDA graph of 10 calls, after one warm-up call (the compile); the default
configuration is marked. Attention FLOPs count QK and PV (4 x heads x head_dim x keys per
query); index FLOPs 2 x heads x dim x rows per query.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from atom.kernels.attention import DECODE_SPLITS
from benchmarks.common import command_line, graph_timer, md_table, write_results

SINK_CONFIGS = [
    dict(BH=64, BN=64, num_warps=8, num_stages=2),
    dict(BH=64, BN=32, num_warps=8, num_stages=2),
    dict(BH=64, BN=16, num_warps=8, num_stages=2),
    dict(BH=64, BN=32, num_warps=8, num_stages=3),
    dict(BH=64, BN=16, num_warps=8, num_stages=3),
    dict(BH=64, BN=32, num_warps=8, num_stages=4),
    dict(BH=64, BN=32, num_warps=4, num_stages=2),
    dict(BH=64, BN=32, num_warps=16, num_stages=2),
    dict(BH=64, BN=64, num_warps=16, num_stages=2),
    dict(BH=64, BN=64, num_warps=8, num_stages=3),
    dict(BH=64, BN=128, num_warps=8, num_stages=2),
    dict(BH=32, BN=64, num_warps=8, num_stages=2),
    dict(BH=32, BN=32, num_warps=4, num_stages=2),
    dict(BH=32, BN=32, num_warps=4, num_stages=3),
    dict(BH=32, BN=64, num_warps=4, num_stages=3),
    dict(BH=16, BN=64, num_warps=4, num_stages=3),
]

INDEX_CONFIGS = [
    dict(BT=64, BR=64, num_warps=4, num_stages=2),
    dict(BT=64, BR=128, num_warps=4, num_stages=2),
    dict(BT=64, BR=128, num_warps=8, num_stages=2),
    dict(BT=64, BR=64, num_warps=4, num_stages=3),
    dict(BT=64, BR=32, num_warps=4, num_stages=2),
    dict(BT=32, BR=64, num_warps=4, num_stages=2),
    dict(BT=32, BR=128, num_warps=4, num_stages=2),
    dict(BT=64, BR=128, num_warps=8, num_stages=3),
]

SPLITS = [1, 2, 4, 8, 16]

SINKHORN_CONFIGS = [
    dict(BLOCK=4, num_warps=1),
    dict(BLOCK=64, num_warps=4),
    dict(BLOCK=32, num_warps=2),
    dict(BLOCK=16, num_warps=1),
    dict(BLOCK=8, num_warps=1),
    dict(BLOCK=2, num_warps=1),
]


def _time(fn, repeats: int, calls: int = 10) -> float | str:
    """Median device ms of one call: ``calls`` calls captured in a CUDA graph (no launch
    time between them: a small kernel timed alone measures its launch), replayed ``repeats``
    times after a warm-up call (the compile). A configuration that does not compile or launch
    (too much shared memory, say) gives the error's first line instead."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported in the table, the sweep goes on
        return f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
    replay = graph_timer(lambda i: fn(), calls)
    return statistics.median(replay() for _ in range(repeats))


def _round(ms: float | str, digits: int) -> float | str:
    return round(ms, digits) if isinstance(ms, float) else ms


def _rate(flops: float, ms: float | str) -> float | str:
    return round(flops / ms / 1e9, 1) if isinstance(ms, float) else "-"


def _sink_inputs(tokens: int, rows: int, topk: int, seqs: int, gen):
    tiles, per, heads, d, keys = tokens // 64, 64, 64, 512, 192
    dev, bf = "cuda", torch.bfloat16
    q = torch.randn(tokens, heads, d, generator=gen).to(dev, bf)
    win_k = torch.randn(tiles, keys, d, generator=gen).to(dev, bf)
    i = torch.arange(per)[:, None]
    j = torch.arange(keys)[None, :]
    mask = ((j - (keys - per) <= i) & (j - (keys - per) > i - 128)).repeat(tiles, 1).to(dev)
    plane = torch.randn(seqs * rows, d, generator=gen).to(dev, bf)
    seq = torch.arange(tokens) * seqs // tokens
    picks = seq[:, None] * rows + torch.randint(0, rows, (tokens, topk), generator=gen)
    offsets = (picks * d).to(dev)
    valid = torch.ones(tokens, topk, dtype=torch.bool, device=dev)
    sink = torch.randn(heads, generator=gen).to(dev)
    return q, win_k, mask, plane, offsets, valid, sink, d**-0.5


def _decode_inputs(batch: int, rows: int, topk: int, gen):
    """A decode batch: each row its own 128 window keys (all visible) and ``topk`` rows."""
    heads, d, dev, bf = 64, 512, "cuda", torch.bfloat16
    q = torch.randn(batch, heads, d, generator=gen).to(dev, bf)
    win_k = torch.randn(batch, 128, d, generator=gen).to(dev, bf)
    mask = torch.ones(batch, 128, dtype=torch.bool, device=dev)
    plane = torch.randn(batch * rows, d, generator=gen).to(dev, bf)
    picks = torch.arange(batch)[:, None] * rows + torch.randint(
        0, rows, (batch, topk), generator=gen
    )
    valid = torch.ones(batch, topk, dtype=torch.bool, device=dev)
    sink = torch.randn(heads, generator=gen).to(dev)
    return q, win_k, mask, plane, (picks * d).to(dev), valid, sink, d**-0.5


def _index_inputs(tokens: int, rows: int, seqs: int, gen):
    dev = "cuda"
    qi = torch.randn(tokens, 32, 128, generator=gen).to(dev)
    w = torch.randn(tokens, 32, generator=gen).to(dev)
    keys = torch.randn(seqs, rows, 128, generator=gen).to(dev)
    tile_keys = (torch.arange(tokens // 64) * seqs // (tokens // 64)).to(dev)
    visible = torch.full((tokens,), rows, dtype=torch.int64, device=dev)
    return qi, w, keys, tile_keys, visible


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=512)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--decode-batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--name", default="kernel_sweep_h200")
    args = ap.parse_args()
    from atom.kernels._attention_triton import sink_attention_config, sink_attention_triton
    from atom.kernels._index_scores_triton import index_scores_config, index_scores_triton

    gen = torch.Generator().manual_seed(0)
    data, rows_md = {"sink_attention": [], "index_scores": [], "sinkhorn": []}, []
    sink_in = _sink_inputs(args.tokens, args.rows, args.topk, args.seqs, gen)
    default = sink_attention_config(args.tokens, 64, False)
    flops = 4 * 64 * 512 * (128 + args.topk) * args.tokens
    for cfg in SINK_CONFIGS:
        ms = _time(lambda c=cfg: sink_attention_triton(*sink_in, config=c), args.repeats)
        row = {"config": cfg, "ms": _round(ms, 3), "tflops": _rate(flops, ms)}
        data["sink_attention"].append(row)
        mark = " (default)" if cfg == default else ""
        rows_md.append(["sink_attention", f"{cfg}{mark}", row["ms"], row["tflops"]])
        print(rows_md[-1], flush=True)
    idx_in = _index_inputs(args.tokens, args.rows, args.seqs, gen)
    default = index_scores_config(64)
    flops = 2 * 32 * 128 * args.rows * args.tokens
    for prec in ("tf32x3", "tf32", "ieee"):
        for cfg in INDEX_CONFIGS if prec == "tf32x3" else INDEX_CONFIGS[:1]:
            ms = _time(lambda c=cfg, p=prec: index_scores_triton(*idx_in, p, c), args.repeats)
            row = {"precision": prec, "config": cfg, "ms": _round(ms, 3)}
            row["tflops"] = _rate(flops, ms)
            data["index_scores"].append(row)
            mark = " (default)" if cfg == default and prec == "tf32x3" else ""
            rows_md.append([f"index_scores {prec}", f"{cfg}{mark}", row["ms"], row["tflops"]])
            print(rows_md[-1], flush=True)
    from atom.kernels._attention_triton import sink_attention_split_triton

    data["decode_attention"] = []
    dec = _decode_inputs(args.decode_batch, args.rows, args.topk, gen)
    for splits in SPLITS:
        ms = _time(lambda s=splits: sink_attention_split_triton(*dec, s), args.repeats)
        data["decode_attention"].append({"splits": splits, "ms": _round(ms, 4)})
        mark = " (default)" if splits == DECODE_SPLITS else ""
        label = f"decode attention, {args.decode_batch} rows"
        rows_md.append([label, f"splits {splits}{mark}", _round(ms, 4), "-"])
        print(rows_md[-1], flush=True)
    from atom.kernels._sinkhorn_triton import sinkhorn_triton

    for n in (16, args.tokens):  # a decode batch's tokens and a chunk's
        logits = torch.randn(n, 16, generator=gen).to("cuda")
        for cfg in SINKHORN_CONFIGS:
            ms = _time(lambda c=cfg, x=logits: sinkhorn_triton(x, 4, 20, 1e-6, c), args.repeats)
            data["sinkhorn"].append({"tokens": n, "config": cfg, "ms": _round(ms, 4)})
            mark = " (default)" if cfg == SINKHORN_CONFIGS[0] else ""
            rows_md.append([f"sinkhorn, {n} tokens", f"{cfg}{mark}", _round(ms, 4), "-"])
            print(rows_md[-1], flush=True)
    table = md_table(["kernel", "launch parameters", "ms (median)", "TFLOP/s"], rows_md)
    path = write_results(args.name, data, table, command_line("kernel_sweep", args))
    print(path.read_text())


if __name__ == "__main__":
    main()
