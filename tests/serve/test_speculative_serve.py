"""``atom.serve --speculative-tokens``: OpenAI completions with drafts equal the oracle's greedy
tokens and logprobs, n > 1 and seeded sampling work, and the metrics count the drafts."""

from __future__ import annotations

import httpx
import pytest
import torch

from atom import LLM
from atom.models.deepseek_v41.reference import reference_forward

from .conftest import _MODULE_SERVERS, ServeProcess

MODEL = "v41-tiny-draft"


@pytest.fixture(scope="module")
def spec_server():
    proc = ServeProcess("--model", MODEL, "--speculative-tokens", "3")
    _MODULE_SERVERS.append(proc)
    proc.wait_ready()
    yield proc
    _MODULE_SERVERS.remove(proc)
    assert proc.terminate() == 0, proc.text()


def test_greedy_logprobs_and_n_with_drafts(spec_server):
    model = LLM(MODEL, block_size=16, num_blocks=64, dtype="float32", kv_dtype="fp32",
                index_dtype="fp32", device="cpu").engine.runtime.model  # fmt: skip
    prompt = list(range(40, 61))
    body = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=2, n=2)
    r = httpx.post(f"{spec_server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2
    ids = list(prompt)
    for _ in range(12):
        ids.append(int(reference_forward(model, ids)[-1].argmax()))
    want = torch.log_softmax(reference_forward(model, ids[:-1]).float(), -1)
    for c in choices:
        lp = c["logprobs"]
        got = [int(t.removeprefix("token_id:")) if t.startswith("token_id:") else None
               for t in lp["tokens"]]  # fmt: skip
        n = len(lp["token_logprobs"])
        assert n == 12
        for i, value in enumerate(lp["token_logprobs"]):
            pos = len(prompt) - 1 + i
            assert abs(value - float(want[pos, ids[pos + 1]])) < 1e-4
        assert got == [None] * 12 or got == ids[len(prompt) :]
    seeded = dict(body, temperature=0.9, seed=7, n=1, logprobs=None)
    a = httpx.post(f"{spec_server.url}/v1/completions", json=seeded, timeout=120).json()
    b = httpx.post(f"{spec_server.url}/v1/completions", json=seeded, timeout=120).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    metrics = httpx.get(f"{spec_server.url}/metrics", timeout=10).text
    line = [x for x in metrics.splitlines() if x.startswith("atom_spec_draft_tokens_total")]
    assert line and float(line[0].split()[-1]) > 0, metrics[:2000]


def test_speculative_tokens_flag_is_validated():
    proc = ServeProcess("--speculative-tokens", "2", "--print-config")  # v41-tiny: no drafts
    assert proc.proc.wait(120) != 0
    assert "no draft layers" in proc.text()
