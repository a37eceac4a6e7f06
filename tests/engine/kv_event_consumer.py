"""A KV event consumer written from vLLM's documented format (docs.vllm.ai, KV events
subscriber example; vllm/distributed/kv_events.py): msgspec structs, a ZMQ SUB socket for the
live stream and a DEALER socket for replay. Independent of atom.kv_events on purpose."""

import time
from typing import Any

import msgspec
import zmq


def vllm_types(array_like: bool):
    """vLLM's EventBatch (positional) and its events, positional (legacy) or tagged maps."""

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(
        msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True
    ):
        """Base class for all KV cache-related events"""

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared


class Consumer:
    """Keeps every batch by sequence number; ``present(medium)`` applies them in order."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, array_like: bool = False):
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        types = vllm_types(array_like)
        self.decoder = msgspec.msgpack.Decoder(type=types[0])
        self.Stored, self.Removed, self.Cleared = types[1:]
        self.live: dict[int, bytes] = {}
        self.replayed: dict[int, bytes] = {}
        self.topics: set[bytes] = set()

    def receive(self, until_seq: int, timeout_s: float) -> None:
        """Read the live stream until batch ``until_seq`` arrived or the deadline passed."""
        deadline = time.monotonic() + timeout_s
        while until_seq not in self.live and time.monotonic() < deadline:
            if self.sub.poll(50):
                topic, seq, payload = self.sub.recv_multipart()
                self.topics.add(topic)
                self.live[int.from_bytes(seq, "big")] = payload

    def replay(self, start_seq: int, timeout_s: float = 10.0) -> list[int]:
        """Ask the replay socket for every batch from ``start_seq``; the sequence numbers got."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.connect(self.replay_endpoint)
        got = []
        try:
            sock.send_multipart((b"", start_seq.to_bytes(8, "big")))
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if not sock.poll(50):
                    continue
                _, seq_b, payload = sock.recv_multipart()
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq == -1:
                    return got
                got.append(seq)
                self.replayed[seq] = payload
            raise AssertionError(f"replay from {start_seq}: no end marker within {timeout_s} s")
        finally:
            sock.close(linger=0)

    def batches(self) -> list:
        merged = {**self.replayed, **self.live}
        seqs = sorted(merged)
        assert seqs == list(range(len(seqs))), f"gaps in the sequence numbers: {seqs[:20]}"
        return [self.decoder.decode(merged[s]) for s in seqs]

    def present(self, medium: str | None = None) -> tuple[set[int], list[str]]:
        """Hashes the events say are present (of ``medium``, or all), and the anomalies: a
        store of a hash already present, a removal of one that is not."""
        held: set[int] = set()
        odd: list[str] = []
        for batch in self.batches():
            for ev in batch.events:
                if isinstance(ev, self.Cleared):
                    held.clear()
                elif medium is not None and ev.medium != medium:
                    continue
                elif isinstance(ev, self.Stored):
                    odd += [f"stored twice: {h}" for h in ev.block_hashes if h in held]
                    held.update(ev.block_hashes)
                else:
                    odd += [f"removed absent: {h}" for h in ev.block_hashes if h not in held]
                    held.difference_update(ev.block_hashes)
        return held, odd

    def close(self) -> None:
        self.sub.close(linger=0)
