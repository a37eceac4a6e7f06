"""Replicas behind a real router: round-robin vs cache-aware vs KV-event routing, all on one
shared Redis L2, against a single engine's ceiling on the same workload.

    python -m benchmarks.replicas_router --router-bin /tmp/router-venv/bin [--replicas 4]

Starts a redis-server and N ``atom.serve`` replicas (each with its own LMCache server whose L2
is that Redis, and ``--kv-events-endpoint``), then for each arm starts a router installed by
package name (``pip install vllm-router sglang-router``; the directory of their executables is
``--router-bin``), sends a multi-tenant workload through it (``--tenants`` shared prefixes,
``--tails`` distinct tails each, shuffled, ``--concurrency`` clients, streaming) and stops it.
Arms:

- ``single``: every request to one replica, no router: the single-engine ceiling of reuse.
- ``round_robin``: vllm-router ``--policy round_robin``: the shared L2 alone.
- ``sglang_cache_aware``: sglang-router ``--policy cache_aware`` (its approximate tree of the
  request text; no events).
- ``vllm_kv_aware``: vllm-router ``--policy kv_aware`` fed by every replica's KV events and
  replay socket (``--kv-event-source``): routing on what the replicas' pools hold.

Between arms every replica's pool and LMCache server are reset and Redis is flushed. Reported
per arm: req/s, TTFT p50 (client side, first streamed token), prompt tokens by source (hbm /
tier / computed, from usage.prompt_tokens_details), reused = hbm + tier against the ceiling,
hbm's share of reused, and requests per replica. v41-tiny (block 16) on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from atom.tier.server.lmcache_server import free_port
from benchmarks.common import command_line, md_table, write_results

ROOT = Path(__file__).resolve().parent.parent
ARMS = ("single", "round_robin", "sglang_cache_aware", "vllm_kv_aware")


def wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.2)


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def requests_served(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(
        float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("atom_requests_total")
    )


class Fleet:
    """Redis, the replicas (with their event endpoints) and the router of the current arm."""

    def __init__(self, args, work: Path):
        self.args, self.work = args, work
        self.procs: list[subprocess.Popen] = []
        self.env = dict(os.environ, LMCACHE_TRACK_USAGE="false", PYTHONUNBUFFERED="1",
                        OMP_NUM_THREADS="1")  # fmt: skip
        self.redis_port = free_port()
        self._spawn(
            [shutil.which("redis-server"), "--port", str(self.redis_port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", str(work)], "redis",
        )  # fmt: skip
        adapter = json.dumps({"type": "resp", "host": "127.0.0.1", "port": self.redis_port})
        self.ports, self.events, self.replays = [], [], []
        for i in range(args.replicas):
            port, ev, rp = free_port(), free_port(), free_port()
            self.ports.append(port)
            self.events.append(f"tcp://127.0.0.1:{ev}")
            self.replays.append(f"tcp://127.0.0.1:{rp}")
            self._spawn(
                [sys.executable, "-m", "atom.serve", "--model", args.model, "--block-size",
                 str(args.block_size), "--num-blocks", str(args.num_blocks),
                 "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                 "--max-num-seqs", "4", "--device", "cpu",
                 "--dtype", "float32", "--kv-dtype", "fp32", "--index-dtype", "fp32",
                 "--port", str(port), "--offload", "lmcache_mp", "--lmcache-l1-gb", "0.25",
                 "--lmcache-l2-adapter", adapter, "--disable-log-requests",
                 "--kv-events-endpoint", f"tcp://*:{ev}",
                 "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{rp}"], f"replica{i}",
            )  # fmt: skip
        for port in self.ports:
            wait_for(lambda p=port: answers(f"http://127.0.0.1:{p}/health"), 300, f":{port}")
        self.router: subprocess.Popen | None = None

    def _spawn(self, cmd: list[str], name: str) -> subprocess.Popen:
        log = open(self.work / f"{name}.log", "ab")
        p = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=log, stderr=log)
        self.procs.append(p)
        return p

    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def start_router(self, arm: str) -> str:
        """The router's base URL (or replica 0's for ``single``)."""
        if arm == "single":
            return self.urls()[0]
        port, bin_dir = free_port(), Path(self.args.router_bin)
        urls = self.urls()
        if arm == "sglang_cache_aware":
            cmd = [str(bin_dir / "python"), "-m", "sglang_router.launch_router", "--host",
                   "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
                   "--prometheus-port", str(free_port()), "--worker-urls", *urls]  # fmt: skip
        else:
            policy = "round_robin" if arm == "round_robin" else "kv_aware"
            cmd = [str(bin_dir / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
                   "--policy", policy, "--prometheus-port", str(free_port()),
                   "--worker-urls", *urls]  # fmt: skip
            if policy == "kv_aware":
                for url, ev, rp in zip(urls, self.events, self.replays):
                    cmd += ["--kv-event-source", f"{url}={ev}",
                            "--kv-event-replay-source", f"{url}={rp}"]  # fmt: skip
                cmd += ["--kv-event-block-size", str(self.args.block_size),
                        "--kv-event-model", self.args.model]  # fmt: skip
        self.router = self._spawn(cmd, arm)
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: answers(f"{base}/v1/models"), 120, f"router {arm}")
        return base

    def stop_router(self) -> None:
        if self.router is not None:
            self.router.send_signal(signal.SIGTERM)
            self.router.wait(30)
            self.router = None

    def reset(self) -> None:
        """Empty every pool and LMCache server, and Redis."""
        for port in self.ports:
            r = httpx.post(f"http://127.0.0.1:{port}/reset_prefix_cache?tier=true", timeout=60)
            r.raise_for_status()
        subprocess.run(["redis-cli", "-p", str(self.redis_port), "flushall"], check=True,
                       capture_output=True)  # fmt: skip

    def stop(self) -> None:
        self.stop_router()
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


def workload(args) -> list[str]:
    """Shuffled prompts: ``tenants`` shared prefixes, each with ``tails`` distinct tails."""
    rng = random.Random(args.seed)
    letters = "abcdefghijklmnopqrstuvwxyz      "

    def text(n: int) -> str:
        return "".join(rng.choice(letters) for _ in range(n))

    prefixes = [text(args.prefix_tokens) for _ in range(args.tenants)]
    prompts = [p + text(args.tail_tokens) for p in prefixes for _ in range(args.tails)]
    rng.shuffle(prompts)
    return prompts


def one_request(base: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    ttft, usage = None, None
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    if usage is None:
        raise RuntimeError(f"no usage in the stream from {base}")
    d = usage["prompt_tokens_details"]
    return {"ttft_s": ttft if ttft is not None else time.perf_counter() - t0,
            "prompt": usage["prompt_tokens"], "hbm": d["hbm_tokens"], "tier": d["tier_tokens"],
            "computed": d["computed_tokens"]}  # fmt: skip


def run_arm(fleet: Fleet, arm: str, prompts: list[str], args) -> dict:
    fleet.reset()
    before = [requests_served(p) for p in fleet.ports]
    base = fleet.start_router(arm)
    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            rows = list(
                pool.map(lambda p: one_request(base, args.model, p, args.max_tokens), prompts)
            )
        wall = time.perf_counter() - t0
    finally:
        fleet.stop_router()
    after = [requests_served(p) for p in fleet.ports]
    out = {k: sum(r[k] for r in rows) for k in ("prompt", "hbm", "tier", "computed")}
    out.update(
        arm=arm, requests=len(rows), wall_s=round(wall, 2), req_per_s=round(len(rows) / wall, 3),
        ttft_p50_ms=round(1000 * statistics.median(r["ttft_s"] for r in rows), 1),
        per_replica=[int(a - b) for a, b in zip(after, before)],
    )  # fmt: skip
    out["reused"] = out["hbm"] + out["tier"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--router-bin", required=True, help="directory with vllm-router, python")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--model", default="v41-tiny")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=160, help="per replica: a small pool")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--tails", type=int, default=8, help="requests per tenant")
    ap.add_argument("--prefix-tokens", type=int, default=512)
    ap.add_argument("--tail-tokens", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--name", default="replicas_router_cpu")
    args = ap.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server not found (Debian: apt-get install redis-server)")
    work = Path(tempfile.mkdtemp(prefix="atom-router-"))
    prompts = workload(args)
    fleet = Fleet(args, work)
    results = []
    try:
        for arm in args.arms:
            res = run_arm(fleet, arm, prompts, args)
            print(json.dumps(res), flush=True)
            results.append(res)
    finally:
        fleet.stop()
    ceiling = next((r["reused"] for r in results if r["arm"] == "single"), None)
    rows = []
    for r in results:
        share = f"{r['reused'] / ceiling:.1%}" if ceiling else "-"
        hbm = f"{r['hbm'] / r['reused']:.1%}" if r["reused"] else "-"
        r["reused_vs_ceiling"] = round(r["reused"] / ceiling, 4) if ceiling else None
        r["hbm_share_of_reused"] = round(r["hbm"] / r["reused"], 4) if r["reused"] else None
        rows.append([r["arm"], r["requests"], r["req_per_s"], r["ttft_p50_ms"], r["prompt"],
                     r["hbm"], r["tier"], r["computed"], share, hbm,
                     " / ".join(map(str, r["per_replica"]))])  # fmt: skip
    table = md_table(
        ["arm", "requests", "req/s", "TTFT p50 ms", "prompt tok", "hbm", "tier", "computed",
         "reused / ceiling", "hbm / reused", "requests per replica"], rows,
    )  # fmt: skip
    versions = {
        name: subprocess.run(
            [str(Path(args.router_bin) / "pip"), "show", name], capture_output=True, text=True
        )
        .stdout.split("Version: ")[-1]
        .split("\n")[0]
        for name in ("vllm-router", "sglang-router")
    }
    path = write_results(
        args.name, {"routers": versions, "results": results},
        table + f"\n\nRouters: {versions}.\n", command_line("replicas_router", args),
    )  # fmt: skip
    print(table)
    print(f"wrote {path}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
