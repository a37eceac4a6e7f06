import json

import pytest

from atom.models.deepseek_v41.config import ConfigError, LayerMode, V41Config
from atom.models.deepseek_v41.presets import PRESETS, preset_config


def test_presets_are_valid_and_name_their_modes():
    for name in PRESETS:
        preset_config(name)
    flash = preset_config("v41-flash")
    modes = flash.layer_modes
    assert modes[0] is LayerMode.WINDOW and modes[1] is LayerMode.WINDOW
    assert [i for i, m in enumerate(modes) if m is LayerMode.FULL] == [2, 8, 14, 20]
    assert [i for i, m in enumerate(modes) if m is LayerMode.REINDEX] == [24, 28, 32, 36]
    assert flash.kv_owner[25] == 20 and flash.selection_owner[25] == 24
    assert flash.kv_owner[13] == 8 and flash.selection_owner[13] == 8


def test_config_json_roundtrip_ignores_unknown_fields(tmp_path):
    data = dict(PRESETS["v41-mini"], architectures=["DeepseekV4ForCausalLM"], torch_dtype="bf16")
    (tmp_path / "config.json").write_text(json.dumps(data))
    cfg = V41Config.from_json(tmp_path)
    assert cfg == preset_config("v41-mini")


@pytest.mark.parametrize(
    "override, needle",
    [
        (dict(sliding_window=0), "sliding_window=0"),
        (dict(compress_ratios=[0, 0, 3, 2, 2, 2, 1, 1, 1, 1]), "compress_ratios[2]=3"),
        (dict(compress_ratios=[0, 0, 2]), "needs 10 entries"),
        (dict(kv_source_layer_ids=[0, 4, 6]), "layer 0 has ratio 0"),
        (dict(index_source_layer_ids=[2, 6, 8]), "missing 4"),
        (dict(candidate_source_layer_id=4), "candidate_source_layer_id=4"),
        (dict(candidate_topk_blocks=1), "candidate_topk_blocks=1"),
        (dict(o_groups=3), "o_groups=3"),
        (dict(engram_layer_ids=[1, 12]), "engram_layer_ids=[1, 12]"),
        (dict(vocab_size="many"), "vocab_size='many'"),
        (dict(rope_scaling={"type": "linear", "factor": 2}), "only 'yarn'"),
    ],
)
def test_config_errors_name_field_and_value(override, needle):
    with pytest.raises(ConfigError) as err:
        preset_config("v41-tiny", **override)
    assert needle in str(err.value)


def test_missing_required_field_and_bad_json(tmp_path):
    data = dict(PRESETS["v41-tiny"])
    del data["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        V41Config.from_dict(data)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        V41Config.from_json(tmp_path)
    with pytest.raises(ConfigError, match="unknown model preset 'v41-huge'"):
        preset_config("v41-huge")
