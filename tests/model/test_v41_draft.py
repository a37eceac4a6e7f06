"""V4.1's draft layers (``atom.models.deepseek_v41.draft``): the modules and their names, the
paged draft forward against the dense reference (chunks, batches, chaining, rewinds), the
refusals, and the draft capability the runtime publishes (``atom.model_api.DraftRuntime``)."""

import pytest
import torch

from atom.model_api import DraftRuntime, Span, draft_layers
from atom.models.common.rope import Rope
from atom.models.deepseek_v41.config import LayerMode
from atom.models.deepseek_v41.draft import DraftLayer, reference_draft_forward
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.paged import StateMismatchError
from atom.models.deepseek_v41.pool_geometry import GeometryError, build_v41_pool_geometry
from atom.models.deepseek_v41.presets import preset_config
from atom.models.deepseek_v41.reference import reference_forward
from atom.models.deepseek_v41.runtime import V41Runtime
from atom.models.deepseek_v41.weights import checkpoint_tensors

SPEC = 2  # speculative tokens: each draft ring is window + 2 rows
TOL = dict(atol=2e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def draft_model():
    return DeepseekV41ForCausalLM(preset_config("v41-tiny-draft")).init_weights(0)


def runtime(model, speculative_tokens=SPEC, num_slots=3, num_blocks=24):
    rt = V41Runtime(model, block_size=16, speculative_tokens=speculative_tokens)
    spec = rt.spec
    pool = torch.zeros(spec.pool_shape(num_blocks), dtype=spec.pool_dtype)
    rt.bind(pool, torch.zeros(num_slots, spec.state_bytes, dtype=torch.uint8))
    return rt


def table(slot):
    return torch.arange(8) + 8 * slot


def tokens(n, seed):
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed))


def target(rt, seq, slot=0):
    """The target forward of a whole sequence: (logits [S, V], residual [S, hc, d])."""
    return rt.forward_with_residual(seq, [Span(0, len(seq), slot, table(slot))], True)


def draft(rt, next_ids, residual, start, slot=0, layer=0):
    span = Span(start, start + len(next_ids), slot, table(slot))
    return rt.draft_forward(next_ids, residual, [span], layer=layer, all_logits=True)


# ---- modules, names, init -------------------------------------------------------------------


def test_draft_layers_modules_names_and_init(draft_model):
    tiny = DeepseekV41ForCausalLM(preset_config("v41-tiny")).init_weights(0)
    main = tiny.state_dict()
    full = draft_model.state_dict()
    for name, t in main.items():  # the draft layers draw after: main weights bit-identical
        assert torch.equal(full[name], t), name
    assert draft_model.num_draft_layers == 2 and tiny.num_draft_layers == 0
    for i, layer in enumerate(draft_model.mtp):
        assert isinstance(layer, DraftLayer) and layer.layer == 10 + i and layer.index == i
        attn = layer.self_attn
        assert attn.mode is LayerMode.WINDOW and attn.ratio == 0
        assert attn.compressor is None and attn.indexer is None and layer.engram is None
        assert attn.rope.mscale == 1.0 and attn.window == 8
        short = Rope(16, draft_model.config.rope_theta, None).inv_freq
        assert torch.equal(attn.rope.inv_freq, short)  # the window-only layers' RoPE, no YaRN
    names = checkpoint_tensors(draft_model)
    assert set(names) - set(main) == {
        n.replace("mtp.0.", "model.layers.10.").replace("mtp.1.", "model.layers.11.")
        for n in full
        if n.startswith("mtp.")
    }
    assert list(names["model.layers.11.eh_proj.weight"].shape) == [64, 128]
    for extra in ["enorm.weight", "hnorm.weight", "shared_head.norm.weight", "head_hc.base"]:
        assert f"model.layers.10.{extra}" in names
    assert "model.layers.10.self_attn.kv_proj.weight" in names
    assert "model.layers.10.mlp.experts.3.down_proj.weight" in names
    assert not any(".10.self_attn.compressor" in n or ".10.engram" in n for n in names)
    assert not any("embed_tokens" in n or "shared_head.head" in n for n in names if ".10." in n)
    # norms start at 1, the draft projection is random
    assert torch.equal(draft_model.mtp[0].enorm.weight, torch.ones(64))
    assert draft_model.mtp[0].eh_proj.weight.std() > 0.05


def test_runtime_publishes_the_draft_capability(draft_model):
    rt = runtime(draft_model)
    assert isinstance(rt, DraftRuntime) and draft_layers(rt) == 2
    tiny = DeepseekV41ForCausalLM(preset_config("v41-tiny")).init_weights(0)
    assert draft_layers(runtime(tiny, speculative_tokens=0)) == 0
    geo = rt.geometry
    assert geo.state_layers == 12 and geo.window_rows == 8 + SPEC
    assert rt.slots.draft_cursor.shape == (3, 2)
    assert runtime(draft_model, speculative_tokens=0).slots.draft_cursor is None


# ---- the target's residual -------------------------------------------------------------------


def test_forward_with_residual_is_forward_plus_the_heads_input(draft_model):
    seq = tokens(29, 1)
    rt, plain = runtime(draft_model), runtime(draft_model, speculative_tokens=0)
    logits, res = target(rt, seq)
    assert res.shape == (29, 4, 64) and res.dtype == torch.float32
    same = plain.forward(seq, [Span(0, 29, 0, table(0))])
    last, res_last = runtime(draft_model).forward_with_residual(seq, [Span(0, 29, 0, table(0))])
    assert torch.equal(last, same) and torch.equal(res_last, res)
    ref_rt = runtime(draft_model)
    ref_rt.forward(seq, [Span(0, 29, 0, table(0))])
    assert torch.equal(ref_rt.slot_bytes, rt.slot_bytes)  # the same state updates as forward
    assert torch.equal(ref_rt.pool, rt.pool)
    torch.testing.assert_close(logits, reference_forward(draft_model, seq), **TOL)
    # continued in a decode step: the same rows a whole-sequence forward gives
    last = rt.forward_with_residual(tokens(30, 1)[29:], [Span(29, 30, 0, table(0))], True)
    whole, res_whole = target(runtime(draft_model), tokens(30, 1))
    torch.testing.assert_close(last[1], res_whole[29:], **TOL)
    torch.testing.assert_close(last[0], whole[29:], **TOL)


# ---- the paged draft forward vs the dense reference ------------------------------------------


def test_paged_draft_in_chunks_and_chained_matches_reference(draft_model):
    seq = tokens(30, 2)
    rt = runtime(draft_model)
    _, res = target(rt, seq[:29])
    nxt = seq[1:30]
    ref0, x0 = reference_draft_forward(draft_model, nxt, res, 0)
    ref1, x1 = reference_draft_forward(draft_model, nxt, x0, 1)  # chained: layer 1 on x0
    out0, out1 = [], []
    for s, e in [(0, 11), (11, 12), (12, 13), (13, 21), (21, 29)]:
        lg, x = draft(rt, nxt[s:e], res[s:e], s, layer=0)
        out0.append(lg)
        torch.testing.assert_close(x, x0[s:e], **TOL)
        lg1, _ = draft(rt, nxt[s:e], x, s, layer=1)
        out1.append(lg1)
    torch.testing.assert_close(torch.cat(out0), ref0, **TOL)
    torch.testing.assert_close(torch.cat(out1), ref1, **TOL)
    assert rt.slots.draft_cursor[0].tolist() == [29, 29]
    # the dense reference: each position alone over its window equals the batched one
    p = 20
    lo = p - 7
    alone, _ = reference_draft_forward(draft_model, nxt[: p + 1], res[: p + 1], 0)
    torch.testing.assert_close(alone[p], ref0[p], **TOL)
    assert lo > 0 and not torch.allclose(ref0[p], ref0[p - 1])


def test_draft_batch_of_slots_last_logits_and_target_state_untouched(draft_model):
    rt = runtime(draft_model)
    seqs = [tokens(20, 3), tokens(14, 4)]
    res = [target(rt, s[:-1], slot)[1] for slot, s in enumerate(seqs)]
    before_target = rt.slots.window[:, :10].clone(), rt.slots.cursor.clone(), rt.pool.clone()
    refs = [reference_draft_forward(draft_model, s[1:], r, 0)[0] for s, r in zip(seqs, res)]
    ids = torch.cat([seqs[0][1:10], seqs[1][1:13]])
    spans = [Span(0, 9, 0, table(0)), Span(0, 12, 1, table(1))]
    lg, x = rt.draft_forward(ids, torch.cat([res[0][:9], res[1][:12]]), spans)
    assert lg.shape == (2, 320) and x.shape == (21, 4, 64)
    torch.testing.assert_close(lg, torch.stack([refs[0][8], refs[1][11]]), **TOL)
    ids = torch.cat([seqs[0][10:20], seqs[1][13:14]])  # a chunk and a decode step together
    spans = [Span(9, 19, 0, table(0)), Span(12, 13, 1, table(1))]
    lg, _ = rt.draft_forward(ids, torch.cat([res[0][9:19], res[1][12:13]]), spans)
    torch.testing.assert_close(lg, torch.stack([refs[0][18], refs[1][12]]), **TOL)
    assert torch.equal(rt.slots.window[:, :10], before_target[0])
    assert torch.equal(rt.slots.cursor, before_target[1]) and torch.equal(rt.pool, before_target[2])


def test_rewind_over_rejected_drafts_matches_reference(draft_model):
    seq = tokens(24, 5)
    rt = runtime(draft_model)
    _, res = target(rt, seq[:23])
    nxt = seq[1:24]
    ref, _ = reference_draft_forward(draft_model, nxt, res, 0)
    draft(rt, nxt[:12], res[:12], 0)
    # drafts at 12, 13 from rejected tokens/residuals, then re-run from 12 (cursor 14 = 12 + SPEC)
    draft(rt, torch.tensor([7, 9]), torch.randn(2, 4, 64), 12)
    assert int(rt.slots.draft_cursor[0, 0]) == 14
    lg, _ = draft(rt, nxt[12:23], res[12:23], 12)
    torch.testing.assert_close(lg, ref[12:23], **TOL)
    # a rewind of one (cursor 23, re-run at 22)
    draft(rt, torch.tensor([3]), torch.randn(1, 4, 64), 22)  # a rejected draft at 22
    lg, _ = draft(rt, nxt[22:23], res[22:23], 22)
    torch.testing.assert_close(lg, ref[22:23], **TOL)


def test_draft_spans_are_refused_before_any_write(draft_model):
    seq = tokens(16, 6)
    rt = runtime(draft_model)
    _, res = target(rt, seq[:15])
    draft(rt, seq[1:11], res[:10], 0)  # draft layer 0 at 10
    snapshot = rt.slot_bytes.clone()
    for start in (7, 11, 13):  # behind by more than SPEC, ahead, far ahead
        with pytest.raises(StateMismatchError, match=r"draft layer 0 is at 10, a draft forward"):
            draft(rt, seq[start + 1 : start + 2], res[start : start + 1], start)
    with pytest.raises(StateMismatchError, match=r"draft layer 1 is at 0"):
        draft(rt, seq[9:10], res[8:9], 8, layer=1)
    with pytest.raises(StateMismatchError, match="holds no state of this layout"):
        draft(rt, seq[9:10], res[8:9], 8, slot=2)
    with pytest.raises(ValueError, match=r"draft layer 2 out of range \[0, 2\)"):
        draft(rt, seq[9:10], res[8:9], 8, layer=2)
    with pytest.raises(ValueError, match=r"residual must be \[1, 4, 64\]"):
        draft(rt, seq[9:10], res[8:10], 8)
    assert torch.equal(rt.slot_bytes, snapshot)
    for start in (8, 9, 10):  # within [cursor - SPEC, cursor]: runs
        rt.slot_bytes.copy_(snapshot)
        rt.slots.refresh(0)  # bytes written around StateSlots: its host mirror re-reads them
        draft(rt, seq[start + 1 : start + 2], res[start : start + 1], start)
        assert int(rt.slots.draft_cursor[0, 0]) == start + 1


def test_without_speculative_tokens_draft_forward_is_refused(draft_model):
    rt = runtime(draft_model, speculative_tokens=0)
    seq = tokens(8, 7)
    _, res = target(rt, seq[:7])
    with pytest.raises(GeometryError, match=r"build the runtime with speculative_tokens >= 1"):
        draft(rt, seq[1:8], res, 0)
    tiny = DeepseekV41ForCausalLM(preset_config("v41-tiny")).init_weights(0)
    with pytest.raises(ValueError, match=r"draft layer 0 out of range \[0, 0\)"):
        draft(runtime(tiny), seq[1:8], res, 0)


# ---- the real config -------------------------------------------------------------------------


def test_three_draft_layers_at_the_flash_geometry():
    """v41-flash drafts with DSpark stages (as published); three MTP-style draft layers in
    their place take the same state bytes."""
    flash = preset_config(
        "v41-flash",
        dspark_stages=0,
        num_nextn_predict_layers=3,
        compress_ratios=preset_config("v41-flash").compress_ratios + [0, 0, 0],
    )
    assert flash.num_nextn_predict_layers == 3 and flash.compress_ratios[40:] == [0, 0, 0]
    geo = dict(kv_dtype="bf16", index_dtype="fp8", block_size=256)
    spec = build_v41_pool_geometry(flash, speculative_tokens=5, **geo)
    assert spec.state_layers == 43 and spec.field("window").shape == (43, 133, 512)
    assert spec.field("draft_cursor").shape == (3,) and spec.state_bytes == 5_971_968
    plain = build_v41_pool_geometry(flash, speculative_tokens=0, **geo)
    assert "draft_cursor" not in [f.name for f in plain.state_fields]
    assert plain.state_bytes == 5_276_672
    with torch.device("meta"):
        layer = DraftLayer(flash, 41, torch.bfloat16, "bf16")
    assert layer.index == 1 and layer.self_attn.mode is LayerMode.WINDOW
    assert list(layer.eh_proj.weight.shape) == [5120, 10240]
    assert layer.self_attn.rope.mscale == 1.0 and len(layer.mlp.experts) == 384


def test_draft_state_travels_in_images(draft_model):
    seq = tokens(33, 8)
    rt = runtime(draft_model, num_blocks=40)
    _, res = target(rt, seq[:32])
    nxt = seq[1:33]
    ref, _ = reference_draft_forward(draft_model, nxt, res, 0)
    draft(rt, nxt[:16], res[:16], 0)
    units = torch.arange(24, 24 + rt.spec.units_per_image)
    rt.store_image(0, units)
    assert rt.restore_image(units, 2) == 32
    assert int(rt.slots.draft_cursor[2, 0]) == 16  # the draft cursor came with the image
    lg, _ = draft(rt, nxt[16:32], res[16:32], 16, slot=2)
    torch.testing.assert_close(lg, ref[16:32], **TOL)
