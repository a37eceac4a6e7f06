"""Counters, gauges and histograms, rendered in the Prometheus text format.

Small on purpose: thread-safe increments from the step and transfer threads, one registry per
engine (tests run several engines in one process), no global state.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable

LATENCY_BUCKETS_S = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


def _labels(pairs: tuple[tuple[str, str], ...]) -> str:
    if not pairs:
        return ""
    inner = ",".join(f'{k}="{v}"' for k, v in pairs)
    return "{" + inner + "}"


class Counter:
    def __init__(self, name: str, help_: str):
        self.name, self.help = name, help_
        self._values: dict[tuple, float] = {}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self._values.get(tuple(sorted(labels.items())), 0.0)

    def total(self) -> float:
        return sum(self._values.values())

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        for key, v in sorted(self._values.items()):
            lines.append(f"{self.name}{_labels(key)} {v:g}")
        return lines


class Gauge:
    """A value read at render time from a callable (queue depths, pool occupancy); with
    kind="counter" it exposes a monotonic count kept elsewhere."""

    def __init__(
        self,
        name: str,
        help_: str,
        read: Callable[[], dict[tuple, float] | float],
        kind: str = "gauge",
    ):
        self.name, self.help, self.read, self.kind = name, help_, read, kind

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        value = self.read()
        items = value.items() if isinstance(value, dict) else [((), value)]
        for key, v in items:
            lines.append(f"{self.name}{_labels(tuple(key))} {v:g}")
        return lines


class Histogram:
    def __init__(self, name: str, help_: str, buckets: tuple[float, ...] = LATENCY_BUCKETS_S):
        self.name, self.help, self.buckets = name, help_, tuple(buckets)
        self._series: dict[tuple, list] = {}  # labels -> [bucket counts, sum, count, samples]
        self._lock = threading.Lock()

    def observe(self, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            s = self._series.setdefault(key, [[0] * len(self.buckets), 0.0, 0, []])
            i = bisect.bisect_left(self.buckets, value)
            if i < len(self.buckets):
                s[0][i] += 1
            s[1] += value
            s[2] += 1
            if len(s[3]) < 100_000:
                s[3].append(value)

    def observe_by(self, label: str, values: dict) -> None:
        """One observation per entry of ``values`` ({label value: value}), e.g. one per phase."""
        for key, value in values.items():
            self.observe(value, **{label: key})

    def samples(self, **labels: str) -> list[float]:
        s = self._series.get(tuple(sorted(labels.items())))
        return list(s[3]) if s else []

    def count(self, **labels: str) -> int:
        s = self._series.get(tuple(sorted(labels.items())))
        return s[2] if s else 0

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for key, (counts, total, n, _) in sorted(self._series.items()):
            acc = 0
            for b, c in zip(self.buckets, counts):
                acc += c
                lines.append(f"{self.name}_bucket{_labels(key + (('le', f'{b:g}'),))} {acc}")
            lines.append(f"{self.name}_bucket{_labels(key + (('le', '+Inf'),))} {n}")
            lines.append(f"{self.name}_sum{_labels(key)} {total:g}")
            lines.append(f"{self.name}_count{_labels(key)} {n}")
        return lines


class Registry:
    def __init__(self, prefix: str = "atom_"):
        self.prefix = prefix
        self._metrics: dict[str, Counter | Gauge | Histogram] = {}

    def counter(self, name: str, help_: str) -> Counter:
        return self._add(Counter(self.prefix + name, help_))

    def histogram(self, name: str, help_: str, buckets=LATENCY_BUCKETS_S) -> Histogram:
        return self._add(Histogram(self.prefix + name, help_, buckets))

    def gauge(self, name: str, help_: str, read, kind: str = "gauge") -> Gauge:
        return self._add(Gauge(self.prefix + name, help_, read, kind))

    def _add(self, metric):
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} registered twice")
        self._metrics[metric.name] = metric
        return metric

    def render(self) -> str:
        lines: list[str] = []
        for m in self._metrics.values():
            lines.extend(m.render())
        return "\n".join(lines) + "\n"
