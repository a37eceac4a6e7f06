import pytest
import torch

from atom.models.deepseek_v41.pool_geometry import GeometryError, build_v41_pool_geometry
from atom.models.deepseek_v41.presets import preset_config


@pytest.fixture(scope="module")
def flash():
    return preset_config("v41-flash")


def geo(config, **kw):
    args = dict(kv_dtype="bf16", index_dtype="fp8", block_size=256, speculative_tokens=0)
    args.update(kw)
    return build_v41_pool_geometry(config, **args)


def test_real_flash_page_block_bytes(flash):
    g = geo(flash)
    assert g.block_bytes == 739_840
    assert [(p.rows, p.row_bytes, p.nbytes) for p in g.planes] == [
        (640, 1024, 655_360),
        (128, 132, 16_896),
        (128, 132, 16_896),
        (128, 132, 16_896),
        (256, 132, 33_792),
    ]
    assert g.block_bytes // 256 == 2890
    assert geo(flash, index_dtype="bf16").block_bytes == 819_200


def test_real_flash_state_and_image(flash):
    g = geo(flash)
    assert g.state_bytes == 5_276_672
    assert g.field("window").shape == (40, 128, 512)
    assert g.field("window").nbytes == 5_242_880
    assert g.field("compressor_values").nbytes == 16_384
    assert g.field("compressor_scores").nbytes == 16_384
    assert g.field("cursor").shape == (4,)
    assert g.units_per_image == 8  # ceil(5,276,672 / 739,840)
    spec = geo(flash, speculative_tokens=5)
    assert spec.state_bytes == 5_971_968
    assert spec.field("window").shape == (43, 133, 512)


def test_fields_do_not_overlap_and_fit(flash):
    g = geo(flash, speculative_tokens=5)
    spans = sorted((f.offset, f.offset + f.nbytes) for f in g.state_fields)
    for (_, a1), (b0, _) in zip(spans, spans[1:]):
        assert a1 <= b0
    assert spans[-1][1] <= g.state_bytes


def test_layout_id_tracks_every_byte_moving_argument(flash):
    base = geo(flash).layout_id
    assert geo(flash).layout_id == base  # stable
    assert geo(flash, index_dtype="bf16").layout_id != base
    assert geo(flash, kv_dtype="fp32").layout_id != base
    assert geo(flash, speculative_tokens=1).layout_id != base
    other = preset_config("v41-flash", sliding_window=256)
    assert geo(other).layout_id != base
    other = preset_config("v41-flash", candidate_block_size=16)
    assert geo(other).layout_id != base


def test_pool_dtype_prefers_wide_types(flash):
    assert geo(flash).state_spec().pool_dtype == torch.bfloat16  # 2890 B/token
    assert geo(flash, index_dtype="bf16").state_spec().pool_dtype == torch.int32
    assert geo(flash).state_spec().pool_shape(10) == (10, 256, 1445)


def test_geometry_refusals(flash):
    with pytest.raises(GeometryError, match="block_size=255 is not a multiple of compress ratio 2"):
        geo(flash, block_size=255)
    with pytest.raises(GeometryError, match="rows per block % 16"):
        geo(flash, block_size=16)
    with pytest.raises(GeometryError, match="index_dtype='int4'"):
        geo(flash, index_dtype="int4")
    with pytest.raises(GeometryError, match="speculative_tokens=-1"):
        geo(flash, speculative_tokens=-1)
    with pytest.raises(TypeError):  # every byte-moving argument is required
        build_v41_pool_geometry(flash, kv_dtype="bf16", index_dtype="fp8", block_size=256)
