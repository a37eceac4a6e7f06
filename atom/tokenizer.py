"""Tokenizers: byte-level for presets, a model directory's tokenizer.json when it has one.

The byte-level presets' tokenizer also ships as a Hugging Face tokenizer directory,
``BYTE_TOKENIZER_DIR`` (written by ``python -m tools.make_byte_tokenizer``), so that a client
that tokenizes on its side (lm-eval's ``tokenizer=``, transformers' ``AutoTokenizer``) gets
exactly the ids the server would.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

BYTE_TOKENIZER_DIR = Path(__file__).resolve().parent / "byte_tokenizer"


class Tokenizer(Protocol):
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def config(self) -> dict:
        """The tokenizer's tokenizer_config.json (as transformers reads it); {} if it has none."""
        ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255; 256 is BOS, 257 is EOS; ids >= 256 decode to nothing.

    Text never encodes to an id >= 256: the special tokens' strings (``bos_token``,
    ``eos_token``, the names clients see) encode as their bytes, like any other text."""

    bos_token_id = 256
    eos_token_id = 257
    bos_token = "<｜begin▁of▁sentence｜>"
    eos_token = "<｜end▁of▁sentence｜>"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def config(self) -> dict:
        return json.loads((BYTE_TOKENIZER_DIR / "tokenizer_config.json").read_text())


class HFTokenizer:
    def __init__(self, path: Path, eos_token_id: int | None, config: dict | None = None):
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))
        self.eos_token_id = eos_token_id
        self._config = dict(config or {})

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def config(self) -> dict:
        """The directory's tokenizer_config.json; without one, the EOS token's string."""
        config = dict(self._config)
        if "eos_token" not in config and self.eos_token_id is not None:
            eos = self._tok.id_to_token(self.eos_token_id)
            if eos is not None:
                config["eos_token"] = eos
        return config


def load_tokenizer(model: str) -> Tokenizer:
    path = Path(model)
    if path.is_dir() and (path / "tokenizer.json").exists():
        eos = None
        for name in ("generation_config.json", "config.json"):
            f = path / name
            if f.exists():
                eos = json.loads(f.read_text()).get("eos_token_id", eos)
                if eos is not None:
                    break
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        cfg = path / "tokenizer_config.json"
        config = json.loads(cfg.read_text()) if cfg.exists() else None
        return HFTokenizer(path / "tokenizer.json", eos, config)
    return ByteTokenizer()
