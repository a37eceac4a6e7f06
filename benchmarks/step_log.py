"""Where a serving run's wall time goes: every engine step timed and classified by what it ran.

Steps are ``decode`` (every span one token, or one token and the drafts it verifies),
``prefill`` (no such span) or ``mixed``.
Comparing one kind across arms separates a slower forward (contention: the same step costs
more) from a different mix of steps; wall time outside steps is the loop waiting for loads or
lookups with nothing to run. With ``busy`` (sampled as each step starts: the tier has a
transfer or lookup in flight) each kind is also split into steps that ran beside tier work and
steps that did not, which tells contention with transfers from a slower forward overall.
"""

from __future__ import annotations

import statistics
import time

from benchmarks.workload import pct

KINDS = ("decode", "mixed", "prefill")


class StepLog:
    """Wraps ``engine.step`` and ``engine.scheduler.schedule`` of one engine (instance
    attributes: the class is untouched) and records (seconds, kind, spans, prefill tokens,
    busy)."""

    def __init__(self, engine, busy=None):
        self.rows: list[tuple[float, str, int, int, bool]] = []
        scheduler, inner_schedule, inner_step = (
            engine.scheduler,
            engine.scheduler.schedule,
            engine.step,
        )
        last: list = []

        def schedule():
            out = inner_schedule()
            last[:] = [out]
            return out

        def step():
            tier_busy = bool(busy()) if busy is not None else False
            t0 = time.perf_counter()
            finished = inner_step()
            dt = time.perf_counter() - t0
            out = last.pop() if last else None
            if out is not None and out.spans:
                # a verify span is one decode position plus its drafts
                sizes = [sp.end - sp.start - len(sp.drafts) for sp in out.spans]
                single = sum(1 for n in sizes if n == 1)
                prefill = sum(n for n in sizes if n > 1)
                kind = "decode" if not prefill else "prefill" if not single else "mixed"
                self.rows.append((dt, kind, len(out.spans), prefill, tier_busy))
            return finished

        scheduler.schedule = schedule
        engine.step = step
        self._engine = engine

    def detach(self) -> None:
        """Stop recording: the engine's own methods are back."""
        del self._engine.scheduler.schedule, self._engine.step

    def summary(self, wall_s: float) -> dict:
        res: dict = {}
        for kind in KINDS:
            rows = [r for r in self.rows if r[1] == kind]
            if not rows:
                continue
            secs = [r[0] for r in rows]
            res[kind] = {
                "steps": len(rows),
                "p50_ms": round(1000 * pct(secs, 50), 2),
                "mean_ms": round(1000 * statistics.fmean(secs), 2),
                "mean_spans": round(statistics.fmean(r[2] for r in rows), 2),
                "mean_prefill_tokens": round(statistics.fmean(r[3] for r in rows), 1),
                "total_s": round(sum(secs), 3),
            }
            beside = [r[0] for r in rows if r[4]]
            if beside:
                alone = [r[0] for r in rows if not r[4]]
                res[kind]["beside_tier_work"] = {
                    "steps": len(beside),
                    "p50_ms": round(1000 * pct(beside, 50), 2),
                    "alone_p50_ms": round(1000 * pct(alone, 50), 2) if alone else None,
                }
        in_steps = sum(r[0] for r in self.rows)
        res["outside_steps_s"] = round(wall_s - in_steps, 3)
        return res


def steps_table(arms: list[dict]) -> list[list]:
    """Rows (arm, kind, steps, p50 ms, mean ms, mean spans, mean prefill tokens, total s,
    steps beside tier work, their p50 ms, p50 ms of the others)."""
    rows = []
    for arm in arms:
        log = arm.get("step_kinds", {})
        for kind in KINDS:
            if kind in log:
                k = log[kind]
                side = k.get("beside_tier_work", {})
                rows.append(
                    [arm["arm"], kind, k["steps"], k["p50_ms"], k["mean_ms"], k["mean_spans"]]
                    + [k["mean_prefill_tokens"], k["total_s"]]
                    + [side.get("steps", ""), side.get("p50_ms", ""), side.get("alone_p50_ms", "")]
                )
        if "outside_steps_s" in log:
            rows.append(
                [arm["arm"], "outside steps"] + [""] * 5 + [log["outside_steps_s"]] + [""] * 3
            )
    return rows


STEPS_HEADER = [
    "arm",
    "step kind",
    "steps",
    "p50 ms",
    "mean ms",
    "mean spans",
    "mean prefill tokens",
    "total s",
    "beside tier work",
    "their p50 ms",
    "others p50 ms",
]
