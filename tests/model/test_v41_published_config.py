"""The published DeepSeek-V4.1-Flash config.json (tests/data, as shipped: text_config nested,
vision_config beside it) loads into the V4.1 config, with the geometry of the v41-flash
preset, and its keys are each read or ignored for a reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atom.models.common.config import ConfigError
from atom.models.deepseek_v41.config import V41Config
from atom.models.deepseek_v41.pool_geometry import build_v41_pool_geometry
from atom.models.deepseek_v41.presets import PRESETS, preset_config
from atom.models.deepseek_v41.published_config import IGNORED_TEXT_KEYS, TOP_KEYS, to_published
from atom.models.registry import config_from_dict

PUBLISHED = Path(__file__).resolve().parent.parent / "data" / "deepseek_v41_flash_config.json"


def published() -> dict:
    return json.loads(PUBLISHED.read_text())


def test_the_published_file_loads_as_shipped():
    c = V41Config.from_json(PUBLISHED)
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads) == (40, 5120, 64)
    assert c.kv_source_layer_ids == [2, 8, 14, 20] and c.candidate_source_layer_id == 20
    assert len(c.compress_ratios) == 40  # the 3 DSpark stages' entries are theirs
    assert (c.dspark_stages, c.dspark_block_size, c.num_nextn_predict_layers) == (3, 5, 0)
    assert c.engram_spec.num_embeddings == (384006168, 384016682)  # the primes fill them
    assert c.engram_compressed_vocab_size == 99092 and c.engram_pad_token_id == 2
    assert c.kv_fp8_sim and c.compressed_fp4_sim and c.index_fp4_sim and c.act_fp8_sim
    assert c.rope_scaling["type"] == "yarn" and c.vision_config["num_hidden_layers"] == 32
    assert config_from_dict(published()).model_type == "deepseek_v41"  # the registry too


def test_the_flash_preset_is_the_published_config():
    assert preset_config("v41-flash").to_dict() == V41Config.from_json(PUBLISHED).to_dict()


def test_its_geometry_is_the_flash_presets():
    kw = dict(kv_dtype="bf16", index_dtype="fp8", block_size=256, speculative_tokens=0)
    got = build_v41_pool_geometry(V41Config.from_json(PUBLISHED), **kw)
    want = build_v41_pool_geometry(preset_config("v41-flash"), **kw)
    assert got.block_bytes == want.block_bytes == 739_840
    assert got.state_bytes == want.state_bytes


@pytest.mark.parametrize("k, state", [(0, 5_276_672), (1, 5_730_304), (5, 5_971_968)])
def test_speculating_adds_a_window_per_dspark_stage(k, state):
    """With speculative tokens the state holds each of the 3 DSpark stages' windows of target
    KV (window layers 40-42, 128 + k rows of 512 bf16 each)."""
    kw = dict(kv_dtype="bf16", index_dtype="fp8", block_size=256, speculative_tokens=k)
    geo = build_v41_pool_geometry(V41Config.from_json(PUBLISHED), **kw)
    assert geo.state_bytes == state
    assert geo.state_layers == (40 if k == 0 else 43) and geo.window_rows == 128 + k


def test_every_key_is_read_or_ignored_for_a_reason():
    data = published()
    fields = set(V41Config.model_fields)
    assert set(data) <= set(TOP_KEYS)
    for key in data["text_config"]:
        assert key in fields or key in IGNORED_TEXT_KEYS, key


def test_an_unknown_top_level_key_is_refused_by_name():
    data = dict(published(), audio_config={})
    with pytest.raises(ConfigError, match="audio_config"):
        V41Config.from_dict(data)


def test_a_bad_value_inside_text_config_names_the_field():
    data = published()
    data["text_config"]["index_topk"] = 0
    with pytest.raises(ConfigError, match="index_topk"):
        V41Config.from_dict(data)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_written_in_the_published_form_exactly(name):
    """A preset rendered as a published config.json (text_config nested) reads back as itself,
    and so does the published file."""
    flat = preset_config(name).to_dict()
    nested = to_published(flat)
    assert set(nested) <= set(TOP_KEYS) and nested["text_config"]["model_type"].endswith("_text")
    assert V41Config.from_dict(nested).to_dict() == flat
    shipped = V41Config.from_json(PUBLISHED).to_dict()
    assert V41Config.from_dict(to_published(shipped)).to_dict() == shipped
