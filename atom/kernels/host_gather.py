"""Copies out of host memory the GPU can address (pinned or registered, under unified virtual
addressing) into a device tensor, by a kernel: the SMs read the host bytes over the bus, so a
load of many separate pieces is one launch rather than one copy-engine call per piece (on an
H100 issuing a 28-chunk load's 29 copies in one ``cudaMemcpyBatchAsync`` took about 0.23 ms
in a burst of loads, and a serving load's issue 0.65 ms at the median).

``HostGather.issue(copies, dst_words, stream)`` takes (source address, destination word,
words) triples. Its table of copies lives in pinned host memory the kernel reads; the table
must outlive the kernel, so ``issue`` returns it and the caller holds it until the copy's
event fired, then hands it back (``release``) for a later issue: pinning a new table costs a
page-locked allocation on the issuing thread. The kernel reads
4-byte words: every source address and destination byte offset must be 16-byte aligned
(``aligned`` checks a plan first)."""

from __future__ import annotations

import array
import ctypes

import torch

_MIN_ROWS = 64  # the smallest table allocated (rows of three int64)


def aligned(addresses: list[int], lengths: list[int]) -> bool:
    """Whether every address and length is a multiple of 16 bytes."""
    return all(a % 16 == 0 for a in addresses) and all(n % 16 == 0 for n in lengths)


class HostGather:
    """Issues gathers on CUDA streams (``available`` False where Triton does not import)."""

    def __init__(self) -> None:
        try:
            from atom.kernels import _host_gather_triton as kernel
        except ImportError:
            kernel = None
        self._kernel = kernel
        self.launches = 0
        self._free: list[torch.Tensor] = []  # pinned tables whose kernels completed
        self.tables = 0  # tables allocated

    @property
    def available(self) -> bool:
        return self._kernel is not None

    def issue(
        self, copies: list[tuple[int, int, int]], dst_words: torch.Tensor, stream
    ) -> torch.Tensor:
        """Launch one kernel on ``stream`` copying each (source address, destination word
        offset in ``dst_words`` [int32, on the device], words); returns the pinned table the
        kernel reads (hold it until the stream is past the kernel)."""
        values = array.array("q", [v for c in copies for v in c])
        table = self._table(len(values))
        ctypes.memmove(table.data_ptr(), values.buffer_info()[0], len(values) * 8)
        with torch.cuda.stream(stream):
            self._kernel.gather(table, len(copies), max(c[2] for c in copies), dst_words)
        self.launches += 1
        return table

    def release(self, table: torch.Tensor) -> None:
        """Hand back a table ``issue`` returned, once its kernel completed."""
        self._free.append(table)

    def _table(self, n: int) -> torch.Tensor:
        """A pinned int64 table of at least ``n`` entries: a released one where one is large
        enough, else a new one (a power of two of rows)."""
        for i, t in enumerate(self._free):
            if t.numel() >= n:
                return self._free.pop(i)
        rows = max(_MIN_ROWS, 1 << (max(n // 3, 1) - 1).bit_length())
        self.tables += 1
        return torch.empty(3 * rows, dtype=torch.int64).pin_memory()
