"""Sampling features over HTTP (the official ``openai`` client where it applies): logprobs on
both endpoints, echo with prompt logprobs, n > 1, penalties, min_tokens, streamed usage.

Values are checked against the oracle (``reference_forward``) of an in-process model built from
the same preset (same seed, same weights) as the server's: fp32 on the CPU, within 1e-4.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from atom import LLM, SamplingParams
from atom.models.deepseek_v41.reference import reference_forward
from atom.serve.protocol import ChatMessage, render_chat
from atom.tokenizer import ByteTokenizer

MODEL = "v41-tiny"
TOL = 1e-4
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def local():
    """The server's model in this process (the same preset and dtype: the same weights)."""
    return LLM(
        "v41-tiny",
        block_size=16,
        num_blocks=64,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        dtype="float32",
        kv_dtype="fp32",
        index_dtype="fp32",
        device="cpu",
    )


def oracle(local, ids: list[int]) -> torch.Tensor:
    """log-softmax of the full-recompute logits at every position of ``ids``."""
    return torch.log_softmax(reference_forward(local.engine.runtime.model, ids).float(), -1)


def greedy_ids(local, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(reference_forward(local.engine.runtime.model, ids)[-1].argmax()))
    return ids[len(prompt) :]


def post(served, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{served.url}{path}", json={"model": MODEL, **body}, timeout=120)


def sse(served, path: str, body: dict) -> list[dict]:
    r = post(served, path, {**body, "stream": True})
    assert r.status_code == 200, r.text
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ---- logprobs ---------------------------------------------------------------------------


def test_completion_logprobs_match_the_oracle(client, local):
    prompt = TOK.encode("Logprobs of a completion, please: ")
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    gen = greedy_ids(local, prompt, 4)
    want = oracle(local, prompt + gen[:-1])[len(prompt) - 1 :]
    assert lp.tokens == [TOK.decode([t]) for t in gen]
    assert lp.token_logprobs == pytest.approx(
        [float(want[k, t]) for k, t in enumerate(gen)], abs=TOL
    )
    for k, top in enumerate(lp.top_logprobs):
        assert len(top) <= 4  # 3 alternatives and the chosen token
        assert max(top.values()) == pytest.approx(float(want[k].max()), abs=TOL)
        assert top[lp.tokens[k]] == pytest.approx(lp.token_logprobs[k], abs=TOL)
    offsets = [0]
    for t in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp.text_offset == offsets


def test_chat_logprobs_match_the_oracle_streaming_and_not(served, client, local):
    msgs = [{"role": "user", "content": "chat logprobs"}]
    prompt = TOK.encode(render_chat([ChatMessage(**m) for m in msgs]))
    kw = dict(model=MODEL, messages=msgs, max_tokens=4, temperature=0, logprobs=True)
    r = client.chat.completions.create(top_logprobs=2, extra_body={"ignore_eos": True}, **kw)
    content = r.choices[0].logprobs.content
    gen = greedy_ids(local, prompt, 4)
    want = oracle(local, prompt + gen[:-1])[len(prompt) - 1 :]
    assert [c.bytes for c in content] == [[t] if t < 256 else [] for t in gen]
    assert [c.token for c in content] == [TOK.decode([t]) for t in gen]
    for k, c in enumerate(content):
        assert c.logprob == pytest.approx(float(want[k, gen[k]]), abs=TOL)
        values = [x.logprob for x in c.top_logprobs]
        assert values == pytest.approx(torch.topk(want[k], 2).values.tolist(), abs=TOL)
    stream = client.chat.completions.create(
        top_logprobs=2, stream=True, extra_body={"ignore_eos": True}, **kw
    )
    streamed = [
        x
        for ch in stream
        if ch.choices and ch.choices[0].logprobs
        for x in ch.choices[0].logprobs.content
    ]
    assert [(x.token, x.bytes) for x in streamed] == [(x.token, x.bytes) for x in content]
    assert [x.logprob for x in streamed] == pytest.approx([x.logprob for x in content], abs=TOL)
    # logprobs without top_logprobs: no alternatives; top_logprobs needs logprobs
    plain = post(served, "/v1/chat/completions", dict(messages=msgs, max_tokens=1, logprobs=True))
    assert plain.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []
    assert (
        post(served, "/v1/chat/completions", dict(messages=msgs, max_tokens=1)).json()["choices"][
            0
        ]["logprobs"]
        is None
    )


def test_echo_with_prompt_logprobs_computes_the_prompt(served, client, local):
    text = "Likelihood of this whole prompt, token by token."
    prompt = TOK.encode(text)
    client.completions.create(model=MODEL, prompt=text, max_tokens=1)  # now it is cached
    again = client.completions.create(model=MODEL, prompt=text, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens > 0, "not cached: proves nothing"
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=1)
    choice = r.choices[0]
    assert choice.text == text and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(prompt)
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # computed, not taken from cache
    lp = choice.logprobs
    want = oracle(local, prompt)
    assert lp.tokens == list(text)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(
        [float(want[j - 1, prompt[j]]) for j in range(1, len(prompt))], abs=TOL
    )
    for j in range(1, len(prompt)):
        assert max(lp.top_logprobs[j].values()) == pytest.approx(float(want[j - 1].max()), abs=TOL)
    assert lp.text_offset == list(range(len(text)))
    # echo with generation: the prompt's entries, then the generated tokens'
    both = client.completions.create(
        model=MODEL, prompt=text, max_tokens=3, echo=True, logprobs=0, temperature=0
    ).choices[0]
    assert both.text.startswith(text) and len(both.logprobs.tokens) == len(prompt) + 3
    assert both.logprobs.token_logprobs[: len(prompt)] == pytest.approx(lp.token_logprobs, abs=TOL)
    # streamed: the first chunk carries the prompt and its logprobs
    chunks = sse(served, "/v1/completions", dict(prompt=text, max_tokens=0, echo=True, logprobs=1))
    assert chunks[0]["choices"][0]["text"] == text
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(
        lp.token_logprobs[1:], abs=TOL
    )
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text


def test_echo_without_logprobs_and_max_tokens_zero_rules(served):
    r = post(served, "/v1/completions", dict(prompt="echo me", max_tokens=2, echo=True))
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("echo me")
    assert r.json()["choices"][0]["logprobs"] is None
    r = post(served, "/v1/completions", dict(prompt="no echo", max_tokens=0))
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


# ---- n ------------------------------------------------------------------------------------


def test_n_choices_greedy_equal_seeded_differ_and_repeat(client):
    prompt = "n samples of one prompt"
    g = client.completions.create(
        model=MODEL,
        prompt=prompt,
        n=3,
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in g.choices] == [0, 1, 2]
    assert len({c.text for c in g.choices}) == 1
    assert g.usage.prompt_tokens == len(prompt)  # counted once
    assert g.usage.completion_tokens == 15
    kw = dict(model=MODEL, prompt=prompt, n=4, max_tokens=8, temperature=1.0, seed=3)
    a = client.completions.create(extra_body={"ignore_eos": True}, **kw)
    b = client.completions.create(extra_body={"ignore_eos": True}, **kw)
    texts = [c.text for c in a.choices]
    assert texts == [c.text for c in b.choices]
    assert len(set(texts)) > 1, "seeded choices should differ"
    # choice 0 of n is the n=1 request with the same seed
    one = client.completions.create(extra_body={"ignore_eos": True}, **{**kw, "n": 1})
    assert one.choices[0].text == texts[0]


def test_n_choices_streamed_and_chat(served, client):
    body = dict(prompt="streamed n", n=2, max_tokens=6, temperature=1.0, seed=9, ignore_eos=True)
    whole = post(served, "/v1/completions", body).json()
    chunks = sse(served, "/v1/completions", body)
    texts = ["", ""]
    reasons = [None, None]
    for c in chunks:
        for ch in c["choices"]:
            texts[ch["index"]] += ch["text"]
            reasons[ch["index"]] = ch["finish_reason"] or reasons[ch["index"]]
    assert texts == [c["text"] for c in whole["choices"]] and reasons == ["length", "length"]
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "two answers"}],
        n=2,
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content
    assert r.usage.completion_tokens == 8


# ---- penalties and min_tokens ---------------------------------------------------------------


@pytest.mark.parametrize(
    "pen",
    [
        dict(repetition_penalty=1.8),
        dict(frequency_penalty=1.5, presence_penalty=0.5),
    ],
)
def test_penalties_reach_the_engine(served, local, pen):
    """The server's greedy output with penalties is the in-process engine's, and differs from
    the output without them."""
    prompt = TOK.encode("abcabcabcabc repeated repeated repeated")
    body = dict(prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True)
    plain = post(served, "/v1/completions", body).json()["choices"][0]["text"]
    got = post(served, "/v1/completions", {**body, **pen}).json()["choices"][0]["text"]
    params = SamplingParams(max_tokens=8, ignore_eos=True, **pen)
    want = TOK.decode(local.generate([prompt], params)[0].token_ids)
    assert got == want
    assert got != plain


def test_seeded_penalized_sampling_is_reproducible(client):
    kw = dict(
        model=MODEL,
        prompt="reproducible with penalties",
        max_tokens=8,
        temperature=1.0,
        seed=21,
        presence_penalty=0.8,
        frequency_penalty=0.4,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.2},
    )
    assert (
        client.completions.create(**kw).choices[0].text
        == client.completions.create(**kw).choices[0].text
    )


def test_min_tokens_suppresses_stop_token_ids(served, local):
    prompt = TOK.encode("min tokens")
    first = greedy_ids(local, prompt, 1)[0]
    body = dict(prompt=prompt, max_tokens=6, temperature=0, stop_token_ids=[first])
    r = post(served, "/v1/completions", body).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 1
    r = post(served, "/v1/completions", {**body, "min_tokens": 3, "logprobs": 0}).json()
    assert r["usage"]["completion_tokens"] >= 3
    params = SamplingParams(max_tokens=6, min_tokens=3, stop_token_ids=(first,))
    out = local.generate([prompt], params)[0]
    assert r["choices"][0]["text"] == TOK.decode(out.token_ids)
    assert first not in out.token_ids[:3]


@pytest.mark.parametrize(
    "path, body, field, needle",
    [
        ("/v1/completions", dict(presence_penalty=2.5), "presence_penalty", "[-2, 2]"),
        ("/v1/completions", dict(frequency_penalty=-3), "frequency_penalty", "[-2, 2]"),
        ("/v1/completions", dict(repetition_penalty=0), "repetition_penalty", "> 0"),
        ("/v1/completions", dict(repetition_penalty=-1.5), "repetition_penalty", "got -1.5"),
        ("/v1/completions", dict(min_tokens=-1), "min_tokens", ">= 0"),
        ("/v1/completions", dict(min_tokens=9, max_tokens=4), "min_tokens", "max_tokens (4)"),
        ("/v1/completions", dict(n=0), "n", "[1, 128]"),
        ("/v1/completions", dict(logprobs=21), "logprobs", "[0, 20]"),
        ("/v1/completions", dict(logprobs=-1), "logprobs", "[0, 20]"),
        ("/v1/chat/completions", dict(logprobs=True, top_logprobs=21), "top_logprobs", "[0, 20]"),
        ("/v1/chat/completions", dict(top_logprobs=2), "top_logprobs", "logprobs=true"),
        ("/v1/chat/completions", dict(presence_penalty=9), "presence_penalty", "[-2, 2]"),
        ("/v1/chat/completions", dict(max_tokens=0), "max_tokens", "got 0"),
    ],
)
def test_bad_sampling_values_are_clear_400s(served, path, body, field, needle):
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "x"}], **body}
    else:
        body = {"prompt": "x", **body}
    r = post(served, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and needle in err["message"], err


# ---- streamed usage ---------------------------------------------------------------------


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats(served, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    what = {"messages": [{"role": "user", "content": "usage"}]} if chat else {"prompt": "usage"}
    body = dict(what, max_tokens=5, ignore_eos=True)
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = sse(served, path, {**body, "stream_options": opts})
    assert all("usage" in c for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 5
    assert chunks[-1]["choices"] == []  # include_usage: the final usage-only chunk
    prompt_tokens = {c["usage"]["prompt_tokens"] for c in chunks}
    assert len(prompt_tokens) == 1
    for c in chunks:
        u = c["usage"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    # continuous alone: usage in every chunk, no usage-only chunk
    alone = sse(served, path, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" in c and c["choices"] for c in alone)
    # neither: no usage anywhere
    none = sse(served, path, body)
    assert not any("usage" in c for c in none)
