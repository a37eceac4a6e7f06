"""GET /tokenizer_info (vLLM's, behind --enable-tokenizer-info-endpoint): the tokenizer config
as JSON. A client holding only what the server publishes (the shipped tokenizer directory, the
chat template from /tokenizer_info) gets the ids the server's /tokenize gives."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from atom.serve.app import ServerState, build_app
from atom.serve.chat_template import CHAT_TEMPLATE
from atom.tokenizer import BYTE_TOKENIZER_DIR, ByteTokenizer, load_tokenizer

from .conftest import _MODULE_SERVERS, ServeProcess

MODEL = "v41-tiny"
TEXTS = ["hello world", "héllo 世界 🦀", "a<｜end▁of▁sentence｜>b", " \n\t "]


def get_in_process(state: ServerState, path: str) -> httpx.Response:
    """One request to the app without its lifespan (the engine loop is never touched)."""

    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://atom") as client:
            return await client.get(path)

    return asyncio.run(get())


def state_for(tokenizer, **kw) -> ServerState:
    return ServerState(loop=None, tokenizer=tokenizer, model_name=MODEL, **kw)


def test_off_by_default_as_in_vllm():
    r = get_in_process(state_for(ByteTokenizer()), "/tokenizer_info")
    assert r.status_code == 404, r.text
    assert "no such endpoint: GET /tokenizer_info" in r.json()["error"]["message"]


def test_a_model_directory_publishes_its_own_config(tmp_path):
    """A model's tokenizer_config.json, its added tokens as their strings (vLLM's serialization
    of AddedToken), file paths dropped; without a config, the EOS id's token string."""
    from tokenizers import Tokenizer, models

    vocab = {"<pad>": 0, "a": 1, "</s>": 2}
    Tokenizer(models.WordLevel(vocab, unk_token="<pad>")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    bare = get_in_process(
        state_for(load_tokenizer(str(tmp_path)), tokenizer_info_endpoint=True), "/tokenizer_info"
    )
    assert bare.json() == {
        "eos_token": "</s>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }
    eos = {"__type": "AddedToken", "content": "</s>", "special": True}
    config = {
        "tokenizer_class": "LlamaTokenizerFast",
        "eos_token": eos,
        "added_tokens_decoder": {"2": eos},
        "vocab_file": "/somewhere/vocab.json",
        "model_max_length": 4096,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    state = state_for(load_tokenizer(str(tmp_path)), tokenizer_info_endpoint=True)
    state.max_model_len = 512
    info = get_in_process(state, "/tokenizer_info").json()
    assert info == {
        "tokenizer_class": "LlamaTokenizerFast",
        "eos_token": "</s>",
        "added_tokens_decoder": {"2": "</s>"},
        "model_max_length": 512,  # what this server serves, not the file's 4096
        "chat_template": CHAT_TEMPLATE,
    }


@pytest.fixture(scope="module")
def server():
    proc = ServeProcess("--enable-tokenizer-info-endpoint")
    _MODULE_SERVERS.append(proc)
    proc.wait_ready()
    yield proc
    _MODULE_SERVERS.remove(proc)
    assert proc.terminate() == 0, proc.text()


def tokenize(server, **body) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_the_presets_tokenizer_info(server):
    r = httpx.get(f"{server.url}/tokenizer_info")
    assert r.status_code == 200, r.text
    info = r.json()
    shipped = json.loads((BYTE_TOKENIZER_DIR / "tokenizer_config.json").read_text("utf-8"))
    max_len = httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"]
    bt = ByteTokenizer
    assert info["tokenizer_class"] == shipped["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (info["bos_token"], info["eos_token"]) == (bt.bos_token, bt.eos_token)
    assert info["added_tokens_decoder"] == {
        str(bt.bos_token_id): bt.bos_token,
        str(bt.eos_token_id): bt.eos_token,
    }
    assert info["model_max_length"] == max_len
    assert info["chat_template"] == CHAT_TEMPLATE == shipped["chat_template"]
    assert httpx.head(f"{server.url}/tokenizer_info").status_code == 200


def test_the_shipped_tokenizer_encodes_as_the_server_does(server):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(BYTE_TOKENIZER_DIR))
    for text in TEXTS:
        # lm-eval's probe of a remote tokenizer sends add_special_tokens
        served = tokenize(server, prompt=text, add_special_tokens=False)
        assert hf.encode(text) == served, text
        r = httpx.post(f"{server.url}/detokenize", json={"tokens": served}, timeout=30)
        assert r.json()["prompt"] == hf.decode(served) == text


def test_the_published_chat_template_gives_the_servers_chat_prompt(server):
    jinja2 = pytest.importorskip("jinja2")
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "name": "alice", "content": "é?"},
    ]
    template = httpx.get(f"{server.url}/tokenizer_info").json()["chat_template"]
    for gen in (True, False):
        text = jinja2.Template(template).render(messages=messages, add_generation_prompt=gen)
        want = tokenize(server, messages=messages, add_generation_prompt=gen)
        assert tokenize(server, prompt=text) == want
