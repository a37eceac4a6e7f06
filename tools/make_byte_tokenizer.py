"""Write atom/byte_tokenizer/: the byte-level presets' tokenizer (atom.tokenizer.ByteTokenizer)
as a Hugging Face tokenizer directory, for clients that tokenize on their side.

    python -m tools.make_byte_tokenizer [--out DIR]

tokenizer.json is a byte-level BPE with no merges: the ByteLevel pre-tokenizer maps each UTF-8
byte to one character (GPT-2's byte alphabet) and the vocabulary maps that character to the
byte's value, so every byte is one token whose id is the byte, as in ByteTokenizer. BOS (256)
and EOS (257) are added special tokens. tokenizer_config.json sets ``split_special_tokens``:
atom encodes the special tokens' strings as their bytes (text never yields an id >= 256), and so
must the client. It also carries the server's chat template.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from atom.serve.chat_template import CHAT_TEMPLATE
from atom.tokenizer import BYTE_TOKENIZER_DIR, ByteTokenizer


def byte_alphabet() -> list[str]:
    """GPT-2's byte-to-character map (what the ByteLevel pre-tokenizer emits): entry b is the
    character byte b becomes."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tokenizer_json() -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: b for b, c in enumerate(byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    bt = ByteTokenizer
    specials = [(bt.bos_token_id, bt.bos_token), (bt.eos_token_id, bt.eos_token)]
    for want, content in specials:
        tok.add_special_tokens([AddedToken(content, special=True, normalized=False)])
        got = tok.token_to_id(content)
        if got != want:
            raise AssertionError(f"special token {content!r} got id {got}, ByteTokenizer's {want}")
    return tok.to_str(pretty=True)


def tokenizer_config() -> dict:
    bt = ByteTokenizer
    added = {
        str(i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, content in [(bt.bos_token_id, bt.bos_token), (bt.eos_token_id, bt.eos_token)]
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bt.bos_token,
        "eos_token": bt.eos_token,
        "add_bos_token": False,
        "add_eos_token": False,
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }


def write(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tokenizer_json() + "\n", encoding="utf-8")
    config = json.dumps(tokenizer_config(), indent=2, ensure_ascii=False)
    (out / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=BYTE_TOKENIZER_DIR)
    write(ap.parse_args().out)


if __name__ == "__main__":
    main()
