"""Worker side: the pool's registration with LMCache and the transfer specs.

Registration (through lmcache's own ``AtomMPWorkerAdapter``): the PAGE pool is engine group 0
(``tokens_per_block = block_size``); each image ordinal j < K is engine group 1 + j, one layer
aliasing the whole pool, ``recurrent_state=True``, one chunk wide. A spec for chunks [s, e)
gives group 0 the page blocks and group 1 + j ``[-1] * (n - 1) + [unit_j]``: only the endpoint
chunk carries the image, and every ordinal is real there.

On CPU, LMCache moves a registered tensor's storage into shared memory. ``share_pool`` does
that move up front (with lmcache's own function), before the model derives any view, so a
registration made later (the server was down at start) moves nothing and no view goes stale.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from atom.tier.operations import TransferOp

log = logging.getLogger("atom.offload")


def share_pool(pool: torch.Tensor) -> str:
    """Put a CPU pool's storage where the server can map it; returns the /dev/shm segment
    name ("" on CUDA, where nothing moves)."""
    if pool.device.type != "cpu":
        return ""
    from lmcache.v1.platform.devices.cpu.shm import migrate_to_shm_and_wrap

    return migrate_to_shm_and_wrap(pool).shm_name


def unlink_segment(name: str) -> None:
    """Remove the pool's /dev/shm entry now (the mapping stays valid until the pool is freed),
    so a process that exits without collecting its tensors leaves nothing behind."""
    if name:
        from lmcache.v1.multiprocess.posix_shm import shm_unlink

        shm_unlink(name)


def kv_caches(pool: torch.Tensor, units_per_image: int) -> dict[str, torch.Tensor]:
    """The tensors to register, in layer order: pages, then one full-pool alias per ordinal."""
    caches = {"atom.pages": pool}
    for j in range(units_per_image):
        caches[f"atom.image.{j}"] = torch.as_strided(pool, pool.shape, pool.stride(), 0)
    return caches


def group_infos(block_size: int, chunk_size: int, units_per_image: int) -> list:
    from lmcache.v1.multiprocess.group_view import EngineGroupInfo

    groups = [EngineGroupInfo(engine_group_id=0, layer_indices=(0,), tokens_per_block=block_size)]
    for j in range(units_per_image):
        groups.append(
            EngineGroupInfo(
                engine_group_id=1 + j,
                layer_indices=(1 + j,),
                tokens_per_block=block_size,
                sw_size_tokens=chunk_size,
                recurrent_state=True,
            )
        )
    return groups


@dataclass(frozen=True)
class SpecShape:
    block_size: int
    chunk_size: int
    units_per_image: int


def build_spec(op: TransferOp, shape: SpecShape):
    """The AtomMPTransferSpec of an op; validated here because a malformed spec makes the
    server raise without ever replying."""
    from lmcache.integration.atom import AtomMPTransferSpec

    bs, chunk = shape.block_size, shape.chunk_size
    if op.start % chunk or op.end % chunk or op.end <= op.start:
        raise ValueError(f"{op}: range is not a non-empty span of the {chunk}-token chunk grid")
    n = (op.end - op.start) // bs
    if len(op.page_blocks) != n:
        raise ValueError(f"{op}: {len(op.page_blocks)} page blocks for {n} blocks of range")
    units = op.units
    if len(units) != shape.units_per_image or any(u < 0 for u in units):
        raise ValueError(f"{op}: image needs {shape.units_per_image} real units, got {units}")
    block_ids = [list(op.page_blocks)] + [[-1] * (n - 1) + [u] for u in units]
    return AtomMPTransferSpec(
        token_ids=list(op.token_ids[: op.end]), block_ids=block_ids, start=op.start, end=op.end
    )
