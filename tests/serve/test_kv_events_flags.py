"""--kv-events-* flags and the YAML kv_events block: merged like the other nested configs; a
malformed endpoint is refused naming the value and the forms allowed."""

import pytest

from atom.config import EngineConfigError
from atom.serve.__main__ import build_config, parse_args


def test_flags_turn_events_on_and_override_the_file(tmp_path):
    assert build_config(parse_args(["--model", "v41-tiny"])).kv_events is None
    cfg = tmp_path / "engine.yaml"
    cfg.write_text("model: v41-tiny\nkv_events:\n  endpoint: tcp://*:5557\n  topic: fleet\n")
    assert build_config(parse_args(["--config", str(cfg)])).kv_events.topic == "fleet"
    ev = build_config(
        parse_args(["--config", str(cfg), "--kv-events-replay-endpoint", "tcp://0.0.0.0:5558"])
    ).kv_events
    assert (ev.endpoint, ev.replay_endpoint, ev.topic) == (
        "tcp://*:5557",
        "tcp://0.0.0.0:5558",
        "fleet",
    )
    assert ev.encoding == "map"


@pytest.mark.parametrize("bad", ["localhost:5557", "tcp://host", "tcp://*:70000", "udp://x:1"])
def test_a_malformed_endpoint_names_the_value_and_the_forms(bad):
    with pytest.raises(EngineConfigError) as exc:
        build_config(parse_args(["--kv-events-endpoint", bad]))
    assert f"kv_events.endpoint={bad!r}" in str(exc.value) and "tcp://*:PORT" in str(exc.value)


def test_replay_alone_needs_an_endpoint():
    with pytest.raises(EngineConfigError, match="kv_events.endpoint"):
        build_config(parse_args(["--kv-events-replay-endpoint", "tcp://0.0.0.0:5558"]))
