"""Copies between the pool and a registered (pinned) L1 mapping, issued straight into the CUDA
runtime that torch loaded, in as few calls as the runtime allows.

``RawCopier.issue(stream, copies, kind)`` puts a list of (dst pointer, src pointer, bytes)
copies on ``stream``:
  * one ``cudaMemcpyBatchAsync`` call for the whole list where the runtime has it (CUDA 12.8
    and later): the copies of a load or a save (one per run of contiguous blocks; a 28-chunk
    load has 29) are one launch rather than one call each, ordered after the stream's earlier
    work and unordered among themselves (their destinations never overlap);
  * else one ``cudaMemcpyAsync`` per copy (about 20 us less each than ``Tensor.copy_``).
A refused batch call disables batching for this copier (logged once) and the same copies are
issued one by one; a refused single copy returns False and the caller copies through torch
(the bytes are the same, a copy issued twice is harmless).

``launches`` counts the runtime calls made, ``batched`` the calls that carried several copies.
"""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger("atom.offload")

HOST_TO_DEVICE = 1
DEVICE_TO_HOST = 2

# cudaMemcpySrcAccessOrderStream: the source is read in stream order (a save's blocks are
# written by the forward the copy stream waited for)
_SRC_ACCESS_ORDER_STREAM = 1
# cudaMemcpyFlagPreferOverlapWithCompute: copy engines, not SMs (the step's forward runs beside)
_PREFER_OVERLAP_WITH_COMPUTE = 1

_RUNTIMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """cudaMemcpyAttributes (CUDA 12.8+): access order, two location hints (none), flags."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


def _open_runtime(loader):
    """The CUDA runtime torch loaded, opened with ``loader`` (``ctypes.CDLL`` or ``PyDLL``), or
    None where it cannot be reached."""
    for name in _RUNTIMES:
        try:
            lib = loader(name)
            lib.cudaMemcpyAsync  # noqa: B018 - probes that this is a CUDA runtime
            return lib
        except (OSError, AttributeError):
            continue
    return None


@functools.cache
def runtime():
    """The CUDA runtime torch loaded (opened once; its calls let go of the interpreter lock),
    or None."""
    return _open_runtime(ctypes.CDLL)


def clear_cuda_error() -> None:
    """Reset the runtime's last error after a refused call, so torch's next launch check does
    not report it (torch.cuda.cudart() has no cudaGetLastError)."""
    lib = runtime()
    if lib is not None:
        lib.cudaGetLastError()


@functools.cache
def locked_runtime():
    """The same runtime opened so that its calls keep the interpreter lock (``ctypes.PyDLL``),
    or None: for calls that return at once (a copy's or an event's issue). A call that lets go
    of the lock waits to get it back for as long as a thread that took it meanwhile keeps it:
    beside a thread running Python in 1 ms bursts, a foreign call of 80 us took 1060 us at the
    median letting go and 89 us keeping the lock (benchmarks/gil_handoff.py, on a 2-core
    host). The step thread issues loads while the tier's lookup thread and LMCache's client
    loop run Python."""
    return _open_runtime(ctypes.PyDLL)


def device_address(host_ptr: int) -> int | None:
    """The device's address of registered (mapped) or pinned host memory at ``host_ptr``
    (cudaHostGetDevicePointer), or None where the runtime cannot say."""
    lib = runtime()
    if lib is None:
        return None
    out = ctypes.c_void_p(0)
    rc = lib.cudaHostGetDevicePointer(ctypes.byref(out), ctypes.c_void_p(host_ptr), 0)
    if rc != 0:
        clear_cuda_error()
        return None
    return out.value


def cuda_memcpy_async():
    """The runtime's cudaMemcpyAsync(dst, src, bytes, kind, stream), or None (keeps the
    interpreter lock: ``locked_runtime``)."""
    lib = locked_runtime()
    if lib is None:
        return None
    fn = lib.cudaMemcpyAsync
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.argtypes += [ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def cuda_memcpy_batch_async():
    """``batch(dsts, srcs, sizes, count, stream) -> error code`` over the runtime's
    cudaMemcpyBatchAsync, or None where the runtime lacks it (before CUDA 12.8). CUDA 12.x
    takes a failure-index pointer before the stream; CUDA 13 dropped it. Keeps the
    interpreter lock (``locked_runtime``)."""
    lib = locked_runtime()
    if lib is None:
        return None
    try:
        fn = lib.cudaMemcpyBatchAsync
    except AttributeError:
        return None
    version = ctypes.c_int(0)
    if lib.cudaRuntimeGetVersion(ctypes.byref(version)) != 0 or version.value < 12080:
        return None
    ptrs, sizes = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)
    args = [ptrs, ptrs, sizes, ctypes.c_size_t, ctypes.POINTER(_MemcpyAttributes), sizes]
    args.append(ctypes.c_size_t)
    with_fail_index = version.value < 13000
    if with_fail_index:
        args.append(sizes)
    fn.argtypes = args + [ctypes.c_void_p]
    fn.restype = ctypes.c_int
    attrs = _MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM, flags=_PREFER_OVERLAP_WITH_COMPUTE)
    index = (ctypes.c_size_t * 1)(0)  # attrs[0] applies from copy 0 on

    def batch(dsts, srcs, sizes_, count: int, stream: int) -> int:
        if with_fail_index:
            failed = (ctypes.c_size_t * 1)(0)
            return fn(dsts, srcs, sizes_, count, ctypes.byref(attrs), index, 1, failed, stream)
        return fn(dsts, srcs, sizes_, count, ctypes.byref(attrs), index, 1, stream)

    return batch


class RawCopier:
    """Issues copies into the CUDA runtime; ``single`` and ``batch`` are the runtime's calls
    (``cuda_memcpy_async()``, ``cuda_memcpy_batch_async()``; tests pass their own)."""

    def __init__(self, single=None, batch=None, *, what: str = "copies"):
        self.single, self.batch, self.what = single, batch, what
        self.launches = 0
        self.batched = 0

    @classmethod
    def of_runtime(cls, what: str, batch: bool = True) -> RawCopier:
        """The runtime's calls; ``batch=False`` issues one call per copy (for comparison)."""
        return cls(cuda_memcpy_async(), cuda_memcpy_batch_async() if batch else None, what=what)

    @property
    def available(self) -> bool:
        return self.single is not None

    def issue(self, stream: int, copies: list[tuple[int, int, int]], kind: int) -> bool:
        """Put ``copies`` ((dst, src, bytes) pointers) on the stream whose handle is
        ``stream``; False (nothing more to do here) when the runtime refused a copy."""
        if self.single is None:
            return False
        if len(copies) > 1 and self.batch is not None:
            n = len(copies)
            dsts = (ctypes.c_void_p * n)(*(d for d, _, _ in copies))
            srcs = (ctypes.c_void_p * n)(*(s for _, s, _ in copies))
            sizes = (ctypes.c_size_t * n)(*(b for _, _, b in copies))
            rc = self.batch(dsts, srcs, sizes, n, stream)
            if rc == 0:
                self.launches += 1
                self.batched += 1
                return True
            clear_cuda_error()
            log.warning(
                "cudaMemcpyBatchAsync refused (error %d): %s are issued one by one", rc, self.what
            )
            self.batch = None
        for d, s, b in copies:
            rc = self.single(d, s, b, kind, stream)
            if rc != 0:
                clear_cuda_error()  # or torch's next launch check reports it
                log.warning(
                    "cudaMemcpyAsync refused (error %d): %s copy through torch", rc, self.what
                )
                self.single = None
                return False
            self.launches += 1
        return True
