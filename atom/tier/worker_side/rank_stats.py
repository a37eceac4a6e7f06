"""Per-rank numbers of a tensor-parallel tier (``RankedTransfers.stats``): parts ended by kind,
how load parts moved, failures, bytes and latencies, summarized for /health and the
benchmarks."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class RankStats:
    """One rank's transfers: parts ended, bytes moved, latencies (seconds, newest 4096)."""

    parts: dict[str, int] = field(default_factory=lambda: {"load": 0, "save": 0})
    # load parts by how they moved: "copied" (from the server's L1 by this rank), "refused"
    # (a located copy this rank could not make: the op failed), "retrieved" (the server's)
    loads: dict[str, int] = field(
        default_factory=lambda: {"copied": 0, "refused": 0, "retrieved": 0}
    )
    failed: dict[str, int] = field(default_factory=lambda: {"load": 0, "save": 0})
    bytes: dict[str, int] = field(default_factory=lambda: {"load": 0, "save": 0})
    latency_s: dict[str, deque] = field(
        default_factory=lambda: {"load": deque(maxlen=4096), "save": deque(maxlen=4096)}
    )

    def record(
        self, kind: str, ok: bool, nbytes: int, latency_s: float | None, how: str = ""
    ) -> None:
        self.parts[kind] += 1
        if kind == "load" and (how or ok):
            self.loads[how or "retrieved"] += 1
        if not ok:
            self.failed[kind] += 1
            return
        self.bytes[kind] += nbytes
        if latency_s is not None:
            self.latency_s[kind].append(latency_s)

    def summary(self) -> dict:
        out = {"parts": dict(self.parts), "failed": dict(self.failed), "bytes": dict(self.bytes)}
        out["loads"] = dict(self.loads)
        for kind, xs in self.latency_s.items():
            if xs:
                s = sorted(xs)
                out[f"{kind}_ms_p50"] = round(1e3 * s[len(s) // 2], 3)
                out[f"{kind}_ms_p99"] = round(1e3 * s[min(len(s) - 1, int(0.99 * len(s)))], 3)
        return out
