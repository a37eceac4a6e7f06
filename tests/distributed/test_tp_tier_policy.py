"""``lmcache.save: false`` across ranks (CPU, gloo; real LMCache server): with rank collapse off
every rank would store its own object, and none reaches the server, by its own counters. The
run repeats its prompts, so the second pass is admitted from HBM while its lookups answer."""

from __future__ import annotations

from atom import LLM
from atom.tier.server.lmcache_server import LMCacheServer
from tests.distributed.test_tp_tier import BLOCK, GREEDY, PROMPTS, TP_KW
from tests.offload.conftest import ENGINE_KW
from tests.offload.server_view import ServerView
from tests.offload.test_two_pass import prompts_of


def test_save_off_stores_nothing_from_any_rank():
    server = LMCacheServer(chunk_size=BLOCK, l1_size_gb=0.2)
    server.start(wait=True)
    try:
        view = ServerView(server)
        before = view.read()
        tier = {"url": server.url, "tp_rank_collapse": "false", "save": False}
        llm = LLM("v41-tiny", offload="lmcache_mp", lmcache=tier, **TP_KW)
        llm.generate(PROMPTS, GREEDY)
        again = llm.generate(PROMPTS, GREEDY)
        assert sum(o.hbm_hit_tokens for o in again) > 0
        ranks = llm.engine.tier.health()["tensor_parallel"]["ranks"]
        llm.shutdown()
        assert [r["parts"]["save"] for r in ranks] == [0, 0]

        def mark() -> tuple[float, float]:
            one = LLM("v41-tiny", offload="lmcache_mp", lmcache={"url": server.url}, **ENGINE_KW)
            one.generate(prompts_of([40], seed=4401), GREEDY)
            one.shutdown()
            m = one.engine.scheduler.connector.tier_metrics
            return m.saves.get(outcome="done"), m.lookups.total()

        assert view.settled(before, mark).stores == 0
    finally:
        server.stop()
