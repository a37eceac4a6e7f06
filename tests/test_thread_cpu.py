"""Thread CPU readings (atom/thread_cpu.py): named, per thread, what each used."""

from __future__ import annotations

import threading
import time

from atom.thread_cpu import cpu_used, thread_cpu_seconds


def _spin(seconds: float) -> None:
    """Use about ``seconds`` of this thread's CPU (its own clock, not the wall)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_busy_thread_reads_what_it_used_and_a_blocked_one_reads_nothing():
    release, spun = threading.Event(), threading.Event()

    def busy():
        _spin(0.2)
        spun.set()
        release.wait()

    def blocked():
        release.wait()

    threads = [
        threading.Thread(target=busy, name="probe-busy"),
        threading.Thread(target=blocked, name="probe-blocked"),
    ]
    for t in threads:
        t.start()
    try:
        assert spun.wait(30)
        before = thread_cpu_seconds()
        _spin(0.05)  # the reading thread's own use does not land on the others
        used = cpu_used(before, thread_cpu_seconds())
    finally:
        release.set()
        for t in threads:
            t.join()
    assert before["probe-busy"] >= 0.2
    assert before["probe-blocked"] < 0.05
    assert used["probe-busy"] < 0.01 and used["probe-blocked"] < 0.01
    assert used[threading.current_thread().name] >= 0.05


def test_threads_python_does_not_know_are_read_by_their_kernel_names():
    import torch

    torch.set_num_threads(2)
    a = torch.randn(256, 256)
    for _ in range(20):  # starts torch's intra-op pool (threads outside ``threading``)
        a = (a @ a).tanh()
    reading = thread_cpu_seconds()
    python_names = {t.name for t in threading.enumerate()}
    assert threading.current_thread().name in reading
    assert all(v >= 0 for v in reading.values())
    assert set(reading) - python_names  # at least one thread read from /proc, by its comm


def test_cpu_used_never_reads_negative():
    assert cpu_used({"a": 2.0, "gone": 1.0}, {"a": 1.5, "new": 0.25}) == {"a": 0.0, "new": 0.25}


def test_per_process_gpu_reads_each_pids_sm_samples():
    """nvidia-smi pmon's lines (gpu, pid, type, sm, mem, ...): a pid's SM % samples, '-' as 0;
    without nvidia-smi (this host) a pass reads nothing."""
    from benchmarks.gpu_pmon import PerProcessGpu

    gpu = PerProcessGpu()
    gpu.lines = [
        "    0     4242     C    87    40     -     -     -     -    python3",
        "    0     5151     C     -     -     -     -     -     -    python3",
        "    0     4242     C    91    42     -     -     -     -    python3",
        "    0     5151     C     3     1     -     -     -     -    python3",
    ]
    assert gpu.sm_pct(4242) == [87.0, 91.0] and gpu.sm_pct(5151) == [0.0, 3.0]
    got = gpu.summary({"engine": 4242, "server": 5151, "gone": 1})
    assert got["engine"] == {"samples": 2, "sm_pct_mean": 89.0, "sm_pct_max": 91.0}
    assert got["server"]["sm_pct_mean"] == 1.5 and got["gone"]["samples"] == 0
    import shutil

    if shutil.which("nvidia-smi") is None:
        with PerProcessGpu() as idle:
            pass
        assert idle.lines == []
