"""KV events: what a vLLM-format consumer rebuilds from atom's stream is the block pool.

A randomized shared-prefix workload on a pool small enough to evict; the consumer joins
mid-run (the replay socket must return what it missed), decodes with structs written from
vLLM's documentation (tests/engine/kv_event_consumer.py), and must end with exactly the pool's
resident hashes, every stored block's tokens hashing to its announced hash."""

from __future__ import annotations

import random
import socket

import pytest

from atom import LLM, SamplingParams
from atom.engine.block_pool import chain_hash
from atom.kv_events import KVEventsConfig
from atom.kv_events.events import KVEvents
from atom.kv_events.publisher import Publisher
from tests.engine.kv_event_consumer import Consumer
from tests.engine.workloads import prefix_tree_prompts

B = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def endpoints() -> tuple[str, str, str]:
    """(PUB endpoint to bind, the same to connect to, replay endpoint)."""
    pub = free_port()
    return f"tcp://*:{pub}", f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{free_port()}"


def check_tokens(consumer: Consumer) -> int:
    """Every stored block's hash is chain_hash(parent, its tokens); the blocks checked."""
    checked = 0
    for batch in consumer.batches():
        for ev in batch.events:
            if isinstance(ev, consumer.Stored):
                assert ev.block_size == B and len(ev.token_ids) == B * len(ev.block_hashes)
                parent = ev.parent_block_hash or 0
                for i, h in enumerate(ev.block_hashes):
                    parent = chain_hash(parent, ev.token_ids[i * B : (i + 1) * B])
                    assert parent == h
                    checked += 1
    return checked


def test_events_rebuild_the_pool_exactly_over_a_randomized_run():
    bind, connect, replay = endpoints()
    llm = LLM(
        "v41-tiny", block_size=B, num_blocks=40, max_num_seqs=4, max_num_batched_tokens=2 * B,
        dtype="float32", kv_dtype="fp32", index_dtype="fp32", device="cpu",
        kv_events={"endpoint": bind, "replay_endpoint": replay, "topic": "atom-test"},
    )  # fmt: skip
    engine, consumer = llm.engine, None
    rng = random.Random(7)
    prompts = prefix_tree_prompts(48, B, seed=11)
    try:
        for k, start in enumerate(range(0, len(prompts), 6)):
            if k == 2:  # a consumer that joins late: the first batches are only in the replay
                consumer = Consumer(connect, replay)
            params = [SamplingParams(max_tokens=rng.randint(1, 6), ignore_eos=True)] * 6
            llm.generate(prompts[start : start + 6], params, on_step=lambda e: e.check_integrity())
        publisher = engine.kv_events.publisher
        assert publisher.flush(10)
        last = publisher.batches - 1
        consumer.receive(until_seq=last, timeout_s=10)
        first_live = min(consumer.live)
        assert first_live > 0, "the consumer joined late: batches before it must be missed"
        assert consumer.replay(0) == list(range(last + 1))  # the buffer holds them all
        assert all(consumer.replayed[s] == p for s, p in consumer.live.items())
        held, odd = consumer.present("GPU")
        pool = set(engine.pool.by_hash)
        assert engine.pool.evictions > 0, "the pool must have evicted for removals to matter"
        assert odd == []
        assert not (pool - held), f"missing: {len(pool - held)}"
        assert not (held - pool), f"spurious: {len(held - pool)}"
        assert check_tokens(consumer) > 0
        assert engine.kv_events.unlocated == 0 and publisher.dropped == 0
        assert consumer.topics == {b"atom-test"}
        # reset: the pool empties and the consumer is told to forget everything
        engine.reset_prefix_cache()
        assert publisher.flush(10)
        consumer.receive(until_seq=publisher.batches - 1, timeout_s=10)
        assert consumer.present("GPU") == (set(), []) and not engine.pool.by_hash
        assert isinstance(consumer.batches()[-1].events[-1], consumer.Cleared)
    finally:
        if consumer is not None:
            consumer.close()
        llm.shutdown()


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_tier_stores_carry_their_medium_and_chain(tmp_path, encoding):
    cfg = KVEventsConfig(
        endpoint=f"ipc://{tmp_path}/ev", replay_endpoint=f"ipc://{tmp_path}/replay",
        encoding=encoding,
    )  # fmt: skip
    events = KVEvents(Publisher(cfg, B), cfg.medium)
    consumer = Consumer(cfg.endpoint, cfg.replay_endpoint, array_like=encoding == "array")
    try:
        tokens = list(range(3 * B))
        h0 = chain_hash(0, tokens[:B])
        h1 = chain_hash(h0, tokens[B : 2 * B])
        h2 = chain_hash(h1, tokens[2 * B :])
        events.tier_stored([h0, h1], "CPU", tokens[: 2 * B])
        events.tier_stored([h2], "CPU", tokens[2 * B :], parent_block_hash=h1)
        events.tier_removed([h0], "CPU")
        assert events.publisher.flush(10)
        got = consumer.replay(0)
        assert got == list(range(events.publisher.batches))
        assert consumer.present("CPU") == ({h1, h2}, [])
        assert consumer.present("GPU") == (set(), [])
        assert check_tokens(consumer) == 3
        stored = [e for b in consumer.batches() for e in b.events if isinstance(e, consumer.Stored)]
        assert {e.medium for e in stored} == {"CPU"}
        assert consumer.batches()[0].data_parallel_rank == 0
    finally:
        consumer.close()
        events.close()


def test_a_full_queue_drops_counts_and_then_clears(tmp_path):
    """The step thread never blocks: records past the queue are dropped and counted, and the
    next record that fits is preceded by AllBlocksCleared (a lost removal must not leave a
    consumer routing to a block that is gone)."""
    cfg = KVEventsConfig(
        endpoint=f"ipc://{tmp_path}/ev", replay_endpoint=f"ipc://{tmp_path}/r", max_queue_size=2
    )
    publisher = Publisher(cfg, B)
    events = KVEvents(publisher, cfg.medium)
    consumer = Consumer(cfg.endpoint, cfg.replay_endpoint)
    try:
        assert publisher.flush(10)
        with publisher._cv:  # the publisher thread blocks once it has sent what it holds
            for h in range(1, 11):
                events.removed(h)
        assert publisher.dropped >= 6  # at most 2 queued and 2 in the thread's hands
        events.removed(99)
        assert publisher.flush(10)
        consumer.replay(0)
        kinds = [type(e).__name__ for b in consumer.batches() for e in b.events]
        assert kinds[0] == "AllBlocksCleared" and kinds[-2:] == ["AllBlocksCleared", "BlockRemoved"]
    finally:
        consumer.close()
        events.close()
