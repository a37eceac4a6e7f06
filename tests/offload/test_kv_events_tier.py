"""KV events of the tier: every save that settles against the real LMCache server is published
as blocks stored with the tier's medium, their chained hashes the prompt's, so a router can
tell which replica's tier holds a prefix."""

from __future__ import annotations

import socket

from atom import SamplingParams
from atom.engine.block_pool import block_hashes
from tests.engine.kv_event_consumer import Consumer

from .conftest import BLOCK
from .test_two_pass import prompts_of, tier


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_settled_saves_are_published_with_the_tier_medium(lmcache_server, make_llm):
    pub, replay = _port(), _port()
    events = {"endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
    llm = make_llm(kv_events=events, **tier(lmcache_server))
    consumer = Consumer(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    try:
        prompts = prompts_of([3 * BLOCK + 5, 2 * BLOCK], seed=21)
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
        # batches published before the subscription took effect (ZMQ's slow joiner: the
        # engine publishes its start-up clear at once) come from the replay socket, as a
        # router joining late gets them
        consumer.replay(0)
        publisher = llm.engine.kv_events.publisher
        llm.shutdown()  # pending stores settle (and are published), then the publisher flushes
        consumer.receive(until_seq=publisher.batches - 1, timeout_s=10)
        held, odd = consumer.present("CPU")
        assert odd == []
        want = set()
        for p in prompts:  # every full block of each prompt was saved (stores drained)
            want |= set(block_hashes(p, BLOCK))
        assert want <= held, f"{len(want - held)} saved blocks not published"
    finally:
        consumer.close()
