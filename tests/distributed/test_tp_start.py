"""A tensor-parallel start fails in seconds, saying why, when a rank does not join (CPU, gloo).

- A script that starts a TP=2 engine without the ``if __name__ == "__main__":`` guard: the
  spawned rank imports it again and would start an engine of its own. The script exits
  non-zero within 60 s (torch's rendezvous waited 601 s), its last line naming the guard.
- The bounded wait itself, on a fake clock: a rank that never joins fails the wait at its
  deadline with the ranks that are missing and the setting to raise; a rank process that
  exited fails it at once with its exit code.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass

import pytest

from atom.config import EngineConfigError
from atom.distributed.rendezvous import REIMPORT_EXIT, Rendezvous, TensorParallelStartError, join
from tests.distributed.test_tp_engine import KW


def test_a_script_without_the_main_guard_fails_fast_naming_the_guard(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(textwrap.dedent(f"""
        from atom import LLM, SamplingParams
        llm = LLM("v41-tiny", tensor_parallel_size=2, **{KW!r})
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
        print("GENERATED", flush=True)
    """))
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    took = time.monotonic() - t0
    last = r.stderr.strip().splitlines()[-1]
    print(f"guard-less TP=2 script exited {r.returncode} after {took:.1f} s: {last}")
    assert r.returncode != 0 and "GENERATED" not in r.stdout
    assert took < 60, f"took {took:.0f} s to fail"
    assert "TensorParallelStartError" in last and f"exited with code {REIMPORT_EXIT}" in last
    assert 'if __name__ == "__main__":' in last and str(script) in last


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0  # one second per reading: the wait's deadline comes in a few polls
        return self.now


@dataclass
class FakeProc:
    pid: int = 4242
    exitcode: int | None = None


def test_a_rank_that_never_joins_fails_the_wait_at_its_deadline():
    rdv = Rendezvous(3, timeout_s=5.0)
    join(rdv.address, 1, 3, 5.0)  # rank 1 joins, rank 2 never does
    with pytest.raises(TensorParallelStartError, match=r"rank\(s\) \[2\] did not join within 5 s"):
        rdv.wait_joined([FakeProc(), FakeProc()], clock=FakeClock(), poll_s=0.0)


@pytest.mark.parametrize(
    "code, needle",
    [
        (REIMPORT_EXIT, 'if __name__ == "__main__":'),
        (-9, "exited with code -9 before joining the group"),
    ],
)
def test_a_rank_that_exited_fails_the_wait_at_once(code, needle):
    rdv = Rendezvous(2, timeout_s=600.0)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelStartError, match="rank 1 .pid 4242. exited") as err:
        rdv.wait_joined([FakeProc(exitcode=code)])
    assert time.monotonic() - t0 < 5 and needle in str(err.value)


def test_every_rank_joined_ends_the_wait():
    rdv = Rendezvous(2, timeout_s=5.0)
    join(rdv.address, 1, 2, 5.0)
    rdv.wait_joined([FakeProc()], clock=FakeClock(), poll_s=0.0)  # returns


@pytest.mark.parametrize("bad", [0, -1.0, float("inf")])
def test_the_start_timeout_must_be_a_positive_number_of_seconds(bad):
    from atom import LLM

    with pytest.raises(EngineConfigError, match="tensor_parallel_start_timeout_s"):
        LLM("v41-tiny", tensor_parallel_size=2, tensor_parallel_start_timeout_s=bad, **KW)
