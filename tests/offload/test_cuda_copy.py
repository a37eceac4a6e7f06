"""How RawCopier (cuda_copy.py) issues a load's or a save's copies: one batched runtime call
for several copies, one call per copy without batching, and what a refusal falls back to.
The runtime's calls are recording fakes here (a refusal cannot be produced on cue by a real
runtime); tests/gpu/test_cuda_paths.py runs the real ones."""

from __future__ import annotations

import ctypes

import pytest

from atom.tier.worker_side.cuda_copy import HOST_TO_DEVICE, RawCopier, cuda_memcpy_batch_async

COPIES = [(1000, 10, 64), (2000, 90, 128), (5000, 300, 64)]  # (dst, src, bytes)


class Runtime:
    """Records what reached the runtime; refuses the calls it is told to."""

    def __init__(self, refuse_batch: bool = False, refuse_single_at: int | None = None):
        self.refuse_batch, self.refuse_single_at = refuse_batch, refuse_single_at
        self.batches: list[list[tuple[int, int, int]]] = []
        self.singles: list[tuple[int, int, int, int, int]] = []

    def batch(self, dsts, srcs, sizes, count, stream) -> int:
        if self.refuse_batch:
            return 1  # cudaErrorInvalidValue
        self.batches.append([(dsts[i], srcs[i], sizes[i]) for i in range(count)] + [stream])
        return 0

    def single(self, dst, src, n, kind, stream) -> int:
        if self.refuse_single_at is not None and len(self.singles) == self.refuse_single_at:
            return 1
        self.singles.append((dst, src, n, kind, stream))
        return 0


def test_several_copies_are_one_batched_call_with_every_pointer_and_size():
    rt = Runtime()
    raw = RawCopier(rt.single, rt.batch)
    assert raw.issue(7, COPIES, HOST_TO_DEVICE)
    assert rt.batches == [COPIES + [7]] and rt.singles == []
    assert (raw.launches, raw.batched) == (1, 1)


def test_one_copy_is_a_single_call():
    rt = Runtime()
    raw = RawCopier(rt.single, rt.batch)
    assert raw.issue(7, COPIES[:1], HOST_TO_DEVICE)
    assert rt.batches == [] and rt.singles == [(1000, 10, 64, HOST_TO_DEVICE, 7)]
    assert (raw.launches, raw.batched) == (1, 0)


def test_without_batching_each_copy_is_its_own_call():
    rt = Runtime()
    raw = RawCopier(rt.single, None)
    assert raw.issue(3, COPIES, HOST_TO_DEVICE)
    assert [c[:3] for c in rt.singles] == COPIES and raw.launches == 3


def test_a_refused_batch_issues_the_same_copies_one_by_one_and_stops_batching(caplog):
    rt = Runtime(refuse_batch=True)
    raw = RawCopier(rt.single, rt.batch, what="loads")
    assert raw.issue(3, COPIES, HOST_TO_DEVICE)
    assert [c[:3] for c in rt.singles] == COPIES
    assert raw.batch is None and (raw.launches, raw.batched) == (3, 0)
    assert "cudaMemcpyBatchAsync refused (error 1): loads are issued one by one" in caplog.text
    assert raw.issue(3, COPIES, HOST_TO_DEVICE) and len(rt.singles) == 6  # no second try


def test_a_refused_single_copy_hands_the_plan_back_and_disables_the_copier(caplog):
    rt = Runtime(refuse_single_at=1)
    raw = RawCopier(rt.single, None, what="saves")
    assert raw.issue(3, COPIES, HOST_TO_DEVICE) is False
    assert "cudaMemcpyAsync refused (error 1): saves copy through torch" in caplog.text
    assert not raw.available and raw.issue(3, COPIES, HOST_TO_DEVICE) is False


def test_without_a_runtime_nothing_is_issued():
    raw = RawCopier()
    assert not raw.available and raw.issue(3, COPIES, HOST_TO_DEVICE) is False


def test_the_batch_binding_is_absent_or_takes_the_runtimes_arguments():
    """Without a CUDA runtime (CPU CI) there is no binding; with one, the attribute struct
    is the runtime's 24 bytes (access order, two location hints, flags)."""
    from atom.tier.worker_side.cuda_copy import _MemcpyAttributes

    assert ctypes.sizeof(_MemcpyAttributes) == 24
    batch = cuda_memcpy_batch_async()
    if batch is None:
        pytest.skip("no CUDA runtime with cudaMemcpyBatchAsync here")
    assert callable(batch)
