"""``python -m atom.serve``'s flags: each names a real config field, every flag has help, the
help's choices and defaults are the config models' own, and a flag given sets its field."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from atom.config import EngineConfig
from atom.kv_events.config import KVEventsConfig
from atom.serve import flags
from atom.serve.__main__ import build_config, build_parser, parse_args
from atom.tier.config import OffloadConfig

GROUPS = (
    (EngineConfig, flags.ENGINE),
    (OffloadConfig, flags.OFFLOAD),
    (KVEventsConfig, flags.KV_EVENTS),
)
# fields set otherwise (their own flags, sections, YAML only), named so a new field is a choice
WITHOUT_FLAG = {
    EngineConfig: {
        "cuda_graphs",  # --cuda-graphs / --no-cuda-graphs
        "enable_prefix_caching",  # --enable-prefix-caching / --no-...
        "kv_events",  # the kv-events group
        "lmcache",  # the lmcache group
        "tensor_parallel_start_timeout_s",  # YAML only
    },
    OffloadConfig: {"heartbeat_s", "l2_adapters", "load", "located_max_age_s", "save"},
    KVEventsConfig: {"buffer_steps", "hwm", "max_queue_size", "medium"},
}


@pytest.mark.parametrize("model, group", GROUPS, ids=lambda v: getattr(v, "__name__", ""))
def test_every_flag_names_a_field_and_every_field_has_a_flag_or_a_reason(model, group):
    fields = {f.field for f in group}
    assert fields <= set(model.model_fields), fields - set(model.model_fields)
    assert len(fields) == len(group), "two flags set one field"
    assert set(model.model_fields) - fields == WITHOUT_FLAG[model]


def test_every_flag_has_help():
    parser = build_parser()
    bare = [
        a.option_strings
        for a in parser._actions
        if a.option_strings and not (a.help and a.help.strip())
    ]
    assert not bare, f"flags without help: {bare}"
    names = [s for a in parser._actions for s in a.option_strings]
    assert len(names) == len(set(names))


@pytest.mark.parametrize(
    "name, expected",
    [
        ("lmcache-save-mode", "one of auto, engine_driven, lmcache_driven; default lmcache_driven"),
        ("lmcache-load-mode", "one of auto, engine_driven, lmcache_driven; default auto"),
        ("lmcache-tp-rank-collapse", "one of auto, true, false; default auto"),
        ("dtype", "one of auto, float32, bfloat16; default auto"),
        ("max-num-seqs", "default 16"),
        ("lmcache-l1-gb", "default 2.0"),
        ("moe-grouped-mm", "default true"),
        ("kv-events-encoding", "one of array, map; default map"),
    ],
)
def test_help_gives_the_models_choices_and_defaults(name, expected):
    [action] = [a for a in build_parser()._actions if f"--{name}" in a.option_strings]
    assert action.help.endswith(expected), action.help


def test_choices_and_defaults_follow_the_model():
    """What the help says is read from the field: another default or Literal shows there."""
    for model, group in GROUPS:
        for flag in group:
            info = model.model_fields[flag.field]
            text = flags.help_of(model, flag)
            if flags.choices(model, flag.field):
                for option in flags.choices(model, flag.field):
                    assert option in text, (flag.name, option)
            default = info.default
            if isinstance(default, (int, float, str)) and default not in ("",):
                shown = str(default).lower() if isinstance(default, bool) else str(default)
                assert text.endswith(f"default {shown}"), (flag.name, text)


def test_a_flag_given_sets_its_field_and_the_rest_stay_the_models():
    args = parse_args(
        [
            "--max-num-seqs", "3", "--dtype", "float32", "--offload", "lmcache_mp",
            "--lmcache-save-mode", "auto", "--lmcache-load-streams", "2",
            "--lmcache-url", "tcp://127.0.0.1:5555", "--lmcache-lookup-timeout", "2.5",
            "--kv-events-endpoint", "tcp://*:5557", "--kv-events-encoding", "array",
        ]
    )  # fmt: skip
    cfg = build_config(args)
    assert cfg.max_num_seqs == 3 and cfg.dtype == "float32" and cfg.offload == "lmcache_mp"
    assert cfg.lmcache.save_mode == "auto" and cfg.lmcache.load_streams == 2
    assert cfg.lmcache.url == "tcp://127.0.0.1:5555" and cfg.lmcache.lookup_timeout_s == 2.5
    assert cfg.kv_events.endpoint == "tcp://*:5557" and cfg.kv_events.encoding == "array"
    assert cfg.max_num_batched_tokens == EngineConfig().max_num_batched_tokens
    assert cfg.lmcache.load_mode == OffloadConfig().load_mode


def test_a_bad_choice_is_an_error_naming_the_flag_value_and_choices():
    """The model refuses it (exit 2 with an ``error:`` line), naming what it accepts."""
    proc = subprocess.run(
        [sys.executable, "-m", "atom.serve", "--lmcache-save-mode", "sometimes", "--print-config"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "save_mode" in proc.stderr and "sometimes" in proc.stderr
    assert "engine_driven" in proc.stderr and "lmcache_driven" in proc.stderr


def test_help_exits_zero_and_groups_the_config_flags():
    out = subprocess.run(
        [sys.executable, "-m", "atom.serve", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0
    for title in ("engine (EngineConfig):", "the LMCache tier", "KV cache events (kv_events):"):
        assert title in out.stdout
    assert isinstance(build_parser(), argparse.ArgumentParser)
