"""Who copies a tier load (``lmcache.load_mode``) is decided in the config, not switched
silently: ``auto`` (the default) resolves to engine_driven on one rank and across ranks, with
rank collapse or without, ``--print-config`` prints the resolved mode, and the tier logs it
once at INFO with the reason. (tests/distributed/test_tp_tier.py checks the log line and
/health of a real TP=2 tier; tests/serve/test_lifecycle.py the command line.)"""

from __future__ import annotations

import logging

import pytest

from atom.config import EngineConfig, EngineConfigError, OffloadConfig
from atom.tier.policy import TierPolicy

from .test_two_pass import GREEDY, prompts_of, tier

TIER_KW = dict(model="v41-tiny", device="cpu", num_blocks=64, offload="lmcache_mp")


def test_auto_resolves_by_the_number_of_ranks():
    auto = OffloadConfig()
    assert auto.load_mode == "auto"
    mode, why = auto.load_path(1)
    assert mode == "engine_driven" and why.startswith("one rank")
    mode, why = auto.load_path(2)
    assert mode == "engine_driven" and "tensor_parallel_size=2 without rank collapse" in why
    assert "every rank copies its own objects" in why
    mode, why = auto.load_path(2, collapse=True)
    assert mode == "engine_driven" and "tensor_parallel_size=2 with rank collapse" in why
    assert OffloadConfig(load_mode="engine_driven").load_path(4, True)[0] == "engine_driven"
    mode, why = OffloadConfig(load_mode="lmcache_driven").load_path(1)
    assert mode == "lmcache_driven" and "lmcache.load_mode=lmcache_driven" in why
    mode, why = OffloadConfig(load_mode="lmcache_driven").load_path(4)
    assert mode == "lmcache_driven" and "every rank's part is the server's retrieve" in why
    assert OffloadConfig(load_mode="engine_driven").load_path(4)[0] == "engine_driven"
    assert "lmcache.load=false" in OffloadConfig(load=False).load_path(1)[1]


def test_the_policy_copies_loads_only_where_the_resolved_mode_is_engine_driven():
    assert TierPolicy.of(OffloadConfig(), 1).engine_copies
    assert TierPolicy.of(OffloadConfig(), 2).engine_copies
    assert TierPolicy.of(OffloadConfig(), 2, collapse=True).engine_copies
    assert TierPolicy.of(OffloadConfig(load_mode="engine_driven"), 2).engine_copies
    assert not TierPolicy.of(OffloadConfig(load_mode="lmcache_driven"), 1).engine_copies
    assert not TierPolicy.of(OffloadConfig(load_mode="lmcache_driven"), 2).engine_copies
    assert not TierPolicy.of(OffloadConfig(load=False), 1).engine_copies


def test_the_resolved_config_says_which_mode_runs():
    one = EngineConfig(**TIER_KW).resolved()
    assert one.lmcache.load_mode == "engine_driven"
    two = EngineConfig(**TIER_KW, tensor_parallel_size=2).resolved()
    assert two.lmcache.load_mode == "engine_driven"  # tp_rank_collapse auto: one shared copy
    assert two.resolved().lmcache.load_mode == "engine_driven"  # resolving again changes nothing
    apart = {"tp_rank_collapse": "false"}
    two = EngineConfig(**TIER_KW, tensor_parallel_size=2, lmcache=apart).resolved()
    assert two.lmcache.load_mode == "engine_driven"  # every rank copies its own objects
    assert two.resolved().lmcache.load_mode == "engine_driven"
    asked = {**apart, "load_mode": "lmcache_driven"}
    two = EngineConfig(**TIER_KW, tensor_parallel_size=2, lmcache=asked).resolved()
    assert two.lmcache.load_mode == "lmcache_driven"
    given = EngineConfig(**TIER_KW, lmcache={"load_mode": "lmcache_driven"}).resolved()
    assert given.lmcache.load_mode == "lmcache_driven"
    assert EngineConfig(**{**TIER_KW, "offload": "none"}).resolved().lmcache.load_mode == "auto"


def test_engine_driven_across_ranks_without_collapse_is_accepted():
    apart = {"load_mode": "engine_driven", "tp_rank_collapse": "false"}
    two = EngineConfig.build(**TIER_KW, tensor_parallel_size=2, lmcache=apart).resolved()
    assert two.lmcache.load_mode == "engine_driven"
    assert two.lmcache.rank_collapse(2, True) is False


def test_the_tier_logs_its_load_mode_once_at_start(lmcache_server, make_llm, caplog):
    with caplog.at_level(logging.INFO, logger="atom.offload"):
        llm = make_llm(**tier(lmcache_server))
        llm.generate(prompts_of([40], seed=77), GREEDY)
    lines = [r for r in caplog.records if r.getMessage().startswith("tier loads:")]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert lines[0].getMessage().startswith("tier loads: engine_driven (one rank: ")
    assert llm.engine.tier_health()["load_mode"].startswith(("engine_driven", "probing"))


# ---- who copies a save (``lmcache.save_mode``): the same rules, lmcache_driven by default ----


def test_save_mode_defaults_to_the_servers_stores_and_auto_resolves_by_ranks():
    default = OffloadConfig()
    assert default.save_mode == "lmcache_driven"
    mode, why = default.save_path(1)
    assert mode == "lmcache_driven" and "lmcache.save_mode=lmcache_driven" in why
    mode, why = OffloadConfig(save_mode="auto").save_path(1)
    assert mode == "engine_driven" and why.startswith("one rank")
    mode, why = OffloadConfig(save_mode="auto").save_path(2)
    assert mode == "lmcache_driven" and why.startswith("tensor_parallel_size=2 without rank")
    # with rank collapse rank 0 alone saves (the one copy), from its own pool, as one rank does
    mode, why = OffloadConfig(save_mode="auto").save_path(2, collapse=True)
    assert mode == "engine_driven" and why.startswith("tensor_parallel_size=2 with rank collapse")
    assert OffloadConfig(save_mode="engine_driven").save_path(4, collapse=True)[0] == (
        "engine_driven"
    )
    mode, why = OffloadConfig(save_mode="lmcache_driven").save_path(2, collapse=True)
    assert mode == "lmcache_driven" and "lmcache.save_mode=lmcache_driven" in why
    assert "lmcache.save=false" in OffloadConfig(save=False).save_path(1)[1]
    assert not TierPolicy.of(OffloadConfig(), 1).engine_saves
    assert TierPolicy.of(OffloadConfig(save_mode="engine_driven"), 1).engine_saves
    assert not TierPolicy.of(OffloadConfig(save_mode="auto"), 2).engine_saves
    assert TierPolicy.of(OffloadConfig(save_mode="auto"), 2, collapse=True).engine_saves
    assert not TierPolicy.of(OffloadConfig(save_mode="engine_driven", save=False), 1).engine_saves


def test_save_mode_is_resolved_in_the_config_and_refused_across_ranks_without_collapse():
    assert EngineConfig(**TIER_KW).resolved().lmcache.save_mode == "lmcache_driven"
    auto = dict(lmcache={"save_mode": "auto"})
    assert EngineConfig(**TIER_KW, **auto).resolved().lmcache.save_mode == "engine_driven"
    # rank collapse auto: the split models' tier bytes are the same on every rank
    two = EngineConfig(**TIER_KW, **auto, tensor_parallel_size=2).resolved()
    assert two.lmcache.save_mode == "engine_driven"
    apart = dict(lmcache={"save_mode": "auto", "tp_rank_collapse": "false"})
    two = EngineConfig(**TIER_KW, **apart, tensor_parallel_size=2).resolved()
    assert two.lmcache.save_mode == "lmcache_driven"
    EngineConfig.build(**TIER_KW, tensor_parallel_size=2, lmcache={"save_mode": "engine_driven"})
    with pytest.raises(EngineConfigError) as err:
        EngineConfig.build(
            **TIER_KW,
            tensor_parallel_size=2,
            lmcache={"save_mode": "engine_driven", "tp_rank_collapse": "false"},
        )
    msg = str(err.value)
    assert "lmcache.save_mode=engine_driven with tensor_parallel_size=2 without rank" in msg
    assert "set lmcache.tp_rank_collapse" in msg and "use save_mode auto" in msg


def test_the_tier_logs_its_save_mode_once_at_start(lmcache_server, make_llm, caplog):
    with caplog.at_level(logging.INFO, logger="atom.offload"):
        llm = make_llm(**tier(lmcache_server, save_mode="engine_driven"))
        llm.generate(prompts_of([40], seed=78), GREEDY)
    lines = [r for r in caplog.records if r.getMessage().startswith("tier saves:")]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert lines[0].getMessage().startswith("tier saves: engine_driven (one rank: ")
    assert llm.engine.tier_health()["save_mode"].startswith(("engine_driven", "probing"))
    plain = make_llm(**tier(lmcache_server))
    assert plain.engine.tier_health()["save_mode"] == "lmcache_driven"
    assert plain.engine.tier.saves is None
