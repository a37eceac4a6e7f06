"""V4's PAGE and state geometry, with the published Flash config's numbers."""

import pytest

from atom.models.deepseek_v4.geometry import build_v4_pool_geometry
from atom.models.deepseek_v4.presets import preset_config
from atom.models.deepseek_v41.pool_geometry import GeometryError, build_v41_pool_geometry
from atom.models.deepseek_v41.presets import preset_config as v41_preset
from atom.models.registry import pool_geometry
from atom.tier.config import namespace

# bf16 KV, fp8 index, block 256, no drafts: the published model as served
SERVED = dict(kv_dtype="bf16", index_dtype="fp8", block_size=256, speculative_tokens=0)


def geo(cfg, **args):
    return build_v4_pool_geometry(cfg, **{**SERVED, **args})


def test_flash_page_block():
    g = geo(preset_config("v4-flash"))
    csa = [p for p in g.main_planes if p.rows == 64]
    hca = [p for p in g.main_planes if p.rows == 2]
    assert [p.owner_layer for p in csa] == list(range(2, 43, 2))  # 64 rows per C4 layer
    assert [p.owner_layer for p in hca] == list(range(3, 42, 2))  # 2 rows per C128 layer
    assert all(p.row_bytes == 1024 for p in g.main_planes)  # 512 x bf16
    assert [(p.owner_layer, p.rows, p.row_bytes) for p in g.index_planes] == [
        (layer, 64, 132) for layer in range(2, 43, 2)  # 128 fp8 + fp32 scale
    ]
    assert g.block_bytes == 21 * 64 * 1024 + 20 * 2 * 1024 + 21 * 64 * 132 == 1_594_624
    assert g.block_bytes // 256 == 6229
    assert geo(preset_config("v4-flash"), index_dtype="bf16").block_bytes == 1_761_280


def test_flash_checkpoint_image():
    g = geo(preset_config("v4-flash"))
    sizes = {f.name: f.nbytes for f in g.state_fields}
    assert sizes == {
        "window": 43 * 128 * 512 * 2,  # 5,636,096: every layer's 128-row ring, bf16
        "csa_overlap_kv": 21 * 4 * 512 * 4,  # 172,032: 4 rows' first halves, fp32
        "csa_overlap_score": 21 * 4 * 512 * 4,
        "index_overlap_kv": 21 * 4 * 128 * 4,  # 43,008
        "index_overlap_score": 21 * 4 * 128 * 4,
        "cursor": 8,
        "header": 16,
    }
    assert g.state_bytes == 6_067_200  # 5.786 MiB; nothing of the 20 HCA layers
    assert abs(g.state_bytes / 2**20 - 5.79) < 0.01
    assert g.units_per_image == 4
    assert g.scratch_bytes == 11_345_920  # live only: current groups, never stored
    spec = g.state_spec()
    assert spec.state_bytes == g.state_bytes and spec.block_bytes == g.block_bytes


def test_registry_dispatches_geometry_by_model_type():
    g = pool_geometry(preset_config("v4-flash"), **SERVED)
    assert g.block_bytes == 1_594_624
    g41 = pool_geometry(v41_preset("v41-flash"), **SERVED)
    assert g41.block_bytes == 739_840


def test_block_must_hold_whole_groups_and_fp8_index_rows():
    with pytest.raises(GeometryError, match="not a multiple of compress ratio 128"):
        geo(preset_config("v4-flash"), block_size=192)
    with pytest.raises(GeometryError, match="rows per block % 16"):
        geo(preset_config("v4-tiny"), block_size=16)  # 4 index rows per block
    assert geo(preset_config("v4-tiny"), index_dtype="fp32", block_size=16).block_bytes > 0
    with pytest.raises(GeometryError, match="kv_dtype='fp8'"):
        geo(preset_config("v4-flash"), kv_dtype="fp8")


def test_layout_ids_separate_models_and_geometries():
    flash = preset_config("v4-flash")
    base = geo(flash)
    g41 = build_v41_pool_geometry(v41_preset("v41-flash"), **SERVED)
    assert geo(flash).layout_id == base.layout_id  # stable
    ids = {
        base.layout_id,
        geo(flash, index_dtype="bf16").layout_id,
        geo(flash, kv_dtype="fp32").layout_id,
        geo(flash, block_size=512).layout_id,
        geo(flash, speculative_tokens=1).layout_id,
        geo(preset_config("v4-flash", sliding_window=256)).layout_id,
        g41.layout_id,
    }
    assert len(ids) == 7
    kw = dict(model="m", revision="r", chunk_size=256, world_size=1)
    assert namespace(spec=base.state_spec(), **kw) != namespace(spec=g41.state_spec(), **kw)


def test_speculative_tokens_grow_the_window_and_add_the_mtp_layer():
    flash = preset_config("v4-flash")
    g = geo(flash, speculative_tokens=2)
    assert g.window_rows == 130 and g.state_layers == 44
    assert g.field("window").nbytes == 44 * 130 * 512 * 2
