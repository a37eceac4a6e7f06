"""atom's server module for engine-driven saves against a real LMCache server (issue 39):
``atom.reserve`` stages objects in the server's shared-memory L1 that lookups do not see until
``atom.commit`` admits them; ``atom.abort`` discards them; a reservation never committed is
released when its lease ends. Observed through the module's own counters (``SavesProbe``: an
``atom.reserve`` with no items answers them), LMCache's gauge of staging bytes (Prometheus)
and LMCache's own lookups."""

from __future__ import annotations

import re
import time
import urllib.request

import msgspec
import zmq

from atom.tier.server.l1_saves import RESERVE_METHOD, SAVES_VERSION

from .conftest import BLOCK
from .test_two_pass import GREEDY, prompts_of, tier


class SavesProbe:
    """Asks the server module for its saves counters (an ``atom.reserve`` of nothing)."""

    def __init__(self, url: str):
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        self.ctx = zmq.Context()
        self.ctx.linger = 0
        self.client = RequestClientFactory.create(url, context=self.ctx)

    def call(self, method: str, payload: dict) -> dict:
        from lmcache.v1.multiprocess.protocols.server_module import ServerModuleCallRequest

        req = ServerModuleCallRequest(method, msgspec.msgpack.encode(payload))
        fut = self.client.server_module_call(req)
        assert fut.wait(5.0), f"the server did not answer {method} in 5 s"
        resp = fut.result()
        assert resp.success, resp.error
        return msgspec.msgpack.decode(resp.payload)

    def status(self) -> dict:
        return self.call(RESERVE_METHOD, {"v": SAVES_VERSION, "items": []})["status"]

    def close(self) -> None:
        self.client.close()
        self.ctx.destroy(linger=0)

    def __enter__(self) -> SavesProbe:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def staging_bytes(server) -> float:
    """LMCache's gauge of bytes held by staging objects (reserved, never admitted)."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    found = re.findall(r"^lmcache_mp_l1_staging_bytes(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE)
    assert found, "LMCache exports no lmcache_mp_l1_staging_bytes"
    return sum(float(v) for v in found)


def wait_until(cond, what: str, timeout_s: float = 60.0):
    """Poll ``cond()`` (another process's state) until it is truthy; its value."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.1)  # allowed: a bounded poll round of another process's state


# ---- the module (atom.reserve, atom.commit, atom.abort): staging, visibility, lease -----------


def reserve_payload(ns: str, items: list[tuple[str, list[int], int]], ttl_s: float = 30.0):
    from atom.tier.server.l1_saves import own_identity

    return {
        "v": SAVES_VERSION, "model_name": ns, "world_size": 1, "worker_id": 0, "ttl_s": ttl_s,
        "owner": own_identity(),
        "items": [{"request_id": rid, "token_ids": toks[:end], "start": 0, "end": end,
                   "groups": [[0, -1], [1, 1]]} for rid, toks, end in items],
    }  # fmt: skip


def lookup_hit(url: str, ns: str, tokens: list[int], request_id: str) -> int:
    """LMCache's own lookup of ``tokens`` (its scheduler adapter), locks freed after."""
    from lmcache.integration.atom import AtomMPParallelConfig, AtomMPSchedulerAdapter

    ctx = zmq.Context()
    ctx.linger = 0
    adapter = AtomMPSchedulerAdapter(url, ctx, ns, BLOCK, AtomMPParallelConfig(1, 0, 1))
    hit = 0
    try:
        adapter.maybe_submit_lookup_request(request_id, tokens)
        answered = wait_until(
            lambda: (h := adapter.check_lookup_result(request_id)) is not None and [h],
            "a lookup's answer",
            10.0,
        )
        hit = answered[0]
        if hit:
            adapter.free_lookup_locks(tokens, 0, hit, request_id)
    finally:
        adapter.cleanup_lookup_result(request_id)
        adapter.end_session(request_id)
        adapter.shutdown()
        ctx.destroy(linger=0)
    return hit


def test_reserved_objects_are_invisible_until_committed_and_an_abort_discards_them(
    own_server, make_llm
):
    own_server.start()
    llm = make_llm(**tier(own_server))  # registers the namespace's layout
    ns = llm.engine.tier.namespace
    a, b = prompts_of([48, 48], seed=561)
    with SavesProbe(own_server.url) as probe:
        answer = probe.call(RESERVE_METHOD, reserve_payload(ns, [("t-a", a, 48), ("t-b", b, 32)]))
        assert answer["shm_name"] == own_server.l1_segment and answer["ttl_s"] == 30.0
        ia, ib = answer["items"]
        assert ia["ok"] and ib["ok"] and ia["rid"] != ib["rid"], answer
        # one span per chunk's pages, one for the image at the end; all in the segment
        assert [len(g) for g in ia["objects"]] == [3, 1] and [len(g) for g in ib["objects"]] == [
            2,
            1,
        ]
        spans = [tuple(x) for it in (ia, ib) for g in it["objects"] for x in g]
        assert all(0 <= o and o + n <= answer["shm_size"] for o, n in spans)
        assert len({o for o, _ in spans}) == len(spans)  # disjoint starts
        assert staging_bytes(own_server) == sum(n for _, n in spans)
        # staged, not admitted: LMCache's own lookup does not see them
        assert lookup_hit(own_server.url, ns, a + [1], "t-look-1") == 0
        assert lookup_hit(own_server.url, ns, b + [1], "t-look-2") == 0
        done = probe.call("atom.commit", {"v": SAVES_VERSION, "rids": [ia["rid"]]})
        assert done["results"] == [[ia["rid"], True, ""]]
        gone = probe.call("atom.abort", {"v": SAVES_VERSION, "rids": [ib["rid"]]})
        assert gone["results"] == [[ib["rid"], True, ""]]
        assert lookup_hit(own_server.url, ns, a + [1], "t-look-3") == 48
        assert lookup_hit(own_server.url, ns, b + [1], "t-look-4") == 0
        assert staging_bytes(own_server) == 0.0
        # what is resident is not reserved again (nil spans; nothing to write: rid 0)
        again = probe.call(RESERVE_METHOD, reserve_payload(ns, [("t-a2", a, 48)]))["items"][0]
        assert again == {"ok": True, "error": "", "rid": 0, "objects": [[None] * 3, [None]]}
        st = probe.status()
    assert (st["reserved"], st["committed"], st["aborted"], st["open"]) == (2, 1, 1, 0), st


def test_a_reservation_past_its_lease_is_released_and_cannot_be_committed(lmcache_server, make_llm):
    """A reservation whose owner never commits it is released at the end of its lease even
    while the owner lives (here: this test process, a lease of 1 s), and a late commit of it
    is refused: a lookup never sees it."""
    llm = make_llm(**tier(lmcache_server))  # registers the namespace's layout
    ns = llm.engine.tier.namespace
    tokens = prompts_of([48], seed=551)[0]
    with SavesProbe(lmcache_server.url) as probe:
        before = probe.status()
        answer = probe.call(RESERVE_METHOD, reserve_payload(ns, [("t-lease", tokens, 48)], 1.0))
        assert answer["ttl_s"] == 1.0
        item = answer["items"][0]
        assert item["ok"] and item["rid"] > 0 and len(item["objects"][0]) == 3, item
        st = wait_until(
            lambda: (s := probe.status())["reaped"] > before["reaped"] and s, "the lease's end"
        )
        assert st["open"] == before["open"]
        late = probe.call("atom.commit", {"v": SAVES_VERSION, "rids": [item["rid"]]})
        assert late["results"] == [[item["rid"], False, "no such reservation (reaped or done)"]]
    out = make_llm(**tier(lmcache_server)).generate([tokens + [1]], GREEDY)[0]
    assert out.tier_hit_tokens == 0
