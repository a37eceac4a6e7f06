"""The OpenAI-compatible server, driven by the official ``openai`` client."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

MODEL = "v41-tiny"


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


def complete(client, prompt, n=8, **kw):
    return client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=n,
        temperature=0,
        extra_body={"ignore_eos": True},
        **kw,
    )


def test_completion_with_usage(client):
    r = complete(client, "The quick brown fox")
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(b"The quick brown fox")
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_streaming_equals_non_streaming(client):
    whole = complete(client, "streaming test prompt").choices[0].text
    chunks = list(
        complete(
            client, "streaming test prompt", stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length"


def test_chat_streaming_and_not(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 6
    stream = client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=6,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == r.choices[0].message.content


def test_concurrent_requests_match_sequential(client):
    prompts = [f"request number {i} with a shared prefix " * 3 for i in range(8)]
    sequential = [complete(client, p).choices[0].text for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(lambda p: complete(client, p).choices[0].text, prompts))
    assert concurrent == sequential


def test_models_health_metrics(served, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(f"{served.url}/health").json()
    assert health["status"] == "ok"
    assert health["tier"]["attached"] and health["tier"]["healthy"]
    metrics = httpx.get(f"{served.url}/metrics").text
    for name in (
        "atom_requests_total",
        "atom_prompt_tokens_total",
        "atom_tier_saves_total",
        "atom_tier_transfer_seconds_bucket",
        "atom_checkpoint_images_ready",
        "atom_requests_waiting",
        "atom_tier_healthy 1",
    ):
        assert name in metrics


@pytest.mark.parametrize(
    "body, needle",
    [
        ('{"model": "v41-tiny", "prompt": "x",', "malformed JSON"),
        (json.dumps({"model": "v41-tiny", "prompt": "x", "bogus": 1}), "bogus: unknown field"),
        (json.dumps({"model": "v41-tiny", "prompt": "x", "max_tokens": 0}), "max_tokens"),
        (json.dumps({"model": "v41-tiny", "prompt": "x", "max_tokens": -3}), "max_tokens"),
        (json.dumps({"model": "v41-tiny", "prompt": "x" * 70000}), "this model allows at most"),
        (json.dumps({"model": "v41-tiny", "prompt": [1, 2, 99999]}), "token ids must be in"),
        (json.dumps({"model": "v41-tiny"}), "prompt"),
    ],
)
def test_bad_requests_get_400_and_the_engine_keeps_serving(served, client, body, needle):
    r = httpx.post(
        f"{served.url}/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    assert complete(client, "still serving", n=2).usage.completion_tokens == 2


def test_openai_client_sees_bad_request_error(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)


def test_optional_fields_sent_as_null_mean_their_defaults(client):
    """OpenAI's SDK and agent code send optional fields as null: each one means its default
    (the same tokens as leaving it out), on completions and chat."""
    base = dict(model=MODEL, prompt="null fields", max_tokens=6, seed=7)
    want = client.completions.create(**base).choices[0].text
    nulls = dict(temperature=None, top_p=None, n=None, presence_penalty=None, stream=None)
    nulls.update(frequency_penalty=None, echo=None, logprobs=None, stop=None, user=None)
    extra = dict(top_k=None, ignore_eos=None, stop_token_ids=None, repetition_penalty=None)
    extra.update(best_of=None, logit_bias=None, min_tokens=None)
    got = client.completions.create(**base, **nulls, extra_body=extra)
    assert got.choices[0].text == want
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, seed=3)
    want = client.chat.completions.create(**chat).choices[0].message.content
    got = client.chat.completions.create(
        **chat,
        temperature=None,
        top_p=None,
        n=None,
        logprobs=None,
        top_logprobs=None,
        tools=None,
        tool_choice=None,
        response_format=None,
        parallel_tool_calls=None,
        logit_bias=None,
    )
    assert got.choices[0].message.content == want


@pytest.mark.parametrize(
    "field, value",
    [
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("response_format", {"type": "json_object"}),
        ("logit_bias", {"5": 10}),
        ("best_of", 3),
    ],
)
def test_unsupported_openai_fields_are_refused_when_they_ask_for_something(client, field, value):
    body = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=f"{field}: got .*not supported"):
        client.chat.completions.create(**body, extra_body={field: value})
    # the value that asks for nothing passes
    inert = {"tools": [], "response_format": {"type": "text"}, "logit_bias": {}, "best_of": 1}
    assert client.chat.completions.create(**body, extra_body={field: inert[field]}).choices


@pytest.mark.parametrize("path", ["/health", "/metrics", "/v1/models", "/version"])
def test_head_answers_as_get_without_a_body(served, path):
    """Load balancers and benchmark clients probe with HEAD: the GET's status and headers."""
    get = httpx.get(f"{served.url}{path}")
    head = httpx.head(f"{served.url}{path}")
    assert head.status_code == get.status_code == 200
    assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]
    assert httpx.head(f"{served.url}/v1/completions").status_code == 405


def test_a_list_of_prompts_gets_one_choice_set_per_prompt_in_order(served, client):
    """OpenAI's batched prompts (lm-eval sends them): choice p * n + j is prompt p's j-th,
    each the tokens that prompt alone gets; usage sums the prompts; streaming carries the
    same choices by index; token-id prompts mix with strings as lists of lists."""
    prompts = ["first prompt", "a second, longer prompt", "third"]
    alone = [complete(client, p, n=5).choices[0].text for p in prompts]  # n: max_tokens here
    got = complete(client, prompts, n=5)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == alone
    one = complete(client, prompts[0], n=5).usage.prompt_tokens
    assert got.usage.prompt_tokens == sum(
        complete(client, p, n=1).usage.prompt_tokens for p in prompts
    )
    assert got.usage.prompt_tokens > one and got.usage.completion_tokens == 15
    twice = client.completions.create(
        model=MODEL, prompt=prompts[:2], max_tokens=4, n=2, temperature=0.8, seed=5
    )
    assert [c.index for c in twice.choices] == [0, 1, 2, 3]
    per_prompt = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=4, n=2, temperature=0.8, seed=5)
        for p in prompts[:2]
    ]
    assert [c.text for c in twice.choices] == [c.text for r in per_prompt for c in r.choices]
    stream = complete(client, prompts, n=5, stream=True)
    text = {i: "" for i in range(3)}
    for chunk in stream:
        for c in chunk.choices:
            text[c.index] += c.text
    assert [text[i] for i in range(3)] == alone
    echo = complete(client, prompts[:2], n=2, echo=True)
    assert [c.text[: len(p)] for c, p in zip(echo.choices, prompts[:2])] == prompts[:2]
    ids = complete(client, [[5, 6, 7], [8, 9]], n=3)
    assert [c.text for c in ids.choices] == [
        complete(client, [5, 6, 7], n=3).choices[0].text,
        complete(client, [8, 9], n=3).choices[0].text,
    ]


def test_an_empty_prompt_list_is_refused(served):
    r = httpx.post(f"{served.url}/v1/completions", json={"model": MODEL, "prompt": []})
    assert r.status_code == 400 and "empty list" in r.json()["error"]["message"]
