"""The recall task: a key queried in the recent window, its record far back in the context.

    <bos> filler ... <key> K <val> V1 V2 ... filler ... <key> K' <val> V1' V2' ... filler
    ... <query> K <ans>  ->  V1 V2 <eos>

Records (2-6 per context, distinct keys) sit in the first part of the context, more than
``far`` tokens before the query, so the model can only reach them through the compressed KV
and the indexer; the queried key sits in the last few tokens, inside the sliding window. The
answer is two tokens. Splits are disjoint by construction: every example's seed is drawn from
its split's own range.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

VOCAB = 320
BOS, EOS, KEY, VAL, QUERY, ANS = 256, 257, 258, 259, 260, 261
NUM_KEYS = 64  # keys are tokens 192..255; values and filler come from 0..191
KEY_BASE = 192
VALUE_RANGE = 192
SPLIT_SEEDS = {"train": 0, "eval": 10_000_000, "preamble": 20_000_000}


@dataclass(frozen=True)
class Example:
    prompt: list[int]
    answer: list[int]  # the two value tokens


def make_example(seed: int, length: int, far: int = 80, records: tuple[int, int] = (2, 6)):
    rng = random.Random(seed)
    n = rng.randint(*records)
    keys = rng.sample(range(NUM_KEYS), n)
    recs = [(KEY_BASE + k, rng.randrange(VALUE_RANGE), rng.randrange(VALUE_RANGE)) for k in keys]
    body_len = length - 1 - 4  # bos ... query key ans
    tail = rng.randint(4, 24)  # filler after the last record region, inside the window
    region = body_len - tail - far
    if region < 6 * n:
        raise ValueError(f"length {length} too short for {n} records with far={far}")
    slots = sorted(rng.sample(range(region - 6), n))
    body = [rng.randrange(VALUE_RANGE) for _ in range(body_len)]
    last = -6
    for (k, v1, v2), at in zip(recs, slots):
        at = max(at, last + 6)
        body[at : at + 6] = [KEY, k, VAL, v1, v2, rng.randrange(VALUE_RANGE)]
        last = at
    k, v1, v2 = recs[rng.randrange(n)]
    prompt = [BOS] + body + [QUERY, k, ANS]
    return Example(prompt, [v1, v2])


def make_training_sequence(
    seed: int, length: int, far: int = 80, records: tuple[int, int] = (4, 8)
) -> tuple[list[int], list[int]]:
    """A training context that queries every one of its records (dense supervision).

        <bos> body-with-records ... <query> K1 <ans> V1 V2 <query> K2 <ans> V1 V2 ... <eos>

    Returns (tokens, answer positions): the positions whose token the model must predict
    (every answer value). The first query sits more than ``far`` tokens after the last record,
    so, as in the evaluation prompts, records are reachable only through compressed rows.
    """
    rng = random.Random(seed)
    n = rng.randint(*records)
    keys = rng.sample(range(NUM_KEYS), n)
    recs = [(KEY_BASE + k, rng.randrange(VALUE_RANGE), rng.randrange(VALUE_RANGE)) for k in keys]
    body_len = length - 1 - 5 * n - 1
    region = body_len - far
    if region < 6 * n + 6:
        raise ValueError(f"length {length} too short for {n} records with far={far}")
    slots = sorted(rng.sample(range(region - 6 * n), n))
    body = [rng.randrange(VALUE_RANGE) for _ in range(body_len)]
    for i, ((k, v1, v2), at) in enumerate(zip(recs, slots)):
        at += 6 * i  # slots sorted and spread by 6: records never overlap
        body[at : at + 6] = [KEY, k, VAL, v1, v2, rng.randrange(VALUE_RANGE)]
    tokens = [BOS] + body
    answers = []
    for k, v1, v2 in rng.sample(recs, n):
        tokens += [QUERY, k, ANS, v1, v2]
        answers += [len(tokens) - 2, len(tokens) - 1]
    tokens.append(EOS)
    return tokens, answers


def split(name: str, count: int, length: int, **kw) -> list[Example]:
    base = SPLIT_SEEDS[name]
    return [make_example(base + i, length, **kw) for i in range(count)]


def tokenizer_json() -> dict:
    """A tokenizers WordLevel definition of the task's vocabulary (for model directories)."""
    names = {BOS: "<bos>", EOS: "<eos>", KEY: "<key>", VAL: "<val>", QUERY: "<query>", ANS: "<ans>"}
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
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<0>"},
    }
