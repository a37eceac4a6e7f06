"""The compressed token map of DeepSeek-V4.1's Engram: every token id maps to a compressed id,
and tokens whose text normalises alike (case, accents, whitespace) share one. N-grams are
hashed over compressed ids (``ngram_hash``), and every hash multiplier derives from the map's
size, so a map of the wrong size would silently rehash the whole table: it is refused
(``ngram_hash.check_token_map_size``, where the spec and the multipliers live).
"""

from __future__ import annotations

from typing import Any

_SENTINEL = "\ue000"


def _engram_normalizer() -> Any:
    from tokenizers import Regex, normalizers

    # A token that is exactly one space would be stripped to "" and merged with the genuinely
    # empty ones; the private-use sentinel carries it through Strip and is then put back.
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )


def build_compressed_token_map(tokenizer: Any) -> tuple[list[int], int]:
    """(lookup, size): ``lookup[token_id]`` is the compressed id, ``size`` the distinct count.

    ``tokenizer`` is a ``tokenizers.Tokenizer`` (a transformers fast tokenizer is unwrapped via
    its ``backend_tokenizer``). Every id in ``range(get_vocab_size(with_added_tokens=True))`` is
    decoded alone with special tokens kept. A decode containing U+FFFD is a partial UTF-8 byte
    token: it is keyed by its raw token string, since normalising the replacement character
    would merge all of them. Otherwise the key is the normalised text, or the decoded text when
    normalisation leaves nothing. Compressed ids are handed out in order of first appearance.
    """
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    normalizer = _engram_normalizer()
    keys: dict[str, int] = {}
    lookup: list[int] = []
    for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
        text = backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = backend.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        lookup.append(keys.setdefault(key, len(keys)))
    return lookup, len(keys)


def identity_token_map(vocab_size: int) -> tuple[list[int], int]:
    """(lookup, size) mapping every token id to itself, for random-weight presets.

    Only for models with no tokenizer (random weights): a real checkpoint's tables were trained
    with :func:`build_compressed_token_map`, and an identity map would index them wrongly. The
    spec's ``compressed_vocab_size`` must then equal ``vocab_size``.
    """
    return list(range(vocab_size)), vocab_size
