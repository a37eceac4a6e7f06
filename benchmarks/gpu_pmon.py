"""Per-process GPU utilization while a pass runs: ``nvidia-smi pmon`` in the background.

Which processes ran kernels on the GPU, and how much (SM %, sampled once a second by the
driver): the idle-tier question is whether the owned LMCache server's CUDA context takes a
share of the GPU (time-slicing between processes) while the engine serves. Without
``nvidia-smi`` (CPU hosts) the readings are empty.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess


class PerProcessGpu:
    """``with PerProcessGpu() as gpu: ...`` then ``gpu.sm_pct(pid)``: that process's SM %
    samples while the block ran (``[]`` when it never showed, or without nvidia-smi)."""

    def __init__(self, interval_s: int = 1):
        self.interval_s = interval_s
        self.lines: list[str] = []
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> PerProcessGpu:
        exe = shutil.which("nvidia-smi")
        if exe is not None:
            self._proc = subprocess.Popen(
                [exe, "pmon", "-s", "u", "-d", str(self.interval_s)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            out, _ = self._proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, _ = self._proc.communicate()
        self.lines = [ln for ln in out.splitlines() if ln.strip() and not ln.startswith("#")]

    def sm_pct(self, pid: int) -> list[float]:
        """SM % samples of ``pid`` (columns: gpu, pid, type, sm, mem, ...; '-' is 0)."""
        got = []
        for ln in self.lines:
            cols = ln.split()
            if len(cols) > 3 and cols[1] == str(pid):
                got.append(0.0 if cols[3] == "-" else float(cols[3]))
        return got

    def summary(self, pids: dict[str, int]) -> dict:
        """{name: {"samples": n, "sm_pct_mean": m, "sm_pct_max": x}} for each named pid."""
        out = {}
        for name, pid in pids.items():
            s = self.sm_pct(pid)
            out[name] = {
                "samples": len(s),
                "sm_pct_mean": round(statistics.mean(s), 2) if s else None,
                "sm_pct_max": max(s) if s else None,
            }
        return out
