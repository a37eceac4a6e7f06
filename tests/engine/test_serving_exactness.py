"""benchmarks.serving's exactness verdict: every pass of every arm against the no-reuse arm's
outputs, token for token (what the batch-invariant mode must make zero)."""

from __future__ import annotations

from benchmarks.serving import exactness, exactness_text


def test_every_pass_is_counted_against_the_no_reuse_arm():
    arms = [{"arm": "no prefix reuse"}, {"arm": "HBM prefix caching"}, {"arm": "HBM + tier"}]
    ref = [[1, 2, 3], [4, 5, 6]]
    kept = [
        {"pass1": None, "pass2": ref},
        {"pass1": ref, "pass2": [[1, 2, 3], [4, 9, 9]]},
        {"pass1": [[1, 2, 3], [4, 5, 6]], "pass2": [[1, 2], [4, 5, 6]]},  # one token short
    ]
    exact = exactness(arms, kept)
    assert exact["passes"] == {
        "HBM prefix caching pass1": {"requests_differing": 0, "tokens_differing": 0},
        "HBM prefix caching pass2": {"requests_differing": 1, "tokens_differing": 2},
        "HBM + tier pass1": {"requests_differing": 0, "tokens_differing": 0},
        "HBM + tier pass2": {"requests_differing": 1, "tokens_differing": 1},
    }
    assert exact["differing_tokens"] == 3
    text = exactness_text(exact, invariant=True)
    assert "batch-invariant mode; 3 tokens differ in all" in text
    assert "| HBM + tier pass2 | 1 | 1 |" in text
    same = exactness(arms, [{"pass1": None, "pass2": ref}] + [{"pass1": ref, "pass2": ref}] * 2)
    assert same["differing_tokens"] == 0
