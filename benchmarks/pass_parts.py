"""Where a measured pass's wall time went, and which part carries the spread between paired
passes.

A pass's wall is split into its decode steps, its other steps (prefill and mixed), the time
outside the steps (admission, outputs, the generate loop), and, across all of these, the
interpreter's garbage collections (``GcClock``: every thread's, by generation). Over rounds of
two arms' passes (``paired_spread``), each part's difference between the arms is taken per
round, as a share of the first arm's wall: its mean says what that part adds, its standard
deviation how much of the round-to-round spread it carries. A spread carried by the parts
both arms share (a collection landing in one pass and not the other, a slow prefill) is
noise the overhead's confidence interval pays for; the decode steps' own ratio is reported
beside it.
"""

from __future__ import annotations

import functools
import gc
import statistics
import time

PARTS = ("decode_s", "other_steps_s", "outside_s", "gc_s")


class GcClock:
    """The seconds and counts of the interpreter's garbage collections since it was made, by
    generation (``gc.callbacks``; a collection runs on whichever thread triggered it)."""

    def __init__(self):
        self.seconds = [0.0, 0.0, 0.0]
        self.counts = [0, 0, 0]
        self._t0 = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            g = info["generation"]
            self.seconds[g] += time.perf_counter() - self._t0
            self.counts[g] += 1

    def read(self) -> tuple[float, tuple[int, int, int]]:
        return sum(self.seconds), (self.counts[0], self.counts[1], self.counts[2])


@functools.cache
def gc_clock() -> GcClock:
    """The process's one ``GcClock`` (made on first use)."""
    return GcClock()


def pass_parts(rows: list, wall: float, gc_s: float, gc_counts: tuple[int, ...]) -> dict:
    """One pass's parts from its step rows (``StepLog.rows`` of the pass: (seconds, kind, ...)),
    its wall, and the collections within it."""
    decode = sum(r[0] for r in rows if r[1] == "decode")
    other = sum(r[0] for r in rows if r[1] != "decode")
    return {
        "wall_s": wall,
        "steps": len(rows),
        "decode_s": decode,
        "other_steps_s": other,
        "outside_s": wall - decode - other,
        "gc_s": gc_s,
        "gc_collections": list(gc_counts),
    }


def rounded(v):
    """A part as the results keep it (seconds to 0.1 ms; counts as they are)."""
    return round(v, 4) if isinstance(v, float) else v


def _ci(xs: list[float]) -> tuple[float, float, float]:
    """(mean, 95% half-width, standard deviation)."""
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return mean, 0.0, 0.0
    sd = statistics.stdev(xs)
    return mean, 1.96 * sd / len(xs) ** 0.5, sd


def paired_spread(base: list[dict], other: list[dict]) -> dict:
    """Per part, over rounds (``base[i]`` and ``other[i]`` measured in round i): the mean and
    standard deviation of (other - base) / base wall, and the decode steps' own ratio
    (other / base - 1) with its 95% confidence half-width. Fractions, not percent."""
    out: dict = {"rounds": len(base)}
    for part in PARTS:
        diffs = [(b[part] - a[part]) / a["wall_s"] for a, b in zip(base, other)]
        mean, _, sd = _ci(diffs)
        out[part] = {"mean": mean, "sd": sd}
    walls = [b["wall_s"] / a["wall_s"] - 1 for a, b in zip(base, other)]
    mean, half, sd = _ci(walls)
    out["wall"] = {"mean": mean, "ci95_half_width": half, "sd": sd}
    ratios = [b["decode_s"] / a["decode_s"] - 1 for a, b in zip(base, other) if a["decode_s"]]
    if ratios:
        mean, half, sd = _ci(ratios)
        out["decode_ratio"] = {"mean": mean, "ci95_half_width": half, "sd": sd}
    for name, passes in (("base", base), ("other", other)):
        out[f"{name}_gc_s_per_pass"] = statistics.fmean(p["gc_s"] for p in passes)
        out[f"{name}_gen2_per_pass"] = statistics.fmean(p["gc_collections"][2] for p in passes)
    return out


def spread_text(s: dict, base: str, other: str) -> str:
    """The spread in words (percent of the base arm's wall per round)."""

    def pc(x: float) -> str:
        return f"{100 * x:+.2f}%"

    parts = "; ".join(
        f"{label} {pc(s[p]['mean'])} (sd {100 * s[p]['sd']:.2f}%)"
        for p, label in zip(
            PARTS, ("decode steps", "other steps", "outside steps", "of which collections")
        )
    )
    text = (
        f"Per round, {other} less {base}, as a share of {base}'s pass: {parts}; the whole pass "
        f"{pc(s['wall']['mean'])} (sd {100 * s['wall']['sd']:.2f}%)."
    )
    if "decode_ratio" in s:
        d = s["decode_ratio"]
        text += (
            f" Decode steps alone, {other} over {base}: {pc(d['mean'])} (95% confidence "
            f"interval {pc(d['mean'] - d['ci95_half_width'])} to "
            f"{pc(d['mean'] + d['ci95_half_width'])})."
        )
    text += (
        f" Collections per pass: {s['base_gc_s_per_pass'] * 1000:.1f} ms and "
        f"{s['base_gen2_per_pass']:.2f} full ({base}), {s['other_gc_s_per_pass'] * 1000:.1f} ms "
        f"and {s['other_gen2_per_pass']:.2f} full ({other})."
    )
    return text
