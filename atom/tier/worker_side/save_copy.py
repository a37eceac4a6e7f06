"""The copy of an engine-driven save into the server's L1: the pool's blocks into the spans a
reservation gave (runs of (destination offset, source block, blocks)).

On CPU the copies are ``memmove`` calls, complete on return. On CUDA they are device-to-host copies
issued straight into the runtime (cuda_copy.py: one batched call per save where the runtime
has it) into the registered (pinned) mapping, on a copy stream of the
saves' own that first waits for the save's event (recorded after the forward that wrote the
blocks); an event recorded after them marks their end (torch's ``copy_`` where the mapping is
not registered or the runtime refuses a call).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from atom.tier.operations import TransferOp
from atom.tier.worker_side.cuda_copy import DEVICE_TO_HOST, RawCopier


class SaveCopy:
    """The transfer thread's copier of saves out of ``blocks`` ([num_blocks, block_bytes]
    uint8 view of the pool, on ``device``)."""

    def __init__(self, blocks: torch.Tensor, device: torch.device):
        self.blocks, self.bb = blocks, blocks.shape[1]
        self.cuda = torch.device(device).type == "cuda"
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._raw = RawCopier.of_runtime("saves") if self.cuda else RawCopier()
        self.bytes = 0  # copied so far

    def copy(self, op: TransferOp, plan: list, mapping) -> tuple[Any, str]:
        """Issue ``plan``: (None, "") when complete (CPU), else (the copy's CUDA event, "");
        an error instead of "" when it failed (on CUDA the event still marks the end of what
        was issued: the reservation is given back only after it)."""
        dst, src, bb = mapping.data, self.blocks, self.bb
        if not self.cuda:
            # memmove, not Tensor.copy_: torch splits a copy over its intra-op threads, and on
            # a host whose cores are busy (the step thread's forwards, the server) a 290 KB
            # block took 4-12 ms that way on this 2-core machine instead of ~0.05 ms; ctypes
            # releases the GIL for the call
            d0, s0 = dst.data_ptr(), src.data_ptr()
            try:
                for d, s, n in plan:
                    ctypes.memmove(d0 + d, s0 + s * bb, n * bb)
            except Exception as exc:
                return None, f"copy failed: {exc!r}"
            self.bytes += sum(n for _, _, n in plan) * bb
            return None, ""
        stream, error = self._stream, ""
        with torch.cuda.device(src.device), torch.cuda.stream(stream):
            try:
                if op.event is not None:
                    stream.wait_event(op.event)  # the forward that wrote the blocks
                if not self._raw_copies(stream, mapping, plan):
                    for d, s, n in plan:
                        dst[d : d + n * bb].copy_(src[s : s + n].view(-1), non_blocking=True)
            except Exception as exc:
                error = f"copy failed: {exc!r}"
            event = torch.cuda.Event()
            event.record(stream)
        mapping.in_flight += 1
        if not error:
            self.bytes += sum(n for _, _, n in plan) * bb
        return event, error

    def _raw_copies(self, stream, mapping, plan: list) -> bool:
        if not self._raw.available or not mapping.pinned:
            return False
        bb, d0, s0 = self.bb, mapping.data.data_ptr(), self.blocks.data_ptr()
        copies = [(d0 + d, s0 + s * bb, n * bb) for d, s, n in plan]
        return self._raw.issue(stream.cuda_stream, copies, DEVICE_TO_HOST)

    @property
    def launches(self) -> int:
        """Runtime calls that issued copies (one per save where batching works)."""
        return self._raw.launches
