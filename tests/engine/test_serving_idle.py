"""benchmarks.serving --arms idle --interleave on a tiny preset: both arms' engines alive on one
copy of the weights (the tier arm's attached to an owned LMCache server), their measured passes
alternating; every round's overhead in the summary, the tier arm idle (no lookup, no load) and
both arms decoding the same tokens. Results are captured, not written to benchmarks/results."""

from __future__ import annotations

import argparse
import statistics

from benchmarks import serving

from .test_serving_speculative import ARGS as SPECULATIVE_ARGS

ARGS = dict(
    SPECULATIVE_ARGS,
    model="v41-tiny",
    output_len=6,
    max_batched_tokens=256,
    pool_blocks=40,  # doubled by the idle comparison: every prompt stays in HBM
    cold_hbm=False,  # and stays there for the measured passes: the tier is idle
    save_mode="lmcache_driven",
    interleave=4,
    name="serving_idle_test",
)


def test_interleaved_idle_rounds_alternate_and_the_tier_stays_idle(monkeypatch, captured_results):
    written = captured_results
    outputs = {}
    measure = serving.Arm.measure

    def measured(arm):
        wall = measure(arm)
        outputs.setdefault(arm.name, []).append([o.token_ids for o in arm.outs])
        return wall

    monkeypatch.setattr(serving.Arm, "measure", measured)
    serving.idle_interleaved(argparse.Namespace(**ARGS))
    data = written["data"]
    assert written["name"] == "serving_idle_test_idle_interleaved"
    assert "--interleave 4" in written["command"]
    hbm, tiered = data["arms"]
    assert [hbm["arm"], tiered["arm"]] == ["HBM only", "HBM + idle tier"]
    assert len(hbm["pass_walls_s"]) == len(tiered["pass_walls_s"]) == 4
    summary = data["summary"]
    rounds = [b / a - 1 for a, b in zip(hbm["pass_walls_s"], tiered["pass_walls_s"])]
    # each round compares the two arms' passes of that round (walls kept to 0.1 ms)
    assert len(summary["round_overheads"]) == 4
    assert all(abs(a - b) < 0.01 for a, b in zip(summary["round_overheads"], rounds))
    assert abs(summary["idle_tier_overhead"] - statistics.mean(summary["round_overheads"])) < 1e-4
    assert summary["ci95_half_width"] > 0
    # each pass's parts: its steps by kind, the time outside them, its collections
    for arm in (hbm, tiered):
        parts = summary["passes"][arm["arm"]]
        assert [p["wall_s"] for p in parts] == arm["pass_walls_s"]
        for p in parts:
            assert p["decode_s"] > 0 and p["steps"] > 0 and len(p["gc_collections"]) == 3
            assert abs(p["decode_s"] + p["other_steps_s"] + p["outside_s"] - p["wall_s"]) < 1e-3
    spread = summary["spread"]
    assert (
        spread["rounds"] == 4 and abs(spread["wall"]["mean"] - summary["idle_tier_overhead"]) < 1e-9
    )
    assert tiered["loads"] == 0 and tiered["tier_hit_tokens"] == 0
    assert tiered["lookup_thread_calls"]["lookups"] == 0  # HBM covered every prompt
    # one copy of the weights: both engines decode the same tokens in every pass
    assert outputs["HBM only"] == outputs["HBM + idle tier"]
    assert len(outputs["HBM only"]) == 4
