"""V4 checkpoint images: byte-exact round trips, resumption equal to running on, and what the
image holds (the CSA overlap rows) and does not (any compressor's current group, so nothing of
an HCA layer at block boundaries)."""

import pytest
import torch

from atom.model_api import ImageLayoutError
from atom.models.deepseek_v4.model import DeepseekV4ForCausalLM
from atom.models.deepseek_v4.paged import StateMismatchError
from atom.models.deepseek_v4.presets import preset_config

from .test_v4_paged import Harness, one_thread_fixture, tokens, v4_tiny_fixture  # noqa: F401

BLOCK = 16


def image_of(h, seq, boundary, slot, table):
    """Run seq to ``boundary`` (off-grid chunks) in ``slot``; store its image; return units."""
    h.run_chunks(seq, [5, 11, boundary], slot=slot, table=table)
    units = h.blocks(h.rt.spec.units_per_image)
    h.rt.store_image(slot, units)
    return units


def test_image_round_trip_is_byte_exact(v4_tiny):
    h = Harness(v4_tiny)
    seq, table = tokens(40, seed=1), h.blocks(3)
    units = image_of(h, seq, 2 * BLOCK, slot=0, table=table)
    h.slot_bytes[3].random_(0, 256)
    assert h.rt.restore_image(units, 3) == 2 * BLOCK
    assert torch.equal(h.slot_bytes[3], h.slot_bytes[0])


def test_resume_from_image_equals_running_on_even_with_garbage_scratch(v4_tiny):
    """The target slot's live scratch (every compressor's current group: all an HCA layer
    keeps) is filled with garbage before the restore; the image does not carry it and the
    continuation is bit-identical, because at a block boundary every group is complete."""
    h = Harness(v4_tiny)
    seq, table = tokens(45, seed=2), h.blocks(3)
    units = image_of(h, seq, 2 * BLOCK, slot=0, table=table)
    on = h.run_chunks(seq, [37, 45], slot=0, table=table, start=2 * BLOCK)
    scratch = h.rt.slots.scratch
    scratch[4] = torch.randint(0, 256, scratch[4].shape, dtype=torch.uint8)
    h.slot_bytes[4].fill_(0x7F)
    h.rt.restore_image(units, 4)
    resumed = h.run_chunks(seq, [37, 45], slot=4, table=table, start=2 * BLOCK)
    assert torch.equal(on, resumed)
    hca_partial = h.rt.slots.live["hca_partial_kv"]
    assert hca_partial.numel() > 0 and h.rt.geometry.hca_layers


def test_the_overlap_rows_are_needed(v4_tiny):
    """Zeroing the CSA overlap fields of an image changes the continuation: the next group's
    overlapping softmax reads them and no PAGE row holds them."""
    h = Harness(v4_tiny)
    seq, table = tokens(45, seed=3), h.blocks(3)
    units = image_of(h, seq, 2 * BLOCK, slot=0, table=table)
    on = h.run_chunks(seq, [45], slot=0, table=table, start=2 * BLOCK)
    h.rt.restore_image(units, 1)
    h.rt.slots.fields["csa_overlap_kv"][1].zero_()
    h.rt.slots.fields["index_overlap_score"][1].zero_()
    damaged = h.run_chunks(seq, [45], slot=1, table=table, start=2 * BLOCK)
    assert not torch.allclose(on, damaged)


def test_images_of_another_layout_or_off_the_grid_are_refused(v4_tiny):
    h = Harness(v4_tiny)
    seq, table = tokens(40, seed=4), h.blocks(3)
    units = image_of(h, seq, 2 * BLOCK, slot=0, table=table)
    other = DeepseekV4ForCausalLM(preset_config("v4-tiny", rope_theta=20000.0)).init_weights(0)
    h2 = Harness(other)
    h2.pool.copy_(h.pool.view(h2.pool.dtype).view(h2.pool.shape))
    before = h2.slot_bytes[2].clone()
    with pytest.raises(ImageLayoutError, match="layout tag"):
        h2.rt.restore_image(units, 2)
    assert torch.equal(h2.slot_bytes[2], before)
    h.run_chunks(seq, [35], slot=1, table=table)  # 35: inside a group
    off = h.blocks(h.rt.spec.units_per_image)
    h.rt.store_image(1, off)
    with pytest.raises(StateMismatchError, match="off the compressors' group grid"):
        h.rt.restore_image(off, 2)
