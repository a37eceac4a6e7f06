"""Tokenizers: byte-level for presets, a model directory's tokenizer.json when it has one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255; 256 is BOS, 257 is EOS; ids >= 256 decode to nothing."""

    bos_token_id = 256
    eos_token_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: Path, eos_token_id: int | None):
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


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
        return HFTokenizer(path / "tokenizer.json", eos)
    return ByteTokenizer()
