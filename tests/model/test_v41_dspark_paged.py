"""DSpark in the request's state (``atom.models.deepseek_v41.dspark_paged``): each stage's
window of target KV filled from committed spans, block drafts read from it, against the
reference draft (``dspark.draft_block``, from whole arrays); the window travels in checkpoint
images; out-of-order fills and drafts are refused before any write."""

from __future__ import annotations

import pytest
import torch

from atom.model_api import Span, block_draft_size
from atom.models.deepseek_v41.dspark import draft_block
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.paged import StateMismatchError
from atom.models.deepseek_v41.pool_geometry import GeometryError
from atom.models.deepseek_v41.presets import preset_config
from atom.models.deepseek_v41.reference import reference_with_hidden
from atom.models.deepseek_v41.runtime import V41Runtime

BLOCK = 16


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model():
    return DeepseekV41ForCausalLM(preset_config("v41-tiny-dspark")).init_weights(4)


def runtime(model, k=3, slots=4, blocks=48):
    rt = V41Runtime(model, block_size=BLOCK, speculative_tokens=k)
    spec = rt.spec
    pool = torch.zeros(spec.pool_shape(blocks), dtype=spec.pool_dtype)
    rt.bind(pool, torch.zeros(slots, spec.state_bytes, dtype=torch.uint8))
    return rt


def run(rt, tokens, bounds, slot, table):
    """Target forwards over consecutive chunks, each chunk's span filled into the windows
    (what the engine's drafter does after every forward)."""
    start = 0
    for end in bounds:
        span = Span(start, end, slot, table)
        _, hidden = rt.forward_with_residual(torch.tensor(tokens[start:end]), [span])
        rt.fill_draft_windows(hidden, [span])
        start = end


def test_the_runtime_offers_block_drafts_only_with_stages(model):
    assert block_draft_size(runtime(model)) == 3
    plain = DeepseekV41ForCausalLM(preset_config("v41-tiny")).init_weights(4)
    assert block_draft_size(V41Runtime(plain, block_size=BLOCK)) == 0


@pytest.mark.parametrize(
    "n,bounds",
    [(9, [9]), (40, [7, 20, 21, 22, 40]), (70, [33, 64, 65, 70])],
)
def test_drafts_from_the_filled_windows_equal_the_reference_draft(model, n, bounds):
    """Windows filled chunk by chunk (spans of 1 to 33 tokens; the ring of 16 + 3 rows wraps
    at n = 40 and 70) give the reference draft's ids, logits and confidence, for two
    sequences drafted in one call."""
    rt = runtime(model)
    seqs = [prompt(n, 1), prompt(n + 3, 2)]
    tables = [torch.arange(0, 8), torch.arange(8, 16)]
    run(rt, seqs[0], bounds, 0, tables[0])
    run(rt, seqs[1], [*bounds[:-1], n + 3], 2, tables[1])
    want = []
    for seq in seqs:
        logits, hidden = reference_with_hidden(model, seq)
        tok = int(logits[-1].argmax())
        want.append((tok, draft_block(model, hidden, tok, len(seq) - 1)))
    from atom.models.deepseek_v41.dspark_paged import draft_blocks

    ids, logits, conf = draft_blocks(
        model, [w[0] for w in want], [len(s) - 1 for s in seqs], [0, 2], rt.slots
    )
    for j, (_, (d_ids, d_logits, d_conf)) in enumerate(want):
        assert ids[j].tolist() == d_ids
        torch.testing.assert_close(logits[j], d_logits, atol=2e-5, rtol=0)
        torch.testing.assert_close(conf[j], d_conf, atol=2e-5, rtol=0)
    assert rt.draft_blocks([w[0] for w in want], [n - 1, n + 2], [0, 2]) == ids.tolist()


def test_the_window_travels_in_the_checkpoint_image(model):
    """An image taken at a block boundary after the fill, restored into another slot, drafts
    as the original slot does; a slot without it (its window zeroed) drafts differently."""
    rt = runtime(model)
    seq = prompt(2 * BLOCK, 3)
    run(rt, seq, [20, 2 * BLOCK], 0, torch.arange(0, 4))
    units = torch.arange(20, 20 + rt.spec.units_per_image)
    rt.store_image(0, units)
    assert rt.restore_image(units, 1) == 2 * BLOCK
    tok = [7]
    assert rt.draft_blocks(tok, [2 * BLOCK - 1], [1]) == rt.draft_blocks(tok, [2 * BLOCK - 1], [0])
    from atom.models.deepseek_v41.dspark_paged import draft_blocks

    _, before, _ = draft_blocks(model, tok, [2 * BLOCK - 1], [1], rt.slots)
    for st in model.dspark:
        rt.slots.window[1, st.self_attn.layer] = 0
    _, after, _ = draft_blocks(model, tok, [2 * BLOCK - 1], [1], rt.slots)
    assert (before - after).abs().max() > 1e-3


def test_out_of_order_fills_and_drafts_are_refused_before_any_write(model):
    rt = runtime(model)
    seq = prompt(20, 4)
    run(rt, seq, [10], 0, torch.arange(0, 4))
    _, hidden = rt.forward_with_residual(
        torch.tensor(seq[10:20]), [Span(10, 20, 0, torch.arange(4))]
    )
    window = rt.slots.window.clone()  # the target's rings moved, the DSpark windows not yet
    with pytest.raises(
        StateMismatchError, match="up to 10, a fill of \\[12, 20\\) needs them up to 12"
    ):
        rt.fill_draft_windows(hidden[2:], [Span(12, 20, 0, torch.arange(4))])
    with pytest.raises(ValueError, match="hidden must be"):
        rt.fill_draft_windows(hidden[:3], [Span(10, 20, 0, torch.arange(4))])
    with pytest.raises(StateMismatchError, match="a draft after position 19 needs 20"):
        rt.draft_blocks([1], [19], [0])
    assert torch.equal(rt.slots.window, window)
    rt.fill_draft_windows(hidden, [Span(10, 20, 0, torch.arange(4))])
    assert len(rt.draft_blocks([1], [19], [0])[0]) == 3


def test_without_speculative_tokens_the_state_has_no_window(model):
    rt = runtime(model, k=0)
    with pytest.raises(GeometryError, match="speculative_tokens >= 1"):
        rt.draft_blocks([1], [0], [0])
