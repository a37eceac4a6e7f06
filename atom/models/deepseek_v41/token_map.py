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


def attach_token_map(model: Any, path: Any) -> bool:
    """Give ``model``'s Engram hashing (``model.engram_hash``) the compressed token map of the
    tokenizer beside the checkpoint at ``path`` (its ``tokenizer.json``), where the model
    needs one (a compressed vocabulary unlike its vocabulary: the published models). Token ids
    the tokenizer does not have (the vocabulary padded past it) map to compressed id 0: no
    text produces them. Returns whether a map was attached; raises ``WeightLoadError`` naming
    the file when the model needs one and there is none, or its size is not the config's."""
    from pathlib import Path

    from atom.models.common.weights import WeightLoadError

    hashing = getattr(model, "engram_hash", None)
    if hashing is None or not hashing.needs_token_map:
        return False
    path = Path(path)
    file = (path if path.is_dir() else path.parent) / "tokenizer.json"
    want = hashing.spec.compressed_vocab_size
    if not file.exists():
        raise WeightLoadError(
            f"{file} not found: this model's Engram hashes over a compressed vocabulary of "
            f"{want} ids (engram_compressed_vocab_size) built from its tokenizer; put the "
            "checkpoint's tokenizer.json beside its weights"
        )
    from tokenizers import Tokenizer

    lookup, size = build_compressed_token_map(Tokenizer.from_file(str(file)))
    if size != want or len(lookup) > hashing.vocab_size:
        raise WeightLoadError(
            f"{file} gives a compressed token map of {size} ids over {len(lookup)} tokens; the "
            f"config says engram_compressed_vocab_size={want} over a vocabulary of "
            f"{hashing.vocab_size}: this tokenizer is not the checkpoint's"
        )
    hashing.set_token_map((lookup + [0] * (hashing.vocab_size - len(lookup)), size))
    return True
