"""Several atom.serve replicas on one machine sharing their prefix tier through Redis.

    .venv/bin/python scripts/replicas.py [--replicas 2] [--groups 4] [--rounds 3]

Starts a redis-server (no persistence, a temporary directory, a free port) and N replicas of
``python -m atom.serve`` (v41-tiny, block 16, CPU), each with its own LMCache server whose L2 is
that Redis (``--lmcache-l2-adapter '{"type": "resp", ...}'``). Then it sends a shared-prefix
workload round-robin: ``--groups`` system prompts, each followed by distinct user suffixes, so
every request after the first of its group can reuse a prefix that some replica computed,
usually another one. Each response's usage.prompt_tokens_details says where its prompt came
from: hbm (the replica's own pool), tier (LMCache: its L1, or Redis through L2) or computed.
At the end it prints each replica's split and LMCache's L2 counters from its /metrics, and
stops everything it started. Needs redis-server on PATH (Debian: apt-get install redis-server).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from atom.tier.server.lmcache_server import free_port  # noqa: E402  (below ephemeral)


def wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


def http(url: str, body: dict | None = None, timeout: float = 120.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text = r.read().decode()
    return (
        json.loads(text)
        if r.headers.get("content-type", "").startswith("application/json")
        else text
    )


def healthy(port: int) -> bool:
    try:
        return http(f"http://127.0.0.1:{port}/health", timeout=2)["status"] == "ok"
    except Exception:
        return False


def metric(text: str, name: str) -> float:
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--groups", type=int, default=4, help="distinct shared prefixes")
    ap.add_argument("--rounds", type=int, default=3, help="requests per prefix")
    ap.add_argument("--prefix-tokens", type=int, default=160)
    ap.add_argument("--suffix-tokens", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    redis_bin = shutil.which("redis-server")
    if redis_bin is None:
        raise SystemExit("redis-server not found (Debian: apt-get install redis-server)")
    work = Path(tempfile.mkdtemp(prefix="atom-replicas-"))
    procs: list[subprocess.Popen] = []
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false", PYTHONUNBUFFERED="1")
    try:
        redis_port = free_port()
        procs.append(
            subprocess.Popen(
                [redis_bin, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(work)],
                stdout=open(work / "redis.log", "wb"), stderr=subprocess.STDOUT,
            )
        )  # fmt: skip
        adapter = json.dumps({"type": "resp", "host": "127.0.0.1", "port": redis_port})
        ports = [free_port() for _ in range(args.replicas)]
        for i, port in enumerate(ports):
            cmd = [
                sys.executable, "-m", "atom.serve", "--model", "v41-tiny", "--block-size", "16",
                "--num-blocks", "400", "--max-num-batched-tokens", "64", "--max-num-seqs", "4",
                "--device", "cpu", "--dtype", "float32", "--kv-dtype", "fp32",
                "--index-dtype", "fp32", "--port", str(port), "--offload", "lmcache_mp",
                "--lmcache-l1-gb", "0.25", "--lmcache-l2-adapter", adapter,
                "--disable-log-requests",
            ]  # fmt: skip
            log = open(work / f"replica{i}.log", "wb")
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log))
            print(f"replica {i}: http://127.0.0.1:{port} (log {work}/replica{i}.log)")
        for port in ports:
            wait_for(lambda p=port: healthy(p), 180, f"replica on port {port}")
        print(f"redis on port {redis_port}; {args.replicas} replicas healthy\n")

        rng = random.Random(0)
        prefixes = [
            [rng.randrange(256) for _ in range(args.prefix_tokens)] for _ in range(args.groups)
        ]
        split = {p: {"requests": 0, "hbm": 0, "tier": 0, "computed": 0} for p in ports}
        for r in range(args.rounds):
            for g, prefix in enumerate(prefixes):
                port = ports[(g + r) % len(ports)]  # a prefix moves to another replica each round
                suffix = [rng.randrange(256) for _ in range(args.suffix_tokens)]
                out = http(
                    f"http://127.0.0.1:{port}/v1/completions",
                    {"model": "v41-tiny", "prompt": prefix + suffix,
                     "max_tokens": args.max_tokens, "temperature": 0},
                )  # fmt: skip
                d = out["usage"]["prompt_tokens_details"]
                s = split[port]
                s["requests"] += 1
                s["hbm"] += d["hbm_tokens"]
                s["tier"] += d["tier_tokens"]
                s["computed"] += d["computed_tokens"]
                print(
                    f"round {r} prefix {g} -> replica :{port}: hbm {d['hbm_tokens']:4d} "
                    f"tier {d['tier_tokens']:4d} computed {d['computed_tokens']:4d}"
                )
            time.sleep(0.5)  # let the round's saves reach L1 and Redis before the next
        print("\nper replica (prompt tokens):")
        for i, port in enumerate(ports):
            s = split[port]
            text = http(f"http://127.0.0.1:{port}/metrics")
            l2_hits = metric(text, "atom_tier_l2_lookup_hit_tokens_total")
            l2_loaded = metric(text, "atom_tier_l2_prefetch_loaded_objects_total")
            l2_stored = metric(text, "atom_tier_l2_store_completed_objects_total")
            print(
                f"  replica {i} :{port}: {s['requests']} requests, hbm {s['hbm']}, tier "
                f"{s['tier']}, computed {s['computed']} | LMCache: {l2_hits:.0f} lookup tokens "
                f"hit in L2, {l2_loaded:.0f} objects prefetched from L2, {l2_stored:.0f} stored"
            )
        keys = subprocess.run(
            ["redis-cli", "-p", str(redis_port), "dbsize"], capture_output=True, text=True
        ).stdout.strip()
        print(f"  redis holds {keys} objects")
        return 0
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
