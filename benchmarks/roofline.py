"""Decode and prefill of the paged forward against what the GPU can do, measured in one run.

python -m benchmarks.roofline --model v41-bench --device cuda --dtype bfloat16 \
    --position 4096 --batch 1 8 16 32 --name roofline_h200

Either family (``--model v4-bench`` for V4).

Measured first: HBM read bandwidth (``torch.sum`` over a ``--bw-gib`` GiB bf16 tensor) and bf16
matmul throughput (an 8192^3 product). Then per batch B: B sequences are prefilled to
``--position`` in chunks of ``--chunk`` tokens per sequence (one forward = B x chunk tokens;
median over ``--prefill-repeats`` passes, the first of which compiles kernels), then decoded
with CUDA graphs (median over ``--repeats`` rounds of ``--decode-steps`` steps; a step =
forward + argmax().cpu()).

Decode floor = bytes of every weight the step reads at its stored dtype / measured bandwidth:
every layer's attention, norm, mHC and dense weights, the shared experts, the routed experts
the batch activates (distinct experts per layer, counted from the routing of one eager step at
the same position), the LM head, and the embedding / Engram table rows the batch looks up.
Kernel time = the summed duration of the GPU kernels of one profiled step (graphs on); kernels =
their number. ``--compile-glue``: the decode graphs run compiled glue
(``EngineConfig.compile_glue``).

Prefill peak fraction = (2 x active parameters per token + attention FLOPs per token) x
tokens/s / measured matmul FLOP/s. Active parameters: every matmul weight a token passes
through (routed experts: top_k of them; index keys once per ratio tokens), not embedding or
Engram tables; the LM head is counted, though a prefill chunk runs it on its last token only:
the last column leaves it out. Attention FLOPs per token at position p and layer: 4 x heads x
head_dim x keys (QK and PV; keys = min(window, p + 1) + min(index_topk, (p + 1) // ratio))
plus the indexer's scoring, 2 x index_heads x index_head_dim x (p + 1) // ratio, on
FULL/REINDEX layers; averaged over the prefilled positions.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from atom.kernels.triton_env import triton_importable
from atom.model_api import Span
from benchmarks.common import bound_runtime, command_line, md_table, write_results


def _timed(fn, n: int) -> float:
    """Median seconds of ``n`` calls of ``fn`` (CUDA-synchronized)."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def hbm_read_gbs(gib: float) -> float:
    x = torch.ones(int(gib * (1 << 30)) // 2, dtype=torch.bfloat16, device="cuda")
    s = _timed(lambda: x.sum(dtype=torch.float32), 10)
    x = None  # free the buffer before the model is built
    return gib * (1 << 30) / s / 1e9


def matmul_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    s = _timed(lambda: a @ b, 10)
    return 2 * n**3 / s / 1e12


def _is_expert(name: str) -> bool:
    return ".experts." in name


def moe_layers(model) -> list:
    """The model's MoE modules, one per layer (``atom.models.common.moe.MoE``), either family."""
    layers = model.model.layers if hasattr(model, "model") else model.layers
    return [getattr(layer, "mlp", None) or layer.ffn for layer in layers]


def lm_head(model):
    return model.lm_head if hasattr(model, "lm_head") else model.head


def stored_weights(model):
    """(name, tensor) of every weight as stored on the device: the parameters, and the FP8
    linears' E4M3 weights, the FP4 experts' codes and the FP8 row tables (V4.1's Engram),
    with their scales (buffers; ``weight_dtype: fp8``), so floors count the bytes a step
    really reads."""
    from atom.models.common.fp4_linear import Fp4Linear
    from atom.models.common.fp8_linear import Fp8Linear
    from atom.models.common.fp8_rows import Fp8RowTable

    yield from model.named_parameters()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, (Fp8Linear, Fp4Linear, Fp8RowTable)):
            yield f"{mod_name}.weight", mod.weight
            yield f"{mod_name}.weight_scale", mod.weight_scale


def weight_counts(model) -> dict:
    """Bytes and per-token matmul parameters of the model's weights, by kind. Draft layers
    (V4's ``mtp.*``) are left out: a decode step without drafts does not read them."""
    cfg = model.config
    per_expert_bytes = per_expert_params = 0
    dense_bytes = active = 0
    lookup_bytes_per_row = 0
    for name, p in stored_weights(model):
        if name.startswith("mtp."):
            continue
        nbytes = p.numel() * p.element_size()
        if _is_expert(name):
            if ".experts.0." in name:
                per_expert_bytes += nbytes  # FP4 codes and scales at their stored bytes
                if not name.endswith(".weight_scale"):  # packed FP4: two weights a byte
                    per_expert_params += p.numel() * (2 if p.dtype == torch.uint8 else 1)
            continue
        lookup = ("embed_tokens.weight", "embed.weight", "embed.weight_scale")
        if name.endswith(lookup) or ".engram.tables." in name:
            lookup_bytes_per_row += p.shape[1] * p.element_size()  # one row per token
            continue
        dense_bytes += nbytes
        if p.dim() == 2 and not name.endswith(".weight_scale"):
            share = 1.0
            if name.endswith("indexer.wk.weight"):  # V4.1: index keys once per group
                layer = int(name.split(".layers.")[1].split(".")[0])
                share = 1.0 / cfg.compress_ratios[layer]
            active += p.numel() * share
    # expert 0 of every layer was summed: one layer's expert is that over the MoE layers
    active += cfg.num_experts_per_tok * per_expert_params
    return {
        "head_params": lm_head(model).weight.numel(),
        "dense_bytes": dense_bytes,
        "per_expert_bytes": per_expert_bytes / len(moe_layers(model)),
        "lookup_bytes_per_row": lookup_bytes_per_row,
        "active_params": active,
    }


def attention_flops(cfg, p: int) -> float:
    """Attention FLOPs of one token at position p (all layers), see the module doc. V4
    (no ``layer_modes``): a ratio-4 layer scores every row with its indexer and attends the
    top-k, a ratio-128 layer attends every visible row."""
    total = 0.0
    modes = getattr(cfg, "layer_modes", None)
    for layer, r in enumerate(cfg.compress_ratios[: cfg.num_hidden_layers]):
        keys = min(cfg.sliding_window, p + 1)
        rows = (p + 1) // r if r else 0
        indexed = r == 4 if modes is None else r > 0 and modes[layer].name in ("FULL", "REINDEX")
        if r > 0:
            keys += min(cfg.index_topk, rows) if modes is not None or r == 4 else rows
            if indexed:
                total += 2 * cfg.index_n_heads * cfg.index_head_dim * rows
        total += 4 * cfg.num_attention_heads * cfg.head_dim * keys
    return total


def distinct_experts(rt, run_step) -> int:
    """Distinct routed experts, summed over layers, of one eager step (read where each MoE
    mixes its routed experts, which both families' routers feed)."""
    seen: list[int] = []
    moes = moe_layers(rt.model)

    def hooked(orig):
        def mix(x, idx, w):
            seen.append(int(torch.unique(idx).numel()))
            return orig(x, idx, w)

        return mix

    for m in moes:
        m.mix = hooked(m.mix)
    graphs = rt.cuda_graphs
    rt.cuda_graphs = False
    try:
        run_step()
    finally:
        rt.cuda_graphs = graphs
        for m in moes:
            del m.mix
    return sum(seen)


def kernel_ms(run_step) -> tuple[float, int]:
    """(summed device ms, number) of the GPU kernels of one step (graph replays included)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_step()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return sum(e.time_range.elapsed_us() for e in evs) / 1000, len(evs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="v41-bench")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--weight-dtype", default="auto", choices=["auto", "bf16", "fp8"])
    ap.add_argument("--position", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefill-repeats", type=int, default=3)
    ap.add_argument("--bw-gib", type=float, default=4.0)
    ap.add_argument("--name", default="roofline_h200")
    ap.add_argument(
        "--compile-glue",
        action="store_true",
        help="compiled glue inside the decode graphs (EngineConfig.compile_glue)",
    )
    ap.add_argument(
        "--batch-invariant",
        action="store_true",
        help="the batch-invariant mode (EngineConfig.batch_invariant; graphs where Triton imports, "
        "as the engine)",
    )
    args = ap.parse_args()
    if args.compile_glue:  # the graphs' warm-up at bind compiles the glue (its log line)
        from atom.models.common import glue_compile

        glue_compile.configure(True)
    if args.batch_invariant:
        from atom.kernels import invariant

        invariant.configure(True)
    bw = hbm_read_gbs(args.bw_gib)
    peak = matmul_tflops()
    print(f"HBM read {bw:.0f} GB/s, bf16 matmul {peak:.0f} TFLOP/s", flush=True)
    max_batch = max(args.batch)
    steps = args.decode_steps * args.repeats + 8
    bs = 256
    per_seq = -(-(args.position + steps) // bs)
    rt = bound_runtime(
        args.model,
        getattr(torch, args.dtype),
        args.device,
        per_seq * max_batch,
        max_batch,
        not args.batch_invariant or triton_importable(),  # builder.decode_graphs_wanted
        weight_dtype=args.weight_dtype,
    )
    cfg = rt.model.config
    counts = weight_counts(rt.model)
    att = [attention_flops(cfg, p) for p in range(args.position)]
    flops_tok = 2 * counts["active_params"] + sum(att) / len(att)
    gen = torch.Generator().manual_seed(0)
    rows, cells = [], []
    for batch in args.batch:
        tables = [torch.arange(i * per_seq, (i + 1) * per_seq) for i in range(batch)]
        prompts = torch.randint(0, 300, (batch, args.position), generator=gen)
        passes = []  # a pass from position 0 starts the slots afresh
        for _ in range(args.prefill_repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for start in range(0, args.position, args.chunk):
                end = min(args.position, start + args.chunk)
                spans = [Span(start, end, i, tables[i]) for i in range(batch)]
                rt.forward(prompts[:, start:end].reshape(-1), spans)
            torch.cuda.synchronize()
            passes.append(batch * args.position / (time.perf_counter() - t0))
        prefill_tps = statistics.median(passes)
        state = {"pos": args.position, "next": torch.zeros(batch, dtype=torch.int64)}

        def step(state=state, tables=tables, batch=batch):
            pos = state["pos"]
            spans = [Span(pos, pos + 1, i, tables[i]) for i in range(batch)]
            state["next"] = rt.forward(state["next"], spans).argmax(-1).cpu()
            state["pos"] += 1

        experts = distinct_experts(rt, step)
        for _ in range(2):
            step()  # warm: captures this batch's graph
        rounds = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.decode_steps):
                step()
            rounds.append(1000 * (time.perf_counter() - t0) / args.decode_steps)
        step_ms = statistics.median(rounds)
        k_ms, k_count = kernel_ms(step)
        weight_bytes = (
            counts["dense_bytes"]
            + experts * counts["per_expert_bytes"]
            + batch * counts["lookup_bytes_per_row"]
        )
        floor_ms = weight_bytes / (bw * 1e9) * 1000
        frac = flops_tok * prefill_tps / (peak * 1e12)
        frac_nohead = (flops_tok - 2 * counts["head_params"]) * prefill_tps / (peak * 1e12)
        row = {
            "batch": batch,
            "position": args.position,
            "decode_step_ms": round(step_ms, 2),
            "decode_rounds_ms": [round(r, 2) for r in rounds],
            "kernel_ms": round(k_ms, 2),
            "kernels_per_step": k_count,
            "weight_bytes": weight_bytes,
            "experts_read": experts,
            "floor_ms": round(floor_ms, 3),
            "step_over_floor": round(step_ms / floor_ms, 2),
            "prefill_tokens_per_s": round(prefill_tps, 1),
            "prefill_passes_tokens_per_s": [round(x, 1) for x in passes],
            "prefill_tokens_per_forward": batch * args.chunk,
            "prefill_peak_fraction": round(frac, 4),
            "prefill_peak_fraction_without_lm_head": round(frac_nohead, 4),
        }
        rows.append(row)
        print(row, flush=True)
        cells.append(
            [
                batch,
                row["decode_step_ms"],
                row["kernel_ms"],
                k_count,
                f"{weight_bytes / 1e9:.2f}",
                row["floor_ms"],
                f"{row['step_over_floor']}x",
                batch * args.chunk,
                row["prefill_tokens_per_s"],
                f"{min(passes):.0f}-{max(passes):.0f}",
                f"{100 * frac:.1f}%",
                f"{100 * frac_nohead:.1f}%",
            ]
        )
    table = md_table(
        [
            "batch",
            "decode step ms",
            "kernel ms",
            "kernels",
            "weights read GB",
            "floor ms",
            "step / floor",
            "prefill tokens / forward",
            "prefill tok/s",
            "passes' range",
            "of bf16 peak",
            "of peak, LM head not counted",
        ],
        cells,
    )
    table += (
        f"\n\nHBM read bandwidth {bw:.0f} GB/s (torch.sum over {args.bw_gib} GiB bf16); bf16 "
        f"matmul {peak:.0f} TFLOP/s (8192^3). Active parameters per token "
        f"{counts['active_params'] / 1e9:.3f} B; FLOPs per prefill token (mean over positions "
        f"0..{args.position - 1}) {flops_tok / 1e9:.3f} G. Decode at position {args.position} "
        "with CUDA graphs: median over rounds of steps (forward + argmax().cpu()). Prefill: "
        f"median over {args.prefill_repeats} passes from position 0 (the first compiles what "
        "it meets first). See the "
        "module doc of benchmarks/roofline.py for what each column counts."
    )
    if args.compile_glue:
        from atom.models.common import glue_compile

        st = glue_compile.STATS
        table += (
            f"\nCompiled glue: {st.compiles} graphs compiled in {st.compile_s:.1f} s; regions "
            f"run eagerly after a failure: {sorted(st.disabled) or 'none'}."
        )
    cmd = command_line("roofline", args)
    data = {
        "model": args.model,
        "dtype": args.dtype,
        "hbm_read_gbs": round(bw, 1),
        "matmul_tflops": round(peak, 1),
        "active_params": counts["active_params"],
        "flops_per_prefill_token": flops_tok,
        "rows": rows,
    }
    print(table)
    print(write_results(args.name, data, table, cmd))


if __name__ == "__main__":
    main()
