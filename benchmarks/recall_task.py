"""The recall task: a key asked in the recent window, its record far back in the context.

    <bos> filler ... R(k1,v1) ... filler ... R(k2,v2) ... filler <query> K(k) <ans>  ->  V(v)

A record is one token R(k, v) that binds one of 16 keys to one of 16 values; each context holds
2-6 records with distinct keys among filler. The prompt ends by asking for key k (the token
K(k), inside the sliding window); the answer is the value token V(v) of the record with that
key. Records sit more than ``far`` tokens before the question, so the model reaches them only
through compressed rows and the indexer, while the key it must match is reachable only through
the window. Chance is 1/16. Splits are disjoint by construction: every example's seed is drawn
from its split's own range.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

VOCAB = 320
NUM_KEYS = NUM_VALUES = 16
BOS, EOS, QUERY, ANS = 256, 257, 260, 261
KEY_BASE, VALUE_BASE, FILLER_BASE = 262, 278, 294  # K(k), V(v), filler tokens
NUM_FILLER = VOCAB - FILLER_BASE
SPLIT_SEEDS = {"train": 0, "eval": 10_000_000, "preamble": 20_000_000}


@dataclass(frozen=True)
class Example:
    prompt: list[int]
    answer: list[int]  # one value token


def record(key: int, value: int) -> int:
    return key * NUM_VALUES + value


def filler(rng: random.Random, n: int) -> list[int]:
    return [FILLER_BASE + rng.randrange(NUM_FILLER) for _ in range(n)]


def _context(rng: random.Random, body_len: int, far: int, n: int) -> tuple[list, list]:
    """[bos] + body with n records in its first ``body_len - far`` tokens; (tokens, records)."""
    if body_len - far < n:
        raise ValueError(f"a body of {body_len} tokens cannot hold {n} records {far} tokens back")
    keys = rng.sample(range(NUM_KEYS), n)
    recs = [(k, rng.randrange(NUM_VALUES)) for k in keys]
    body = filler(rng, body_len)
    for (k, v), at in zip(recs, rng.sample(range(body_len - far), n)):
        body[at] = record(k, v)
    return [BOS] + body, recs


def make_example(seed: int, length: int, far: int = 80, records: tuple[int, int] = (2, 6)):
    """An evaluation prompt of exactly ``length`` tokens and its one-token answer."""
    rng = random.Random(seed)
    tokens, recs = _context(rng, length - 4, far, rng.randint(*records))
    k, v = recs[rng.randrange(len(recs))]
    return Example(tokens + [QUERY, KEY_BASE + k, ANS], [VALUE_BASE + v])


def make_training_sequence(
    seed: int, length: int, far: int = 80, records: tuple[int, int] = (2, 8)
) -> tuple[list[int], list[int]]:
    """A training context of ``length`` tokens that asks for every one of its records.

        <bos> body ... <query> K <ans> V <query> K' <ans> V' ... <eos>

    Returns (tokens, answer positions). The first question is laid out like an evaluation
    prompt; ``far`` counts from the end of the body.
    """
    rng = random.Random(seed)
    n = rng.randint(*records)
    tokens, recs = _context(rng, length - 2 - 4 * n, far, n)
    answers = []
    for k, v in rng.sample(recs, n):
        tokens += [QUERY, KEY_BASE + k, ANS, VALUE_BASE + v]
        answers.append(len(tokens) - 1)
    tokens.append(EOS)
    return tokens, answers


def split(name: str, count: int, length: int, **kw) -> list[Example]:
    base = SPLIT_SEEDS[name]
    return [make_example(base + i, length, **kw) for i in range(count)]


def preamble(length: int) -> list[int]:
    """The shared preamble of the HBM + tier configuration (filler only, seeded)."""
    return filler(random.Random(SPLIT_SEEDS["preamble"]), length)


def tokenizer_json() -> dict:
    """A tokenizers WordLevel definition of the task's vocabulary (for model directories)."""
    names = {BOS: "<bos>", EOS: "<eos>", QUERY: "<query>", ANS: "<ans>"}
    names.update({record(k, v): f"<r{k}:{v}>" for k in range(NUM_KEYS) for v in range(NUM_VALUES)})
    names.update({KEY_BASE + k: f"<k{k}>" for k in range(NUM_KEYS)})
    names.update({VALUE_BASE + v: f"<v{v}>" for v in range(NUM_VALUES)})
    vocab = {names.get(i, f"<{i}>"): i for i in range(VOCAB)}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<294>"},
    }
