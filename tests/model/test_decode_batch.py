"""The batched decode path (single-token spans of a forward) against the oracle, mixed with
longer spans, and the MoE's dense and routed paths against each other."""

import pytest
import torch

from atom.models.common.formats import fp4_act_sim
from atom.models.common.moe import MoE
from atom.models.common.storage import kv_roundtrip
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.reference import reference_forward
from atom.models.deepseek_v41.weights import load_weights, save_weights

from .harness import Harness
from .test_paged_vs_reference import assert_matches, tokens


def _decode_with_neighbours(h, seqs, tables, prefill, chunks):
    """Prefill each sequence to ``prefill[i]``, then step every sequence one token at a time
    while sequence ``chunks[0]`` advances ``chunks[1]`` tokens per step (a multi-token span in
    the same forwards). Returns each sequence's logits per position it computed."""
    pos = list(prefill)
    got = {i: {} for i in range(len(seqs))}
    logits = h.step([(s, 0, p, 1 + i, tables[i]) for i, (s, p) in enumerate(zip(seqs, pos))])
    for i, row in enumerate(logits):
        got[i][pos[i] - 1] = row
    chunked, width = chunks
    while any(p < len(s) for p, s in zip(pos, seqs)):
        work, who = [], []
        for i, s in enumerate(seqs):
            if pos[i] < len(s):
                end = min(len(s), pos[i] + (width if i == chunked else 1))
                work.append((s, pos[i], end, 1 + i, tables[i]))
                who.append((i, end))
        for row, (i, end) in zip(h.step(work), who):
            got[i][end - 1] = row
            pos[i] = end
    return got


def test_decode_batch_at_different_positions_with_a_chunk_alongside_matches_reference(
    tiny_model, tiny_config
):
    """Four sequences decode together from 1, 6, 33 and 52 tokens (fewer rows than top-k, odd
    and even positions: ratio-2 groups completing for some and not others, windows wrapping),
    while a fifth runs 7-token chunks in the same forwards."""
    c = tiny_config
    h = Harness(tiny_model, block_size=16, num_slots=7)
    lengths = [30, 30, 60, 70, 66]
    seqs = [tokens(n, seed=40 + i) for i, n in enumerate(lengths)]
    tables = [h.blocks(5) for _ in seqs]
    prefill = [1, 6, 33, 52, 5]
    assert prefill[1] // 2 < c.index_topk < prefill[3] // 2  # short and long row counts
    got = _decode_with_neighbours(h, seqs, tables, prefill, chunks=(4, 7))
    for i, s in enumerate(seqs):
        ref = reference_forward(tiny_model, s)
        positions = sorted(got[i])
        assert positions[-1] == len(s) - 1
        assert_matches(torch.stack([got[i][p] for p in positions]), ref[torch.tensor(positions)])


def test_a_decode_token_computes_the_same_alone_or_in_a_batch(tiny_model):
    """Logits of a sequence's decode steps do not depend on which others share the batch."""
    seqs = [tokens(40, seed=7), tokens(40, seed=8), tokens(40, seed=9)]
    alone, batched = Harness(tiny_model, block_size=16), Harness(tiny_model, block_size=16)
    t_alone = [alone.blocks(3)]
    t_batched = [batched.blocks(3) for _ in seqs]
    a = _decode_with_neighbours(alone, seqs[:1], t_alone, [20], chunks=(-1, 1))
    b = _decode_with_neighbours(batched, seqs, t_batched, [20, 9, 31], chunks=(-1, 1))
    for p in range(20, 40):
        assert torch.allclose(a[0][p], b[0][p], atol=1e-5, rtol=0)
        assert torch.equal(a[0][p].argmax(), b[0][p].argmax())


def _moe(config):
    torch.manual_seed(0)
    m = MoE(config, torch.float32)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(std=0.05)
    return m


@pytest.mark.parametrize("tokens_n", [1, 4, 9])
def test_moe_dense_and_routed_paths_agree(tiny_config, tokens_n):
    m = _moe(tiny_config)
    x = torch.randn(tokens_n, tiny_config.hidden_size)
    with torch.no_grad():
        dense_used = tokens_n * m.top_k >= len(m.experts)
        a = m(x)
        m.DENSE_MAX_TOKENS = 0  # force routed
        b = m(x)
    assert dense_used == (tokens_n >= 2)
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_moe_stacked_weights_follow_loads_moves_and_saves(tiny_config, tmp_path):
    model = DeepseekV41ForCausalLM(tiny_config).init_weights(1)
    moe = model.model.layers[0].mlp
    x = torch.randn(4, tiny_config.hidden_size)
    with torch.no_grad():
        first = moe(x)  # dense: stacks the experts' weights, parameters become views
        gate, _, _ = moe.stacked_weights()
        assert moe.experts[1].gate_proj.weight.data_ptr() == gate[1].data_ptr()
        save_weights(model, tmp_path)  # shared storage must not stop a save
        other = DeepseekV41ForCausalLM(tiny_config).init_weights(2)
        save_weights(other, tmp_path / "other")
        load_weights(model, tmp_path / "other")  # loads copy into the views
        theirs = other.model.layers[0].mlp.experts[1].gate_proj.weight
        assert torch.equal(moe.stacked_weights()[0][1], theirs)
        assert not torch.allclose(moe(x), first)
        load_weights(model, tmp_path)
        assert torch.equal(moe(x), first)
        model.to(torch.float64).to(torch.float32)  # replaced parameters: restacked, same math
        gate, _, _ = moe.stacked_weights()
        assert moe.experts[1].gate_proj.weight.data_ptr() == gate[1].data_ptr()
        assert torch.allclose(moe(x), first, atol=1e-6)


def test_moe_trains_through_the_dense_path(tiny_config):
    m = _moe(tiny_config)
    x = torch.randn(4, tiny_config.hidden_size)
    m(x).square().sum().backward()
    grads = [e.gate_proj.weight.grad for e in m.experts]
    assert all(g is not None for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0


def test_a_decode_step_of_all_rows_uses_them_as_they_are_with_the_gathered_paths_bits(
    tiny_model, monkeypatch
):
    """A forward whose rows are all single-token spans reads the flat batch's tensors as they
    are (``DecodeBatch.all_rows``: no gather, the attention rows are the layer's output); the
    same step with the rows gathered and scattered computes the same bits; a forward with a
    longer span beside them takes the gathered path."""
    from atom.models.deepseek_v41 import model as model_module

    seen = []
    real = model_module.paged_attention

    def spy(attn, u, angles, seqs, decode, *rest):
        seen.append(None if decode is None else decode.all_rows)
        return real(attn, u, angles, seqs, decode, *rest)

    monkeypatch.setattr(model_module, "paged_attention", spy)
    seqs = [tokens(24, seed=70 + i) for i in range(3)]
    got = []
    for whole in (True, False):
        h = Harness(tiny_model, block_size=16, num_slots=4)
        tables = [h.blocks(2) for _ in seqs]
        h.step([(s, 0, 9 + 3 * i, 1 + i, tables[i]) for i, s in enumerate(seqs)])
        if not whole:
            import atom.models.deepseek_v41.forward_plan as plan_module

            class Gathered(plan_module.DecodeBatch):
                def __init__(self, *a, all_rows=False, **k):
                    super().__init__(*a, all_rows=False, **k)

            monkeypatch.setattr(plan_module, "DecodeBatch", Gathered)
        seen.clear()
        got.append(
            h.step([(s, 9 + 3 * i, 10 + 3 * i, 1 + i, tables[i]) for i, s in enumerate(seqs)])
        )
        assert set(seen) == {whole}
    assert torch.equal(got[0], got[1])
    monkeypatch.undo()
    monkeypatch.setattr(model_module, "paged_attention", spy)
    h = Harness(tiny_model, block_size=16, num_slots=4)
    tables = [h.blocks(2) for _ in seqs]
    h.step([(seqs[0], 0, 5, 1, tables[0]), (seqs[1], 0, 6, 2, tables[1])])
    seen.clear()
    h.step([(seqs[0], 5, 6, 1, tables[0]), (seqs[1], 6, 10, 2, tables[1])])
    assert set(seen) == {False}


def test_layers_of_one_rope_table_share_the_forwards_angles(tiny_model, monkeypatch):
    """A forward computes the cos and sin of its positions once per RoPE table (``Angles``),
    not once per layer, and its compressed groups' once per table and ratio: as many calls as
    the layers have distinct tables, plus one per compressor ratio above 1."""
    from atom.models.common.rope import Rope

    layers = tiny_model.model.layers
    keys = {layer.self_attn.rope.table_key for layer in layers}
    assert 1 < len(keys) < len(layers)  # the tiny pattern has both kinds of layer, repeated
    calls = []
    real = Rope.cos_sin

    def counted(self, positions):
        calls.append(self.table_key)
        return real(self, positions)

    monkeypatch.setattr(Rope, "cos_sin", counted)
    _decode_step_after_prefill(tiny_model, seed=90, before_step=calls.clear)
    # the compressors' rows rotate at their group's first position: one call per table and
    # ratio above 1 (``DecodeBatch.group_angles``); a ratio-1 group starts at p, whose angles
    # the layer has
    groups = {
        (a.rope.table_key, a.ratio)
        for a in (layer.self_attn for layer in layers)
        if a.mode.name == "FULL" and a.ratio > 1
    }
    assert 0 < len(groups) < sum(1 for layer in layers if layer.self_attn.mode.name == "FULL")
    assert sorted(set(calls)) == sorted(keys)
    assert len(calls) == len(keys) + len(groups)


def test_layers_that_reuse_a_selection_read_its_picks_once(tiny_model, monkeypatch):
    """A decode forward turns each selection into gather ids once (``DecodeBatch.picks``),
    however many layers read it: as many calls as the compressed layers have selection owners."""
    from atom.models.deepseek_v41 import paged_decode

    calls = []
    real = paged_decode.picked_ids
    monkeypatch.setattr(paged_decode, "picked_ids", lambda sel: calls.append(1) or real(sel))
    compressed = [layer.self_attn for layer in tiny_model.model.layers]
    owners = {a.sel_owner for a in compressed if a.ratio > 0}
    assert len(owners) < sum(1 for a in compressed if a.ratio > 0)  # some layers reuse
    _decode_step_after_prefill(tiny_model, seed=110, before_step=calls.clear)
    assert len(calls) == len(owners)


def test_an_owners_index_keys_are_read_once_until_its_rows_are_written():
    """``DecodeBatch.index_keys`` reads an owner's index rows once a forward; after its layer
    writes them (``rows_written``) the next ask reads them again; the visibility is per ratio."""
    from atom.models.deepseek_v41.paged_decode import DecodeBatch

    reads = []

    class Rows:
        def read_index_rows(self, owner, tables, count):
            reads.append((owner, count))
            return torch.full((2, count, 4), float(len(reads))), None

    pos = torch.tensor([5, 9])
    batch = DecodeBatch(torch.arange(2), torch.tensor([1, 2]), pos, torch.zeros(2, 1), 10)
    kv = Rows()
    keys, visible = batch.index_keys(kv, 6, 2)
    again, visible_again = batch.index_keys(kv, 6, 2)
    assert reads == [(6, 5)] and again is keys and visible_again is visible
    assert visible.tolist() == [3, 5]  # rows complete by p: (p + 1) // 2
    batch.index_keys(kv, 4, 2)
    batch.rows_written(6)
    fresh, _ = batch.index_keys(kv, 6, 2)
    assert reads == [(6, 5), (4, 5), (6, 5)] and fresh[0, 0, 0] == 3.0
    batch.index_keys(kv, 4, 2)  # another owner's memo survives the write
    assert len(reads) == 3


def test_window_offsets_name_the_ring_rows_the_gather_reads():
    """``DecodeBatch.window_offsets`` (the decode kernel's ``RingWindow``): element offsets
    from a layer's ring plane that hit the rows ``window_index`` names for each token's slot,
    the same tensor for every layer's plane."""
    from atom.kernels.attention import RingWindow, gather_offsets
    from atom.models.deepseek_v41.paged_decode import DecodeBatch

    pos, slot = torch.tensor([0, 3, 11]), torch.tensor([2, 0, 1])
    batch = DecodeBatch(torch.arange(3), slot, pos, torch.zeros(3, 1), 12)
    rings = torch.randn(3, 4, 6, 8)[:, :, :5]  # [slots, layers, ring rows, hd], strided
    window, ring_rows = 4, rings.shape[2]
    rows = batch.window_index(window, ring_rows)[0]
    at = batch.window_offsets(rings[:, 1], window)
    assert at is batch.window_offsets(rings[:, 3], window)
    assert rows.tolist() == [[0, 0, 0], [0, 1, 2], [3, 4, 0]]  # p - 3 .. p - 1 mod 5
    for layer in (1, 3):
        plane = rings[:, layer]
        assert torch.equal(gather_offsets(at, plane), plane[slot[:, None], rows])
        own = torch.randn(3, 8)
        keys = RingWindow(plane, at, own).keys()
        assert torch.equal(keys, torch.cat([plane[slot[:, None], rows], own[:, None]], 1))


def test_a_decode_step_reads_each_owners_index_rows_once(tiny_model, monkeypatch):
    """In a decode forward, a REINDEX layer over an owner whose rows its own layer already read
    (after writing them) reads the same keys: one read per owner."""
    from atom.models.common.paged import PagedKV

    reads = []
    real = PagedKV.read_index_rows
    monkeypatch.setattr(
        PagedKV, "read_index_rows", lambda self, o, t, c: reads.append(o) or real(self, o, t, c)
    )
    attns = [layer.self_attn for layer in tiny_model.model.layers]
    readers = [a.kv_owner for a in attns if a.mode.name in ("FULL", "REINDEX")]
    assert len(set(readers)) < len(readers)
    _decode_step_after_prefill(tiny_model, seed=130, before_step=reads.clear)
    assert sorted(reads) == sorted(set(readers))


def _decode_step_after_prefill(model, seed: int, before_step) -> None:
    """Two sequences of ``model`` prefilled to 7 tokens, then one decode step of both;
    ``before_step`` runs between them (to reset what a test counts)."""
    seqs = [tokens(20, seed=seed + i) for i in range(2)]
    h = Harness(model, block_size=16, num_slots=3)
    tables = [h.blocks(2) for _ in seqs]
    h.step([(s, 0, 7, 1 + i, tables[i]) for i, s in enumerate(seqs)])
    before_step()
    h.step([(s, 7, 8, 1 + i, tables[i]) for i, s in enumerate(seqs)])


def test_compressed_rows_cast_once_and_rotate_in_place_with_the_copying_bits():
    """``compressed_rows`` in bfloat16 casts the float32 latents once for both readers and
    rotates that cast in place: the main rows and index keys of the expression that cast twice
    and rotated a copy, and the latents stay as given."""
    from atom.models.deepseek_v41.config import LayerMode
    from atom.models.deepseek_v41.presets import preset_config

    config = preset_config("v41-tiny")
    model = DeepseekV41ForCausalLM(config, dtype=torch.bfloat16).init_weights(3)
    attn = next(
        layer.self_attn
        for layer in model.model.layers
        if layer.self_attn.mode is LayerMode.FULL and layer.self_attn.ratio > 1
    )
    latents = torch.randn(5, config.head_dim)
    given = latents.clone()
    cs = attn.rope.cos_sin(torch.arange(5) * attn.ratio)
    with torch.no_grad():
        main, keys = attn.compressed_rows(latents, cs)
        want_main = attn.rope.apply(latents.to(torch.bfloat16), cs)
        if attn.compressed_fp4_sim:
            want_main = fp4_act_sim(want_main, 16, "e4m3")
        want_main = kv_roundtrip(want_main, attn.kv_dtype)
        k = attn.indexer.k_norm(attn.indexer.wk(latents.to(torch.bfloat16))).float()
        want_keys = attn.index_round(attn.index_rope.apply_(k, cs))
    assert torch.equal(main, want_main) and torch.equal(keys, want_keys)
    assert torch.equal(latents, given)
