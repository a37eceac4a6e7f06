"""DeepSeek-V4 configs: the published Flash config.json parses into a V4 config, model_type
picks the model in the one registry, and bad values are refused naming the field."""

import json
from pathlib import Path

import pytest

from atom.models import registry
from atom.models.deepseek_v4.config import V4Config, V4LayerKind
from atom.models.deepseek_v4.presets import PRESETS, preset_config
from atom.models.deepseek_v41.config import ConfigError, V41Config
from atom.models.deepseek_v41.presets import PRESETS as V41_PRESETS
from atom.models.registry import config_from_dict, resolve_config

FLASH_JSON = Path(__file__).parents[1] / "data" / "deepseek_v4_flash_config.json"


def flash_data() -> dict:
    return json.loads(FLASH_JSON.read_text())


def test_published_flash_config_parses_into_a_v4_config():
    cfg = config_from_dict(flash_data(), source="flash")
    assert isinstance(cfg, V4Config)
    assert cfg.num_hidden_layers == 43 and cfg.num_nextn_predict_layers == 1
    kinds = cfg.layer_kinds
    assert cfg.layers_of(V4LayerKind.WINDOW) == (0, 1)
    assert cfg.layers_of(V4LayerKind.CSA) == tuple(range(2, 43, 2))  # 21 layers
    assert cfg.layers_of(V4LayerKind.HCA) == tuple(range(3, 42, 2))  # 20 layers
    assert len(kinds) == 43 and cfg.compress_ratios[43] == 0  # the MTP layer
    assert cfg.scoring_func == "sqrt_softplus"  # DeepSeek's "sqrtsoftplus", one name
    assert [cfg.is_hash_layer(i) for i in range(4)] == [True, True, True, False]
    assert cfg.layer_rope(0) == (10000, None)
    assert cfg.layer_rope(2)[0] == 160000 and cfg.layer_rope(3)[1]["factor"] == 16
    assert cfg.expert_dtype == "fp4"  # absent from the file: defaults to the shipped format
    assert cfg.kv_fp8_sim and cfg.index_fp4_sim
    assert cfg == preset_config("v4-flash")


def test_model_type_picks_the_model(tmp_path):
    (tmp_path / "config.json").write_text(FLASH_JSON.read_text())
    cfg, path = resolve_config(str(tmp_path))
    assert isinstance(cfg, V4Config) and path == tmp_path
    v41 = dict(V41_PRESETS["v41-tiny"], model_type="deepseek_v41", scoring_func="sqrtsoftplus")
    (tmp_path / "config.json").write_text(json.dumps(v41))
    cfg, _ = resolve_config(str(tmp_path))
    assert isinstance(cfg, V41Config) and cfg.scoring_func == "sqrt_softplus"
    assert isinstance(resolve_config("v4-tiny")[0], V4Config)
    assert isinstance(resolve_config("v41-tiny")[0], V41Config)
    (tmp_path / "config.json").write_text(json.dumps(dict(v41, model_type="llama")))
    with pytest.raises(ConfigError, match="model_type='llama'"):
        resolve_config(str(tmp_path))


def test_v41_accepts_both_spellings_with_one_layout_identity():
    a = V41Config.from_dict(dict(V41_PRESETS["v41-tiny"], scoring_func="sqrtsoftplus"))
    b = V41Config.from_dict(dict(V41_PRESETS["v41-tiny"], scoring_func="sqrt_softplus"))
    assert a == b
    with pytest.raises(ConfigError, match="scoring_func='softmax'"):
        V41Config.from_dict(dict(V41_PRESETS["v41-tiny"], scoring_func="softmax"))
    with pytest.raises(ConfigError, match="model_type='deepseek_v4'"):
        V41Config.from_dict(dict(V41_PRESETS["v41-tiny"], model_type="deepseek_v4"))


def test_v41_loader_refuses_the_published_v4_file_by_model_type():
    with pytest.raises(ConfigError, match="model_type='deepseek_v4'"):
        V41Config.from_dict(flash_data())


def test_presets_have_every_layer_kind():
    for name in PRESETS:
        cfg = preset_config(name)
        for kind in V4LayerKind:
            assert cfg.layers_of(kind), f"{name} has no {kind.value} layer"
        assert len(cfg.layers_of(V4LayerKind.CSA)) >= 2
        assert len(cfg.layers_of(V4LayerKind.HCA)) >= 2
        assert cfg.num_hash_layers >= 1


@pytest.mark.parametrize(
    "override, needle",
    [
        (dict(scoring_func="sigmoid"), "scoring_func='sigmoid'"),
        (dict(compress_ratios=[0, 0, 1] + [4] * 41), "compress_ratios[2]=1"),
        (dict(compress_ratios=[0, 0, 4]), "compress_ratios='<3 entries>'"),
        (dict(compress_ratios=[0, 0] + [4, 128] * 20 + [4, 4]), "compress_ratios[43]=4"),
        (dict(num_key_value_heads=8), "num_key_value_heads=8"),
        (dict(num_hash_layers=44), "num_hash_layers=44"),
        (dict(topk_method="greedy"), "topk_method='greedy'"),
        (dict(o_groups=7), "o_groups=7"),
        (dict(index_head_dim=96), "index_head_dim=96"),
        (dict(head_dim=544), "head_dim=544"),
        (dict(expert_dtype="int4"), "expert_dtype='int4'"),
        (dict(vocab_size="many"), "vocab_size='many'"),
        (dict(rope_scaling={"type": "linear", "factor": 2}), "only 'yarn'"),
        (dict(model_type="deepseek_v41"), "model_type='deepseek_v41'"),
    ],
)
def test_bad_values_name_the_field(override, needle):
    with pytest.raises(ConfigError) as err:
        V4Config.from_dict({**flash_data(), **override}, source="flash")
    assert needle in str(err.value) and "flash" in str(err.value)


def test_missing_field_and_bad_json(tmp_path):
    data = flash_data()
    del data["index_topk"]
    with pytest.raises(ConfigError, match="index_topk"):
        V4Config.from_dict(data)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        V4Config.from_json(tmp_path)
    with pytest.raises(ConfigError, match="not valid JSON"):
        resolve_config(str(tmp_path))


def test_v4_bench_keeps_flash_per_layer_dimensions():
    flash, bench = preset_config("v4-flash"), preset_config("v4-bench")
    same = (
        "hidden_size vocab_size num_attention_heads head_dim qk_rope_head_dim q_lora_rank "
        "o_groups o_lora_rank sliding_window index_n_heads index_head_dim index_topk "
        "moe_intermediate_size num_hash_layers rope_scaling compress_rope_theta"
    ).split()
    assert all(getattr(bench, f) == getattr(flash, f) for f in same)
    assert set(bench.compress_ratios[: bench.num_hidden_layers]) == {0, 4, 128}
    assert bench.num_hidden_layers < flash.num_hidden_layers
    assert bench.n_routed_experts < flash.n_routed_experts
    assert registry.default_block_size("v4-bench") == 256
    assert "v4-bench" in registry.all_presets()
