"""A decode batch's window keys read where they lie (``RingWindow``): the form
``sink_attention_decode`` takes in place of gathered [T, L, D] keys. Its own module so that the
kernel's launcher and the attention wrapper both import it without importing each other; with
it, ``gather_offsets`` (rows of a plane at element offsets, as the kernels read them)."""

from __future__ import annotations

from typing import NamedTuple

import torch


def gather_offsets(offsets: torch.Tensor, plane: torch.Tensor) -> torch.Tensor:
    """Rows of ``plane`` at element ``offsets`` [T, K] -> [T, K, D] (what the kernel reads;
    for tests: it reads the largest offset on the host)."""
    d = plane.shape[-1]
    n = int(offsets.max()) + d if offsets.numel() else 0
    flat = plane.as_strided((n,), (1,))  # from plane's first element
    return flat[offsets[..., None] + torch.arange(d, device=offsets.device)]


class RingWindow(NamedTuple):
    """A decode batch's window keys where they lie, for ``sink_attention_decode``: row t's keys
    are the rows of ``plane`` (a tensor whose rows of D are contiguous: a layer's window ring)
    at element offsets ``offsets[t]`` [T, L - 1] int64 from plane's first element (the
    positions before the row's), then ``own[t]`` [T, D] (its own key). The kernel reads them
    in place of a [T, L, D] gather and concatenation; the keys are the same."""

    plane: torch.Tensor
    offsets: torch.Tensor
    own: torch.Tensor

    def keys(self) -> torch.Tensor:
        """The [T, L, D] keys, materialized in ``own``'s dtype (the torch path; tests)."""
        ring = gather_offsets(self.offsets, self.plane).to(self.own.dtype)
        return torch.cat([ring, self.own[:, None]], 1)
