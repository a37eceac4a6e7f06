"""The recall task's prompts have the structure the accuracy job relies on."""

from __future__ import annotations

import pytest

from benchmarks.recall_task import (
    ANS,
    KEY_BASE,
    NUM_KEYS,
    NUM_VALUES,
    QUERY,
    VALUE_BASE,
    make_example,
    make_training_sequence,
    split,
)


def records_of(tokens):
    return {i: (t // NUM_VALUES, t % NUM_VALUES) for i, t in enumerate(tokens) if t < 256}


@pytest.mark.parametrize("length", [256, 384, 768])
def test_eval_prompt_asks_for_a_far_record_with_a_recent_key(length):
    for ex in split("eval", 50, length):
        assert len(ex.prompt) == length
        assert ex.prompt[-3] == QUERY and ex.prompt[-1] == ANS
        key = ex.prompt[-2] - KEY_BASE
        assert 0 <= key < NUM_KEYS
        recs = records_of(ex.prompt)
        assert 2 <= len(recs) <= 6
        assert len({k for k, _ in recs.values()}) == len(recs)  # distinct keys
        at, value = [(i, v) for i, (k, v) in recs.items() if k == key][0]
        assert ex.answer == [VALUE_BASE + value]
        assert length - 4 - at >= 80  # beyond the 64-token window of v41-recall


def test_splits_are_disjoint_and_reproducible():
    evals = [tuple(e.prompt) for e in split("eval", 200, 256)]
    assert evals == [tuple(e.prompt) for e in split("eval", 200, 256)]
    train = {tuple(make_example(i, 256).prompt) for i in range(200)}
    assert not train & set(evals)


def test_training_sequence_asks_for_every_record_and_marks_the_answers():
    tokens, answers = make_training_sequence(7, 320, far=80)
    recs = records_of(tokens)
    assert len(tokens) == 320 and len(answers) == len(recs)
    for pos in answers:
        assert tokens[pos - 1] == ANS and tokens[pos - 3] == QUERY
        key = tokens[pos - 2] - KEY_BASE
        assert tokens[pos] == VALUE_BASE + dict(recs.values())[key]


def test_a_context_too_short_for_its_records_is_refused():
    with pytest.raises(ValueError, match="cannot hold"):
        make_example(0, 40, far=80)
