"""atom.serve at its edges (issue #19): every bad request is a 4xx in OpenAI's error JSON that
names the field, the value and what is allowed; the connection and the engine keep serving;
every response is counted; disconnected clients stop generating; vLLM's extra endpoints."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

MODEL = "v41-tiny"


def post(served, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return httpx.post(f"{served.url}{path}", content=content, headers=headers, timeout=60, **kw)


def assert_error(r: httpx.Response, status: int, *needles: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == status
    for needle in needles:
        assert needle in err["message"], (needle, err)
    return err


def metric(served, line_start: str) -> float:
    for line in httpx.get(f"{served.url}/metrics").text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_for(cond, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)  # allowed: polling interval of a bounded loop
    raise AssertionError(f"timed out waiting for {what}")


def base(**kw) -> dict:
    return {"model": MODEL, "prompt": "x", "max_tokens": 2, **kw}


BAD_COMPLETIONS = [
    ('{"model": "v41-tiny", "prompt": "x", "temperature": -1}', "temperature", "-1", ">= 0"),
    ('{"model": "v41-tiny", "prompt": "x", "temperature": NaN}', "temperature", "nan", ">= 0"),
    ('{"model": "v41-tiny", "prompt": "x", "temperature": Infinity}', "temperature", "inf"),
    ('{"model": "v41-tiny", "prompt": "x", "top_p": 0}', "top_p", "0", "<= 1"),
    ('{"model": "v41-tiny", "prompt": "x", "top_p": 1.5}', "top_p", "1.5", "<= 1"),
    ('{"model": "v41-tiny", "prompt": "x", "top_p": NaN}', "top_p", "nan"),
    ('{"model": "v41-tiny", "prompt": "x", "top_k": -1}', "top_k", "-1", ">= 0"),
    ('{"model": "v41-tiny", "prompt": "x", "seed": 1e400}', "seed"),
    ('{"model": "v41-tiny", "prompt": "x", "seed": 99999999999999999999999}', "seed", "2**64"),
    ('{"model": "v41-tiny", "prompt": "x", "stop_token_ids": [-5]}', "stop_token_ids", "-5"),
    ('{"model": "v41-tiny", "prompt": "x", "temperature": "hot"}', "temperature", "'hot'"),
    ('{"model": "v41-tiny", "prompt": "\\ud800"}', "prompt", "surrogate", "\\ud800"),
    ('{"model": "v41-tiny", "prompt": ["\\udfff"]}', "prompt", "surrogate"),
    ('{"model": "v41-tiny", "prompt": "x", "stop": ""}', "stop", "''"),
    ('{"model": "v41-tiny", "prompt": "x", "stop": ["a", ""]}', "stop", "''"),
    ('{"model": "v41-tiny", "prompt": "x", "stop": "\\ud800"}', "stop", "surrogate"),
    ('{"model": "v41-tiny", "prompt": "x", "stream_options": {"include_usage": true}}',
     "stream_options", "stream=true"),
    ('{"model": "v41-tiny", "prompt": "x", "bogus": 1}', "bogus", "unknown field"),
    ('{"model": "v41-tiny", "prompt": "x",', "malformed JSON"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    (b'{"model": "v41-tiny", "prompt": "\xff\xfe"}', "UTF-8"),
]  # fmt: skip


@pytest.mark.parametrize("case", BAD_COMPLETIONS, ids=lambda c: str(c[1])[:30])
def test_bad_values_are_400_in_error_shape_and_the_connection_survives(served, case):
    body, *needles = case
    with httpx.Client(base_url=served.url, timeout=60) as c:  # one keep-alive connection
        for _ in range(3):
            r = c.post(
                "/v1/completions", content=body, headers={"content-type": "application/json"}
            )
            err = assert_error(r, 400, *needles)
            assert err["type"] == "invalid_request_error"
            ok = c.post("/v1/completions", json=base(temperature=0))
            assert ok.status_code == 200, ok.text
    assert "Traceback" not in served.text()


def test_sampling_param_refusals_name_the_field(served):
    err = assert_error(post(served, "/v1/completions", base(top_p=1.5)), 400)
    assert err["param"] == "top_p"
    err = assert_error(post(served, "/v1/completions", base(stop="")), 400)
    assert err["param"] == "stop"


def test_every_response_is_counted_in_http_metrics(served):
    before = metric(served, 'atom_http_requests_total{path="/v1/completions",status="400"}')
    nf = metric(served, 'atom_http_requests_total{path="/v1/completions",status="404"}')
    for bad in (base(temperature=-1), base(prompt="\ud800"), base(top_k=-1)):
        assert post(served, "/v1/completions", bad).status_code == 400
    assert post(served, "/v1/completions", base(model="gpt-4")).status_code == 404
    after = metric(served, 'atom_http_requests_total{path="/v1/completions",status="400"}')
    assert after == before + 3
    assert metric(served, 'atom_http_requests_total{path="/v1/completions",status="404"}') == nf + 1
    assert httpx.get(f"{served.url}/no/such/path").status_code == 404
    assert metric(served, 'atom_http_requests_total{path="(unmatched)",status="404"}') >= 1


@pytest.mark.parametrize(
    "method, path, status, needle",
    [
        ("GET", "/v2/nothing", 404, "no such endpoint: GET /v2/nothing"),
        ("POST", "/health", 405, "method POST is not allowed on /health"),
        ("GET", "/v1/completions", 405, "allowed: POST"),
    ],
)
def test_404_and_405_in_error_shape(served, method, path, status, needle):
    assert_error(httpx.request(method, f"{served.url}{path}"), status, needle)


def test_unknown_model_is_404(served):
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    err = assert_error(post(served, "/v1/completions", base(model="gpt-4")), 404, "'gpt-4'")
    assert err["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert client.models.retrieve(MODEL).id == MODEL


CHAT = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize(
    "extra, needles",
    [
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "look"},
                            {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                        ],
                    }
                ]
            },
            ("messages.0.content", "'image_url'", "only text parts"),
        ),
        ({"messages": [{"role": "user", "content": ""}]}, ("messages.0.content", "empty")),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, ("surrogate",)),
        ({"stream_options": {"include_usage": True}}, ("stream_options", "stream=true")),
        (
            {"max_tokens": 3, "max_completion_tokens": 4},
            ("max_tokens (3)", "max_completion_tokens (4)", "differ"),
        ),
        ({"messages": [{"role": "user", "content": "hi", "name": "a|b"}]}, ("name", "'a|b'")),
    ],
)
def test_chat_inputs_once_ignored_are_refused(served, extra, needles):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, **extra}
    assert_error(post(served, "/v1/chat/completions", body), 400, *needles)


def test_chat_name_is_honoured_and_max_completion_tokens_applies(served):
    def chat(**kw):
        body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "ignore_eos": True, **kw}
        r = post(served, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        return r.json()

    plain = chat(messages=CHAT)["usage"]["prompt_tokens"]
    named = chat(messages=[{**CHAT[0], "name": "alice"}])["usage"]["prompt_tokens"]
    assert named == plain + len(" name=alice")
    r = post(
        served,
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "max_completion_tokens": 3, "ignore_eos": True},
    )
    assert r.json()["usage"]["completion_tokens"] == 3
    r = post(
        served,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": CHAT,
            "max_tokens": 3,
            "max_completion_tokens": 3,
            "ignore_eos": True,
        },
    )
    assert r.json()["usage"]["completion_tokens"] == 3


def test_stop_string_is_counted_as_stop_not_abort(served):
    stop0 = metric(served, 'atom_requests_total{finish_reason="stop"}')
    abort0 = metric(served, 'atom_requests_total{finish_reason="abort"}')
    whole = post(served, "/v1/completions", base(prompt="stop me", max_tokens=40, temperature=0))
    text = whole.json()["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 1] or text[:1]
    r = post(
        served,
        "/v1/completions",
        base(prompt="stop me", max_tokens=40, temperature=0, ignore_eos=True, stop=stop),
    )
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    wait_for(
        lambda: metric(served, 'atom_requests_total{finish_reason="stop"}') == stop0 + 1,
        what="a stop-string finish counted as stop",
    )
    assert metric(served, 'atom_requests_total{finish_reason="abort"}') == abort0


def running(served) -> int:
    eng = httpx.get(f"{served.url}/health").json()["engine"]
    return eng["running"] + eng["waiting"]


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts_the_request(served, stream):
    abort0 = metric(served, 'atom_requests_total{finish_reason="abort"}')
    # max_tokens unset: as many as fit max_model_len (a long run, cut by the disconnect)
    body = base(prompt=f"disconnect {stream}", max_tokens=None, ignore_eos=True, stream=stream)
    with httpx.Client(base_url=served.url) as c:
        try:
            with c.stream("POST", "/v1/completions", json=body, timeout=2.0) as r:
                assert r.status_code == 200
                next(r.iter_bytes())  # tokens are flowing; leaving the block hangs up
            assert stream
        except httpx.ReadTimeout:
            assert not stream  # a non-streaming answer sends nothing before the end
    wait_for(
        lambda: metric(served, 'atom_requests_total{finish_reason="abort"}') == abort0 + 1,
        timeout_s=20,
        what="the disconnected request to be aborted",
    )
    wait_for(lambda: running(served) == 0, what="the engine to be idle")


def test_x_request_id_is_echoed_and_used(served):
    r = post(served, "/v1/completions", base(), headers={"X-Request-Id": "my-id-1"})
    assert r.headers["x-request-id"] == "my-id-1"
    assert r.json()["id"] == "cmpl-my-id-1"
    r = post(served, "/v1/completions", base(temperature=-1), headers={"X-Request-Id": "bad-1"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "bad-1"
    r = post(served, "/v1/completions", base())
    assert r.headers["x-request-id"] == r.json()["id"]
    wait_for(lambda: "request cmpl-my-id-1: 1 prompt tokens 'x'" in served.text(), what="log")
    assert "request cmpl-my-id-1 finished: length, 2 completion tokens" in served.text()


def test_tokenize_detokenize_version_ping(served):
    r = post(served, "/tokenize", {"model": MODEL, "prompt": "hi!", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == list(b"hi!") and body["count"] == 3
    assert body["token_strs"] == ["h", "i", "!"] and body["max_model_len"] > 3
    chat = post(served, "/tokenize", {"messages": CHAT}).json()
    assert chat["count"] == len("<|user|>\nhello\n<|assistant|>\n")
    r = post(served, "/detokenize", {"tokens": body["tokens"]})
    assert r.json() == {"prompt": "hi!"}
    assert_error(post(served, "/tokenize", {"model": "gpt-4", "prompt": "x"}), 404)
    assert_error(post(served, "/tokenize", {"prompt": "x", "messages": CHAT}), 400, "exactly one")
    assert_error(post(served, "/detokenize", {"tokens": "abc"}), 400, "tokens")
    assert httpx.get(f"{served.url}/version").json()["version"]
    assert httpx.get(f"{served.url}/ping").status_code == 200
    assert httpx.post(f"{served.url}/ping").status_code == 200


def test_reset_prefix_cache_tier_true_empties_the_tier_too(served):
    assert_error(httpx.post(f"{served.url}/reset_prefix_cache?tier=maybe"), 400, "tier")
    prompt = "a prompt the tier will hold, then forget. " * 4
    body = base(prompt=prompt, max_tokens=1, temperature=0)
    post(served, "/v1/completions", body)
    wait_for(lambda: running(served) == 0, what="idle")
    wait_for(lambda: metric(served, "atom_tier_transfers_in_flight") == 0, what="saves")
    r = httpx.post(f"{served.url}/reset_prefix_cache")  # HBM only: the tier still serves it
    assert r.json()["reset"] == ["hbm"]
    src = post(served, "/v1/completions", body).json()["usage"]["prompt_tokens_details"]
    assert src["hbm_tokens"] == 0 and src["tier_tokens"] > 0, src
    wait_for(lambda: running(served) == 0, what="idle")
    wait_for(lambda: metric(served, "atom_tier_transfers_in_flight") == 0, what="saves")
    r = httpx.post(f"{served.url}/reset_prefix_cache?tier=true")
    assert r.status_code == 200 and r.json()["reset"] == ["hbm", "tier"], r.text
    src = post(served, "/v1/completions", body).json()["usage"]["prompt_tokens_details"]
    assert src["hbm_tokens"] == 0 and src["tier_tokens"] == 0, src


def test_reset_prefix_cache_forgets_hbm_hits(served):
    prompt = "a prompt to be cached and then forgotten. " * 4
    body = base(prompt=prompt, max_tokens=1, temperature=0)
    post(served, "/v1/completions", body)
    hit = post(served, "/v1/completions", body).json()["usage"]["prompt_tokens_details"]
    assert hit["hbm_tokens"] > 0
    wait_for(lambda: running(served) == 0, what="idle")
    r = httpx.post(f"{served.url}/reset_prefix_cache")
    assert r.status_code == 200, r.text
    after = post(served, "/v1/completions", body).json()["usage"]["prompt_tokens_details"]
    assert after["hbm_tokens"] == 0


def test_max_tokens_that_cannot_fit_is_400(served):
    """vLLM's rule: a given max_tokens that does not fit is refused, naming what does (an unset
    one generates what fits: tests/engine/test_engine_config.py)."""
    r = post(served, "/v1/completions", base(prompt="fit", max_tokens=10**6))
    assert_error(r, 400, "max_tokens=1000000 does not fit", "max_model_len")
    # the pool (400 blocks of 16 in TINY_FLAGS) is smaller than max_model_len here
    r = post(served, "/v1/completions", base(prompt="fit", max_tokens=400 * 16))
    assert_error(r, 400, "PAGE blocks; the pool has 400", "lower max_tokens")


def test_an_idle_server_settles_tier_outcomes_without_another_request(served):
    """The request's tail saves finish after it did; the idle engine loop folds them in (its
    transfers and the images they pinned are released) with no later request to step it."""
    body = base(prompt="settled while idle " * 6, max_tokens=1, temperature=0)
    assert post(served, "/v1/completions", body).status_code == 200
    wait_for(lambda: running(served) == 0, what="idle")
    wait_for(lambda: metric(served, "atom_tier_transfers_in_flight") == 0, what="saves settled")
    images = httpx.get(f"{served.url}/health").json()["engine"]["images"]
    assert images["pinned"] == 0, images
    assert metric(served, 'atom_tier_saves_total{outcome="done"}') > 0


def _raw(served, request: bytes) -> bytes:
    """Send bytes on a new connection; everything the server answers until it closes."""
    import socket

    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as conn:
        conn.sendall(request)
        out = b""
        while chunk := conn.recv(65536):
            out += chunk
    return out


def test_an_http_1_0_stream_is_not_chunked_and_ends_by_closing(served):
    body = json.dumps(
        {
            "model": "v41-tiny",
            "prompt": "old client",
            "max_tokens": 3,
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()
    head = (
        b"POST /v1/completions HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
    )
    out = _raw(served, head + body)
    headers, _, payload = out.partition(b"\r\n\r\n")
    assert headers.startswith(b"HTTP/1.1 200") and b"chunked" not in headers.lower()
    events = [json.loads(e[6:]) for e in payload.split(b"\n\n") if e[6:] not in (b"", b"[DONE]")]
    assert payload.endswith(b"data: [DONE]\n\n") and events[-1]["choices"][0]["finish_reason"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_a_request_that_is_not_http_gets_openai_error_json(served):
    out = _raw(served, b"NOT HTTP \x01\x02\r\n\r\n")
    headers, _, payload = out.partition(b"\r\n\r\n")
    assert headers.startswith(b"HTTP/1.1 400") and b"application/json" in headers
    err = json.loads(payload)["error"]
    assert err["type"] == "invalid_request_error" and "malformed HTTP request" in err["message"]
