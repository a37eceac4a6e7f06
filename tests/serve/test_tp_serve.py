"""``atom.serve --tensor-parallel-size 2`` (CPU, gloo): completions equal one rank's greedy
tokens, and SIGTERM stops the server and every rank."""

from __future__ import annotations

import os
import time

import httpx

from atom import LLM, SamplingParams
from tests.distributed.test_tp_engine import alive

from .conftest import ServeProcess


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().split(")")[-1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_tp2_serves_one_ranks_tokens_and_sigterm_stops_every_rank():
    proc = ServeProcess("--tensor-parallel-size", "2")
    try:
        proc.wait_ready()
        kids = children(proc.proc.pid)  # the rank, and multiprocessing's resource tracker
        ranks = [pid for pid in kids if "spawn_main" in cmdline(pid)]
        assert len(ranks) == 1, [cmdline(pid) for pid in kids]
        prompt = list(range(30, 52))
        body = dict(model="v41-tiny", prompt=prompt, max_tokens=8, temperature=0)
        r = httpx.post(f"{proc.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        one = LLM("v41-tiny", block_size=16, num_blocks=400, dtype="float32", kv_dtype="fp32",
                  index_dtype="fp32", device="cpu")  # fmt: skip
        want = one.generate([prompt], SamplingParams(max_tokens=8))[0].text
        assert r.json()["choices"][0]["text"] == want
    finally:
        code = proc.terminate()
    assert code == 0, proc.text()
    # the rank is joined by the server's shutdown (or, if that overran its budget, exits on
    # its parent-watch); the resource tracker exits on EOF from the server's end, just after
    deadline = time.monotonic() + 15
    while any(alive(pid) for pid in kids) and time.monotonic() < deadline:
        time.sleep(0.05)  # allowed: polling other processes' exit, bounded
    assert not [cmdline(pid) for pid in kids if alive(pid)], "a child outlived the server"
