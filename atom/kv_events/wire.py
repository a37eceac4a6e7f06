"""vLLM's KV event wire format, as msgspec structs (encoding only).

A message on the PUB socket is three frames: ``topic``, the batch's sequence number (8 bytes,
big-endian, from 0), and the msgpack-encoded ``EventBatch`` ``[ts, events, data_parallel_rank]``.
Each event is a tagged struct: ``BlockStored(block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium, lora_name)``, ``BlockRemoved(block_hashes, medium)`` or
``AllBlocksCleared()``. With ``array`` encoding an event is ``["BlockStored", ...fields]``;
with ``map`` encoding it is ``{"type": "BlockStored", "block_hashes": ..., ...}``.
"""

from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def event_types(array_like: bool) -> tuple[type, type, type]:
    """(BlockStored, BlockRemoved, AllBlocksCleared) in the positional or the map layout."""

    class KVCacheEvent(
        msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True
    ):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    return BlockStored, BlockRemoved, AllBlocksCleared
