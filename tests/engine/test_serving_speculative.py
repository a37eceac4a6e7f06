"""benchmarks.serving --arms speculative on a tiny preset: the three arms (no reuse, HBM, HBM +
an owned LMCache server) each without and with drafts, their acceptance counters and whether
their outputs equal the k = 0 arm's (fp32 greedy: they must). Results are captured, not written
to benchmarks/results."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import serving
from benchmarks.workload import shared_prefix_prompts

ARGS = dict(
    model="v41-tiny-draft",
    preset="cpu",
    requests=4,
    prefixes=2,
    prefix_len=32,  # block 16: two prefix blocks, one tail block per prompt
    tail_len=24,
    output_len=8,
    concurrency=4,
    max_batched_tokens=128,
    pool_blocks=20,  # 4 running take 16: the prefixes fit beside them, the tails do not
    device="cpu",
    dtype="float32",
    l1_gb=0.2,
    load_mode="engine_driven",
    workload="random",
    speculative_tokens=2,
    # the measured passes start with nothing in HBM: what pass 1 left there depends on its
    # timing (a CI run had the tier arm's whole pass 2 hit HBM), the tier's hits must not
    cold_hbm=True,
    repeats=1,
    name="serving_speculative_test",
)


@pytest.fixture
def captured(captured_results):
    return captured_results


def test_speculative_arms_report_acceptance_and_equal_outputs(captured):
    args = argparse.Namespace(**ARGS)
    prompts = shared_prefix_prompts(args.requests, args.prefixes, args.prefix_len, args.tail_len)
    assert serving.speculative(args, prompts) == 0
    data = captured["data"]
    assert captured["name"] == "serving_speculative_test" and not data["failures"]
    arms = {a["arm"]: a for a in data["arms"]}
    configs = ("no prefix reuse", "HBM prefix caching", "HBM + tier")
    assert list(arms) == [f"{c}, k={k}" for c in configs for k in (0, 2)]
    n = len(prompts)
    for arm in arms.values():
        assert arm["output_tokens"] == n * args.output_len
        assert arm["output_tokens_per_s"] > 0
        assert arm["outputs_equal_to_k0"]["pass2"] == f"{n}/{n}"
        assert arm["pass2_equal_to_no_reuse_k0"] == f"{n}/{n}"
        if arm["k"] == 0:
            assert arm["speculative"] is None
            continue
        spec = arm["speculative"]
        # every decode step of the measured pass verified up to k drafts per request
        assert spec["verify_spans"] > 0 and spec["draft_tokens"] > 0
        assert spec["draft_tokens"] <= 2 * spec["verify_spans"]
        assert 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
        rate = spec["accepted_tokens"] / spec["draft_tokens"]
        assert spec["acceptance_rate"] == pytest.approx(rate, abs=1e-4)
        per_verify = (spec["accepted_tokens"] + spec["verify_spans"]) / spec["verify_spans"]
        assert spec["tokens_per_verify"] == pytest.approx(per_verify, abs=1e-4)
    for name in ("HBM prefix caching", "HBM + tier"):
        assert arms[f"{name}, k=2"]["outputs_equal_to_k0"]["pass1"] == f"{n}/{n}"
    # the tier arm's measured pass loaded prompt tokens from the tier, with drafts too
    assert arms["HBM + tier, k=0"]["tier_hit_tokens"] > 0
    assert arms["HBM + tier, k=2"]["tier_hit_tokens"] > 0
    assert "acceptance" in captured["table"] and "HBM + tier, k=2" in captured["table"]
    assert set(data["summary"]) == set(configs)
    assert [r["arm"] for r in data["runs"]] == [f"{a} #1" for a in arms]


def test_partings_report_where_outputs_part_and_the_reference_gap_there():
    from types import SimpleNamespace

    from atom.outputs import TokenLogprob
    from benchmarks.serving import parting_text, partings

    def out(ids, gaps):
        lps = [TokenLogprob(t, -0.1, 1, ((t, -0.1), (t + 1, -0.1 - g))) for t, g in zip(ids, gaps)]
        return SimpleNamespace(token_ids=ids, logprobs=lps)

    ref = [out([1, 2, 3], [1.0, 0.5, 0.25]), out([4, 5], [2.0, 0.03125]), out([6], [1.0])]
    parts = partings(ref, [[1, 2, 9], [4, 5], [7]])
    assert parts == [[2, 0.25], [0, 1.0]]  # the equal pair is not listed
    assert "2 parted" in parting_text(parts) and "[0.25, 1.0]" in parting_text(parts)
    assert partings([SimpleNamespace(token_ids=[1], logprobs=None)], [[2]]) == [[0, None]]
