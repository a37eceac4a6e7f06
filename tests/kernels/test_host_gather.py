"""The gather kernel of engine-driven loads (atom/kernels/host_gather.py): runs of host words
land at their destination offsets, nothing else is written. On CUDA (pinned source and table,
through ``HostGather``) or on CPU under Triton's interpreter (the kernel itself; CI has
neither)."""

import pytest
import torch

from atom.kernels.host_gather import aligned
from tests.kernels.runnable import DEVICE, needs_kernel


def _runs(src: torch.Tensor):
    """Three runs of words of ``src``: lengths not multiples of the kernel's block, one longer
    than a block, out of order in the destination."""
    base = src.data_ptr()
    return [(base + 4 * 8, 100, 36), (base + 4 * 4096, 0, 5000), (base, 9000, 12)]


def _expected(src: torch.Tensor, runs, size: int) -> torch.Tensor:
    out = torch.full((size,), -1, dtype=torch.int32)
    base = src.data_ptr()
    for a, d, n in runs:
        w = (a - base) // 4
        out[d : d + n] = src[w : w + n]
    return out


def test_alignment_is_checked_on_addresses_and_lengths():
    assert aligned([0, 32, 4096], [16, 64])
    assert not aligned([0, 8], [16])
    assert not aligned([0], [20])


@needs_kernel
def test_the_kernel_copies_each_run_to_its_place():
    from atom.kernels import _host_gather_triton as k

    src = torch.arange(20000, dtype=torch.int32)
    if DEVICE == "cuda":
        src = src.pin_memory()
    runs = _runs(src)
    dst = torch.full((12000,), -1, dtype=torch.int32, device=DEVICE)
    if DEVICE == "cuda":
        from atom.kernels.host_gather import HostGather

        g = HostGather()
        table = g.issue(runs, dst, torch.cuda.current_stream())
        torch.cuda.synchronize()
        assert table.is_pinned() and g.launches == 1
    else:
        table = torch.tensor([v for r in runs for v in r], dtype=torch.int64)
        k.gather(table, len(runs), max(n for _, _, n in runs), dst)
    assert torch.equal(dst.cpu(), _expected(src, runs, 12000))


@pytest.mark.skipif(DEVICE != "cuda", reason="registered host memory read by the GPU")
def test_a_registered_buffer_is_read_by_the_kernel():
    """The L1 mapping is registered memory (cudaHostRegister with the locator's flags), not a
    pinned allocation; the kernel reads it at the device's address for it."""
    from atom.kernels.host_gather import HostGather
    from atom.tier.worker_side.cuda_copy import device_address
    from atom.tier.worker_side.locator import CUDA_HOST_REGISTER_FLAGS

    cudart = torch.cuda.cudart()
    buf = torch.arange(8192, dtype=torch.int32)
    rc = cudart.cudaHostRegister(buf.data_ptr(), buf.numel() * 4, CUDA_HOST_REGISTER_FLAGS)
    assert int(rc) == 0
    try:
        base = device_address(buf.data_ptr())
        assert base
        dst = torch.zeros(4096, dtype=torch.int32, device="cuda")
        HostGather().issue([(base + 64, 0, 4096)], dst, torch.cuda.current_stream())
        torch.cuda.synchronize()
        assert torch.equal(dst.cpu(), buf[16 : 16 + 4096])
    finally:
        cudart.cudaHostUnregister(buf.data_ptr())
