"""One-shot all-reduce for small CUDA tensors, through torch's symmetric memory.

A decode step's all-reduces are small (the attention's and the MoE's outputs, [batch, hidden]
in float32: 256 KiB at batch 16 and hidden 4096) and there are two per layer, so their cost is
latency, not bandwidth. NCCL's ring all-reduce takes several steps between the GPUs; the
one-shot kernel (``torch.ops.symm_mem.one_shot_all_reduce_copy``) takes one: every rank copies
its input into a buffer that every rank has mapped (``symmetric_memory.empty`` +
``rendezvous``), the ranks meet at a barrier of signal pads, and every rank reads all the
buffers over NVLink and sums them itself. It needs no NVLink multicast.

Every rank sums the ranks' values in rank order (0, 1, ..., N-1; torch's kernel loads each
rank's vector into a slot of its own and adds the slots in order), so every rank holds the same
bits, as the design of tensor parallelism requires (``split_models``). Over more than two
ranks the bits are not those of NCCL's sum (another order of additions; two values add the same
either way); a run is either one or the other, chosen at start.

Used for a tensor that fits ``max_bytes`` (decode and verify steps, small prefills), is float32
or bfloat16 and a whole number of 16-byte vectors; anything else goes through the group's own
all-reduce. The kernel runs inside CUDA graph captures like any other kernel, so a captured
decode step replays it. ``calls`` and ``fallbacks`` count what went which way.

Opt-in (``EngineConfig.tp_all_reduce: one_shot``) until two GPUs measure it against NCCL
(``bash benchmarks/gpu/run.sh tp_allreduce``)."""

from __future__ import annotations

import torch

#: the largest tensor summed one-shot: a decode step of 256 rows at hidden 8192 in float32
DEFAULT_MAX_BYTES = 8 << 20
_DTYPES = (torch.float32, torch.bfloat16)
_VECTOR = 16  # bytes the kernel moves per load


def one_shot_refusal(device) -> str:
    """Why ``tp_all_reduce=one_shot`` cannot run on ``device`` (a non-CUDA one); the config
    refuses CPU ranks with the same words (``atom.config_cross``)."""
    return (
        f"tp_all_reduce=one_shot with device={device}: the one-shot all-reduce needs CUDA ranks "
        "(torch's symmetric memory); CPU ranks sum over gloo: use tp_all_reduce=group"
    )


class OneShotUnavailable(RuntimeError):
    """The one-shot all-reduce cannot run here (what and why in the message)."""


class OneShotAllReduce:
    """The one-shot all-reduce of one process group, on this rank's CUDA ``device``.

    Every rank constructs it (it is a collective: the buffer's rendezvous) with the same
    ``max_bytes``, after the group exists; raises ``OneShotUnavailable`` where the device or the
    torch build cannot."""

    def __init__(self, group, device: torch.device | str, max_bytes: int = DEFAULT_MAX_BYTES):
        device = torch.device(device)
        if device.type != "cuda":
            raise OneShotUnavailable(one_shot_refusal(device))
        if max_bytes < _VECTOR or max_bytes % _VECTOR:
            raise ValueError(f"max_bytes={max_bytes}: a positive multiple of {_VECTOR}")
        try:
            import torch.distributed._symmetric_memory as symm_mem

            ops = torch.ops.symm_mem
            # the copy into the buffer inside the kernel where torch has it, else a copy first
            copying = getattr(ops, "one_shot_all_reduce_copy", None)
            plain = None if copying is not None else ops.one_shot_all_reduce
        except (ImportError, AttributeError, RuntimeError) as e:
            raise OneShotUnavailable(
                f"tp_all_reduce=one_shot: torch {torch.__version__} has no symmetric-memory "
                f"one-shot all-reduce ({e}); use tp_all_reduce=group"
            ) from e
        self.group_name = group.group_name
        self.max_bytes = max_bytes
        self._copying, self._plain = copying, plain
        # float32 words: every accepted tensor is a view of its first bytes
        self._buffer = symm_mem.empty(max_bytes // 4, dtype=torch.float32, device=device)
        symm_mem.rendezvous(self._buffer, self.group_name)
        self.calls = 0
        self.fallbacks = 0

    def accepts(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is summed one-shot: a CUDA tensor of a kernel dtype, within
        ``max_bytes``, in whole 16-byte vectors. Decided by shape and dtype alone, which every
        rank has the same (an address could differ between ranks, and a rank that chose the
        group's all-reduce while another chose this would wait for each other forever)."""
        nbytes = x.numel() * x.element_size()
        return (
            x.is_cuda
            and x.dtype in _DTYPES
            and 0 < nbytes <= self.max_bytes
            and nbytes % _VECTOR == 0
        )

    def reduce(self, x: torch.Tensor) -> torch.Tensor | None:
        """The sum of ``x`` over the ranks as a new tensor of ``x``'s shape, or None where
        ``x`` is not accepted (the caller sums it through the group). Every rank must make the
        same calls with the same shapes, as with any collective."""
        if not self.accepts(x):
            self.fallbacks += 1
            return None
        x = x.contiguous()
        if x.data_ptr() % _VECTOR:  # the kernel loads 16-byte vectors from it
            x = x.clone()
        staging = self._buffer.view(x.dtype)[: x.numel()]
        self.calls += 1
        if self._copying is not None:
            out = self._copying(staging, x.view(-1), "sum", self.group_name)
        else:
            staging.copy_(x.view(-1))
            out = self._plain(staging, "sum", self.group_name)
        return out.view(x.shape)
