"""Where a serving run's wall time goes: every engine step timed and classified by what it ran.

Steps are ``decode`` (every span one token, or one token and the drafts it verifies),
``prefill`` (no such span) or ``mixed``.
Comparing one kind across arms separates a slower forward (contention: the same step costs
more) from a different mix of steps; wall time outside steps is the loop waiting for loads or
lookups with nothing to run. With ``busy`` (sampled as each step starts: the tier has a
transfer or lookup in flight) each kind is also split into steps that ran beside tier work and
steps that did not, which tells contention with transfers from a slower forward overall.

Each step also records the step thread's own CPU time and the other threads' (the process's
CPU time less the step thread's) while it ran. The step thread spins while it waits on the
device (CUDA's default sync), so its wall time less its CPU time is time it was blocked:
waiting for the interpreter lock another thread held, or in a blocking call. Against an arm
without the tier, ``off_cpu_ms`` rising with ``others_cpu_ms`` in the same steps is the tier's
threads taking the interpreter from the step thread; a step slower at the same off-CPU time is
a slower forward (the device, or the step thread's own work).
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
        self.cpu: list[tuple[float, float]] = []  # per row: (step thread CPU s, others CPU s)
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
            c0, p0 = time.thread_time(), time.process_time()
            t0 = time.perf_counter()
            finished = inner_step()
            dt = time.perf_counter() - t0
            mine, everyone = time.thread_time() - c0, time.process_time() - p0
            out = last.pop() if last else None
            if out is not None and out.spans:
                # a verify span is one decode position plus its drafts
                sizes = [sp.end - sp.start - len(sp.drafts) for sp in out.spans]
                single = sum(1 for n in sizes if n == 1)
                prefill = sum(n for n in sizes if n > 1)
                kind = "decode" if not prefill else "prefill" if not single else "mixed"
                self.rows.append((dt, kind, len(out.spans), prefill, tier_busy))
                self.cpu.append((mine, max(0.0, everyone - mine)))
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
            idx = [i for i, r in enumerate(self.rows) if r[1] == kind]
            if not idx:
                continue
            rows = [self.rows[i] for i in idx]
            secs = [r[0] for r in rows]
            off = [max(0.0, self.rows[i][0] - self.cpu[i][0]) for i in idx]
            others = [self.cpu[i][1] for i in idx]
            res[kind] = {
                "steps": len(rows),
                "p50_ms": round(1000 * pct(secs, 50), 2),
                "mean_ms": round(1000 * statistics.fmean(secs), 2),
                "mean_spans": round(statistics.fmean(r[2] for r in rows), 2),
                "mean_prefill_tokens": round(statistics.fmean(r[3] for r in rows), 1),
                "total_s": round(sum(secs), 3),
                "off_cpu_ms": {"p50": round(1000 * pct(off, 50), 3),
                               "mean": round(1000 * statistics.fmean(off), 3)},
                "others_cpu_ms": {"p50": round(1000 * pct(others, 50), 3),
                                  "mean": round(1000 * statistics.fmean(others), 3)},
            }  # fmt: skip
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
                    + [k.get("off_cpu_ms", {}).get("mean", ""), k.get("others_cpu_ms", {}).get(
                        "mean", "")]
                )  # fmt: skip
        if "outside_steps_s" in log:
            rows.append(
                [arm["arm"], "outside steps"] + [""] * 5 + [log["outside_steps_s"]] + [""] * 5
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
    "step thread off CPU, mean ms",
    "other threads CPU, mean ms",
]
