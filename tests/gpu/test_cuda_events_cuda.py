"""The tier's events on a real CUDA runtime (cuda_events.StreamEvents): the runtime is reached
(so loads take the calls that keep the interpreter lock), an event recorded behind queued work
is not fired until that work is done, a stream that waits on it runs after it, and the time
between two events is the device's. And the gather kernel's pinned tables are reused."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_events_order_streams_and_time_the_work_between_them():
    from atom.tier.worker_side.cuda_events import StreamEvents

    ev = StreamEvents.of_device("cuda")
    assert ev.raw, "the CUDA runtime torch loaded was not reached"
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.zeros(1 << 20, device="cuda")
    start, end = ev.new(), ev.new()
    with torch.cuda.stream(a):
        ev.record(start, a)
        torch.cuda._sleep(50_000_000)  # tens of milliseconds of device time
        x.fill_(1.0)
        ev.record(end, a)
    assert ev.query(end) is False  # queued behind the sleep
    ev.wait(b, end)
    with torch.cuda.stream(b):
        y = x.clone()  # must see the fill: b waits on the event after it
    ev.synchronize(end)
    assert ev.query(end) is True
    torch.cuda.synchronize()
    assert bool((y == 1.0).all())
    assert ev.elapsed_ms(start, end) > 1.0
    ev.destroy(start)
    ev.destroy(end)


def test_the_gather_kernels_released_tables_are_reused():
    from atom.kernels.host_gather import HostGather

    g = HostGather()
    if not g.available:
        pytest.skip("Triton does not import")
    src = torch.arange(4096, dtype=torch.int32).pin_memory()
    dst = torch.zeros(4096, dtype=torch.int32, device="cuda")
    stream = torch.cuda.current_stream()
    first = g.issue([(src.data_ptr(), 0, 2048)], dst, stream)
    torch.cuda.synchronize()
    g.release(first)
    second = g.issue([(src.data_ptr() + 8192, 2048, 2048)], dst, stream)
    torch.cuda.synchronize()
    assert second.data_ptr() == first.data_ptr() and g.tables == 1
    big = g.issue([(src.data_ptr() + 16 * i, 0, 4) for i in range(200)], dst, stream)
    torch.cuda.synchronize()
    assert big.numel() >= 600 and g.tables == 2  # a larger table was needed
    assert torch.equal(dst.cpu()[4:2048], src[4:2048]) and torch.equal(dst.cpu()[2048:], src[2048:])


def test_a_recycled_interprocess_event_is_recorded_again_behind_new_work():
    """EventPool records a recycled event through the runtime (its handle): the event fires
    after the work queued before its new record, not at its old one."""
    from atom.tier.worker_side.events import EventPool

    pool = EventPool(torch.device("cuda"))
    first = pool.acquire()
    torch.cuda.synchronize()
    assert first.query()
    pool.recycle(first)
    torch.cuda._sleep(50_000_000)
    again = pool.acquire()
    assert again is first and pool.created == 1
    assert not again.query()  # recorded behind the sleep
    again.synchronize()
    assert again.query()
