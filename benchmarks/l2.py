"""Cross-replica reuse through LMCache's L2, against the single-engine ceiling, and the load
latency L2 adds.

    python -m benchmarks.l2 [--adapters fs resp] [--repeats 3] [--prompts 8]

Per adapter and repeat, with fresh prompts: engine A (its own owned LMCache server, L2 under
it) runs pass 1 and its saves drain to L2; a fresh engine on A's server replays the prompts
(the single-engine ceiling: every load from L1); then A stops (its server with it) and engine
B, with its own server on the same L2, replays them (every load from L2). Reported: B's tier
tokens as a share of the ceiling, and per lookup and per load the latency measured by the
engine (submit to answer / to a terminal transfer): through L1 and through L2. A lookup that
L1 misses answers only once LMCache has prefetched the L2 objects into L1, so L2's cost shows
up in the lookup; the load itself then reads L1. Medians per repeat; spread = min..max over
repeats. v41-tiny, block 16, fp32 on CPU.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from benchmarks.common import md_table, write_results

ENGINE_KW = dict(
    block_size=16,
    num_blocks=600,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    dtype="float32",
    kv_dtype="fp32",
    index_dtype="fp32",
    device="cpu",
)


def wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def drained(llm) -> None:
    tier = llm.engine.tier
    wait(lambda: tier.connector.live_ops == 0, 60, "saves")
    tier.server_metrics.ttl_s = 0.0

    def flushed():
        t = tier.server_metrics.totals()
        done = t.get("lmcache_mp_l2_store_completed_objects_chunks_total", 0)
        return done > 0 and done == t.get("lmcache_mp_l2_store_submitted_objects_chunks_total")

    wait(flushed, 60, "L2 stores")


def latencies(llm) -> tuple[list[float], list[float]]:
    m = llm.engine.tier.connector.tier_metrics
    return m.lookup_latency.samples(), m.latency.samples(op="load")


def one_repeat(adapter: dict, prompts, params) -> dict:
    from atom import LLM

    tier = dict(offload="lmcache_mp", lmcache={"l1_size_gb": 0.25, "l2_adapters": [adapter]})
    a = LLM("v41-tiny", **ENGINE_KW, **tier)
    out_a = a.generate(prompts, params)
    drained(a)
    solo = LLM("v41-tiny", **ENGINE_KW, offload="lmcache_mp", lmcache={"url": a.engine.tier.url})
    out_solo = solo.generate(prompts, params)
    l1_lookup, l1_load = latencies(solo)
    solo.shutdown()
    a.shutdown()
    b = LLM("v41-tiny", **ENGINE_KW, **tier)
    t0 = time.perf_counter()
    out_b = b.generate(prompts, params)
    b_s = time.perf_counter() - t0
    l2_lookup, l2_load = latencies(b)
    b.shutdown()
    assert [o.token_ids for o in out_b] == [o.token_ids for o in out_a], "outputs differ"
    ceiling = sum(o.tier_hit_tokens for o in out_solo)
    got = sum(o.tier_hit_tokens for o in out_b)
    return {
        "prompt_tokens": sum(len(p) for p in prompts),
        "ceiling_tokens": ceiling,
        "l2_tokens": got,
        "reuse": got / ceiling if ceiling else 0.0,
        "l1_lookup_ms": 1e3 * statistics.median(l1_lookup),
        "l2_lookup_ms": 1e3 * statistics.median(l2_lookup),
        "l1_load_ms": 1e3 * statistics.median(l1_load),
        "l2_load_ms": 1e3 * statistics.median(l2_load),
        "b_pass_s": b_s,
    }


def spread(rows: list[dict], key: str, fmt: str = "{:.1f}") -> str:
    vals = [r[key] for r in rows]
    return (
        f"{fmt.format(statistics.median(vals))} ({fmt.format(min(vals))}..{fmt.format(max(vals))})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--adapters", nargs="+", default=["fs", "resp"], choices=["fs", "resp"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--name", default="l2_cpu")
    args = ap.parse_args()
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    torch.set_num_threads(1)
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
    from atom import SamplingParams
    from tests.offload.l2_fixtures import RedisServer

    params = SamplingParams(max_tokens=4, ignore_eos=True)
    results: dict[str, list[dict]] = {}
    for kind in args.adapters:
        results[kind] = []
        for r in range(args.repeats):
            g = torch.Generator().manual_seed(100 + r)
            lengths = torch.randint(64, 200, (args.prompts,), generator=g).tolist()
            prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
            redis, path = None, None
            try:
                if kind == "resp":
                    redis = RedisServer().start()
                    adapter = {"type": "resp", "host": "127.0.0.1", "port": redis.port}
                else:
                    path = tempfile.mkdtemp(prefix="atom-l2-bench-")
                    adapter = {"type": "fs", "base_path": path}
                row = one_repeat(adapter, prompts, params)
            finally:
                if redis is not None:
                    redis.stop()
                if path is not None:
                    shutil.rmtree(path, ignore_errors=True)
            results[kind].append(row)
            print(kind, r, {k: round(v, 3) for k, v in row.items()}, flush=True)
    table = md_table(
        [
            "L2",
            "repeats",
            "B tier tokens / single-engine ceiling",
            "reuse",
            "lookup ms: L1",
            "lookup ms: L2",
            "load ms: L1",
            "load ms: L2",
        ],
        [
            [
                kind,
                len(rows),
                f"{sum(r['l2_tokens'] for r in rows)} / {sum(r['ceiling_tokens'] for r in rows)}",
                spread(rows, "reuse", "{:.3f}"),
                spread(rows, "l1_lookup_ms"),
                spread(rows, "l2_lookup_ms"),
                spread(rows, "l1_load_ms"),
                spread(rows, "l2_load_ms"),
            ]
            for kind, rows in results.items()
        ],
    )
    note = (
        "\n\nMedian per repeat, then median (min..max) over repeats. A lookup that L1 misses "
        "answers once LMCache has prefetched the objects from L2 into L1: the L2 cost is the "
        "lookup column's difference; loads read L1 in both cases."
    )
    command = "python -m benchmarks.l2 " + " ".join(sys.argv[1:])
    path = write_results(args.name, {"results": results}, table + note, command.strip())
    print(table + note)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
