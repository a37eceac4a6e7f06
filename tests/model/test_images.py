"""Checkpoint images: a slot copied into pool blocks and back, byte-exact, and the refusals."""

import pytest
import torch

from atom.model_api import ImageLayoutError, Span
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.paged import StateMismatchError
from atom.models.deepseek_v41.presets import preset_config
from atom.models.deepseek_v41.runtime import V41Runtime

from .harness import Harness
from .test_paged_vs_reference import tokens

CHUNKS = [20, 32, 45, 60]


def test_image_roundtrip_resumes_bit_identically(tiny_model):
    seq = tokens(60, seed=11)
    a = Harness(tiny_model, block_size=16)
    uninterrupted = a.run_chunks(seq, CHUNKS, slot=1, table=a.blocks(4), all_logits=True)

    b = Harness(tiny_model, block_size=16)
    table = b.blocks(4)
    first = b.run_chunks(seq, CHUNKS[:2], slot=1, table=table, all_logits=True)
    units = b.blocks(b.rt.spec.units_per_image)
    b.rt.store_image(1, units)
    b.slot_bytes[4] = torch.randint(0, 256, (b.rt.spec.state_bytes,), dtype=torch.uint8)
    assert b.rt.restore_image(units, 4) == 32
    assert torch.equal(b.slot_bytes[4], b.slot_bytes[1])  # byte-exact
    b.slot_bytes[1].zero_()  # the original is gone; only the image carries the state
    rest = []
    for s, e in [(32, 45), (45, 60)]:
        span = Span(s, e, 4, table)
        rest.append(
            tiny_model.forward_paged(
                torch.tensor(seq[s:e]), [span], b.rt.kv, b.rt.slots, all_logits=True
            )
        )
    resumed = torch.cat([first] + rest)
    assert torch.equal(resumed, uninterrupted)  # bit-identical, fp32


def test_image_units_are_whole_blocks_and_touch_nothing_else(tiny_model):
    h = Harness(tiny_model, block_size=16)
    h.run_chunks(tokens(20, seed=1), [20], slot=0, table=h.blocks(2))
    before = h.pool.clone()
    units = torch.tensor([40, 7])  # any blocks, any order
    h.rt.store_image(0, units)
    changed = (h.pool != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert set(changed) <= {7, 40}


def test_forward_refuses_start_not_at_cursor_and_writes_nothing(tiny_model):
    h = Harness(tiny_model, block_size=16)
    seq = tokens(40, seed=2)
    table = h.blocks(3)
    h.run_chunks(seq, [32], slot=2, table=table)
    pool, slots = h.pool.clone(), h.slot_bytes.clone()
    with pytest.raises(StateMismatchError, match="slot 2: state is at 32, forward starts at 20"):
        h.step([(seq, 20, 40, 2, table)])
    # a batch with one bad span is refused whole
    with pytest.raises(StateMismatchError, match="state is at 0, forward starts at 5|no state"):
        h.step([(seq, 32, 40, 2, table), (seq, 5, 9, 3, h.blocks(1))])
    assert torch.equal(h.pool, pool) and torch.equal(h.slot_bytes, slots)


def test_restore_refuses_an_image_of_another_layout(tiny_model, tiny_config):
    h = Harness(tiny_model, block_size=16)
    h.run_chunks(tokens(16, seed=3), [16], slot=0, table=h.blocks(1))
    units = h.blocks(h.rt.spec.units_per_image)
    h.rt.store_image(0, units)
    # same byte offsets, another model config: the layout id differs
    other_cfg = preset_config("v41-tiny", engram_vocab_size=80)
    other = V41Runtime(DeepseekV41ForCausalLM(other_cfg).init_weights(0), block_size=16)
    assert other.spec.header_offset == h.rt.spec.header_offset
    assert other.spec.layout_id != h.rt.spec.layout_id
    other.bind(h.pool, h.slot_bytes)
    slot5 = h.slot_bytes[5].clone()
    with pytest.raises(ImageLayoutError, match="layout tag"):
        other.restore_image(units, 5)
    assert torch.equal(h.slot_bytes[5], slot5)
    # a wider window moves the header: still refused
    wide = V41Runtime(
        DeepseekV41ForCausalLM(preset_config("v41-tiny", sliding_window=24)).init_weights(0),
        block_size=16,
    )
    wide.bind(h.pool, torch.zeros(6, wide.spec.state_bytes, dtype=torch.uint8))
    with pytest.raises(ImageLayoutError):
        extra = h.blocks(wide.spec.units_per_image - len(units))
        wide.restore_image(torch.cat([units, extra]), 5)
