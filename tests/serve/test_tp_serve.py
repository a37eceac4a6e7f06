"""``atom.serve --tensor-parallel-size 2`` (CPU, gloo): completions equal one rank's greedy
tokens, and SIGTERM stops the server and every rank."""

from __future__ import annotations

import os

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


def test_tp2_serves_one_ranks_tokens_and_sigterm_stops_every_rank():
    proc = ServeProcess("--tensor-parallel-size", "2")
    try:
        proc.wait_ready()
        ranks = children(proc.proc.pid)
        assert ranks, "no rank process under the server"
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
    for pid in ranks:
        assert not alive(pid), f"rank pid {pid} outlived the server"
