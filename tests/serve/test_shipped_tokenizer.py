"""The tokenizer directory atom ships for its byte-level presets (atom/byte_tokenizer), read by
transformers' AutoTokenizer from the local path as lm-eval's ``tokenizer=`` does: it encodes
any text to exactly ByteTokenizer's ids, decodes as ByteTokenizer does, names atom's special
ids, and applies the server's chat template."""

from __future__ import annotations

import json

import pytest

from atom.serve.chat_template import CHAT_TEMPLATE, render_chat
from atom.serve.protocol import ChatMessage
from atom.tokenizer import BYTE_TOKENIZER_DIR, ByteTokenizer
from tools.make_byte_tokenizer import tokenizer_config, tokenizer_json

transformers = pytest.importorskip("transformers")

ATOM = ByteTokenizer()

TEXTS = [
    "hello world",
    "  leading and trailing spaces \n\t\r\n",
    "héllo wörld, naïve café",
    "日本語のテキスト 世界",
    "emoji 🦀🧪 and a ZWJ family 👨‍👩‍👧",
    "a<｜end▁of▁sentence｜>b<｜begin▁of▁sentence｜>",  # the specials' strings are only bytes
    "<|user|>\nhi\n<|assistant|>\n",
    "",
    "\x00\x01\x7f",
]


@pytest.fixture(scope="module")
def hf():
    return transformers.AutoTokenizer.from_pretrained(str(BYTE_TOKENIZER_DIR))


def every_utf8_byte_text() -> str:
    """Text whose UTF-8 holds every byte UTF-8 can hold (all but C0, C1, F5-FF)."""
    points = [*range(0x800), *range(0x800, 0x10000, 0x800), *range(0x10000, 0x110000, 0x10000)]
    text = "".join(chr(c) for c in points if not 0xD800 <= c < 0xE000)  # no surrogates
    missing = set(range(256)) - set(text.encode("utf-8")) - {0xC0, 0xC1, *range(0xF5, 0x100)}
    assert not missing, sorted(missing)
    return text


@pytest.mark.parametrize("text", [*TEXTS, every_utf8_byte_text()])
def test_encode_is_atoms_encode_and_decode_round_trips(hf, text):
    ids = ATOM.encode(text)
    assert hf.encode(text) == ids
    assert hf(text)["input_ids"] == ids  # lm-eval's tok_encode path
    assert hf.decode(ids) == text == ATOM.decode(ids)


def test_decode_of_any_ids_is_atoms_decode(hf):
    """Invalid UTF-8 (a cut multi-byte char, bytes UTF-8 never holds) gets the same U+FFFDs;
    special and unused ids (256-319 of the presets' vocabulary) decode to nothing."""
    cases = [
        [0xE2, 0x82],
        [0x41, 0xE2, 0x82, 0x42],
        [0xC0, 0xAF, 0xFF, 0xF5, 0x41],
        [0xF0, 0x9F, 0xA6],
        list(range(320)),
        [ATOM.bos_token_id, 0x68, 0x69, ATOM.eos_token_id, 300],
    ]
    for ids in cases:
        assert hf.decode(ids, skip_special_tokens=True) == ATOM.decode(ids), ids


def test_special_tokens_are_atoms_ids(hf):
    assert (hf.bos_token_id, hf.eos_token_id) == (ATOM.bos_token_id, ATOM.eos_token_id)
    assert (hf.bos_token, hf.eos_token) == (ATOM.bos_token, ATOM.eos_token)
    assert hf.decode([ATOM.eos_token_id]) == ATOM.eos_token  # lm-eval's stop string
    assert hf.encode("x", add_special_tokens=True) == [ord("x")]  # no BOS added, as atom


def test_the_chat_template_renders_what_the_server_renders(hf):
    chats = [
        [{"role": "user", "content": "hi"}],
        [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None},
            {"role": "user", "name": "alice", "content": "é?"},
        ],
    ]
    for chat in chats:
        msgs = [ChatMessage(**m) for m in chat]
        for gen in (True, False):
            got = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert got == render_chat(msgs, gen), (chat, gen)


def test_the_shipped_files_are_what_the_tool_writes():
    """atom/byte_tokenizer is ``python -m tools.make_byte_tokenizer``'s output: rerun it after
    changing ByteTokenizer's specials or the chat template."""
    shipped = json.loads((BYTE_TOKENIZER_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    assert shipped == json.loads(tokenizer_json())
    config = json.loads((BYTE_TOKENIZER_DIR / "tokenizer_config.json").read_text("utf-8"))
    assert config == tokenizer_config()
    assert config["chat_template"] == CHAT_TEMPLATE
