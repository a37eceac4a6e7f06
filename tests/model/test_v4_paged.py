"""V4's paged forward (pages, rings, overlap state, chunks, batches) against the oracle.

Tolerance: fp32 compute with fp32 storage agrees with the reference to 1e-4 absolute on logits
of magnitude ~4 (only reduction order differs); greedy tokens must be identical.
"""

import pytest
import torch

from atom.model_api import Span
from atom.models.deepseek_v4.config import V4LayerKind
from atom.models.deepseek_v4.model import DeepseekV4ForCausalLM
from atom.models.deepseek_v4.paged import StateMismatchError
from atom.models.deepseek_v4.presets import preset_config
from atom.models.deepseek_v4.reference import reference_forward, reference_generate
from atom.models.deepseek_v4.runtime import V4Runtime

ATOL = 1e-4


# The V4 test modules import these two fixtures (by their function names, so a test's
# ``v4_tiny`` argument does not shadow an import).
@pytest.fixture(autouse=True, name="one_thread")
def one_thread_fixture():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny forwards on a shared 2-core host
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", name="v4_tiny")
def v4_tiny_fixture():
    return DeepseekV4ForCausalLM(preset_config("v4-tiny")).init_weights(0)


class Harness:
    """One pool, some state slots, and chunk schedules to run (block 16 unless told)."""

    def __init__(self, model, block_size=16, num_blocks=64, num_slots=6, speculative_tokens=0):
        self.rt = V4Runtime(model, block_size=block_size, speculative_tokens=speculative_tokens)
        spec = self.rt.spec
        self.pool = torch.zeros(spec.pool_shape(num_blocks), dtype=spec.pool_dtype)
        self.slot_bytes = torch.zeros(num_slots, spec.state_bytes, dtype=torch.uint8)
        self.rt.bind(self.pool, self.slot_bytes)
        self._next = 0

    def blocks(self, n):
        ids = torch.arange(self._next, self._next + n)
        self._next += n
        return ids

    def run_chunks(self, tokens, bounds, slot, table, start=0, all_logits=True):
        outs = []
        for end in bounds:
            span = Span(start, end, slot, table)
            ids = torch.as_tensor(tokens[start:end])
            m, rt = self.rt.model, self.rt
            outs.append(m.forward_paged(ids, [span], rt.kv, rt.slots, all_logits))
            start = end
        return torch.cat(outs)


def tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 300, (n,), generator=g).tolist()


def assert_matches(paged, ref, atol=ATOL):
    assert paged.shape == ref.shape
    diff = (paged - ref).abs().max().item()
    assert diff < atol, f"max |paged - reference| = {diff}"
    assert torch.equal(paged.argmax(-1), ref.argmax(-1))


def decode_four_meets_the_reference(model, steps: int, seed: int = 20) -> None:
    """Four sequences prefilled alone (29, 40, 1 and 14 tokens: their CSA and HCA groups
    complete at different steps, one sees no compressed row yet), then ``steps`` batched
    decode forwards of one token each: every step's logits meet the full recompute."""
    h = Harness(model)
    prompts = [tokens(n, seed=seed + n) for n in (29, 40, 1, 14)]
    tables = [h.blocks(5) for _ in prompts]
    seqs = [list(p) for p in prompts]
    for i, p in enumerate(prompts):
        h.rt.forward(torch.tensor(p), [Span(0, len(p), i, tables[i])])
    logits = []
    for n in range(steps):
        spans = [Span(len(s), len(s) + 1, i, tables[i]) for i, s in enumerate(seqs)]
        nxt = tokens(4, seed=n)
        for s, t in zip(seqs, nxt):
            s.append(t)
        logits.append(h.rt.forward(torch.tensor(nxt), spans))
    for i, seq in enumerate(seqs):
        n = len(prompts[i])
        ref = reference_forward(model, seq)[n : n + steps]
        assert_matches(torch.stack([st[i] for st in logits]), ref)


@pytest.mark.parametrize(
    "bounds",
    [
        [70],  # one forward
        [16, 32, 48, 64, 70],  # on block boundaries
        [5, 13, 16, 17, 33, 47, 70],  # ending off the ratio-4 and ratio-8 grids
        list(range(1, 71)),  # token by token (decode): every window wrap, every group edge
        [7, 8, 9, 31, 32, 33, 70],  # around window (8) and block (16) edges
        [3, 6, 11, 22, 70],  # straddling two CSA groups and an HCA group in a row
    ],
)
def test_chunk_splits_match_reference(v4_tiny, bounds):
    seq = tokens(70, seed=1)
    h = Harness(v4_tiny)
    paged = h.run_chunks(seq, bounds, slot=2, table=h.blocks(5))
    assert_matches(paged, reference_forward(v4_tiny, seq))


def test_batch_of_sequences_with_different_lengths_and_chunks(v4_tiny):
    h = Harness(v4_tiny)
    seqs = [tokens(n, seed=10 + n) for n in (37, 16, 53, 1)]
    plans = [[5, 16, 29, 37], [16], [13, 32, 33, 48, 53], [1]]
    tables = [h.blocks(4) for _ in seqs]
    got = {i: [] for i in range(len(seqs))}
    starts = [0] * len(seqs)
    for step in range(max(len(p) for p in plans)):
        spans, ids, who = [], [], []
        for i, plan in enumerate(plans):
            if step < len(plan):
                spans.append(Span(starts[i], plan[step], 1 + i, tables[i]))
                ids += seqs[i][starts[i] : plan[step]]
                who.append(i)
        logits = h.rt.forward(torch.tensor(ids), spans)
        for row, i in enumerate(who):
            got[i].append(logits[row])
            starts[i] = plans[i][step]
    for i, plan in enumerate(plans):
        ref = reference_forward(v4_tiny, seqs[i])
        assert_matches(torch.stack(got[i]), ref[torch.tensor(plan) - 1])


def test_prefill_of_several_sequences_runs_batched_with_decodes_alongside(v4_tiny, monkeypatch):
    """Chunks of several sequences in one forward (resumed inside CSA and HCA groups, from 0,
    a one-token prompt) run as one batch per layer (``prefill_attention`` once per layer,
    over every multi-token span), with decode tokens of other sequences in the same forward
    (``decode_core``); every span's logits equal the oracle's."""
    import atom.models.deepseek_v4.paged_attention as v4_attention

    calls = {"prefill": [], "decode": 0}
    real_prefill, real_decode = v4_attention.prefill_attention, v4_attention.decode_core

    def prefill(attn, u, cs, q, qr, win, b, *rest):
        calls["prefill"].append(int(b.tile_span.max()) + 1)
        return real_prefill(attn, u, cs, q, qr, win, b, *rest)

    def decode(*a):
        calls["decode"] += 1
        return real_decode(*a)

    monkeypatch.setattr(v4_attention, "prefill_attention", prefill)
    monkeypatch.setattr(v4_attention, "decode_core", decode)
    h = Harness(v4_tiny)
    seqs = [tokens(n, seed=40 + n) for n in (31, 29, 20, 41)]
    tables = [h.blocks(4) for _ in seqs]
    steps = [  # (sequence, start, end) per forward
        [(0, 0, 13), (1, 0, 6), (2, 0, 1)],
        [(0, 13, 30), (1, 6, 7), (2, 1, 19), (3, 0, 40)],
        [(0, 30, 31), (1, 7, 29), (2, 19, 20), (3, 40, 41)],
    ]
    got = {i: {} for i in range(len(seqs))}
    layers = len(v4_tiny.layers)
    for step in steps:
        calls["prefill"].clear()
        calls["decode"] = 0
        spans = [Span(s, e, i, tables[i]) for i, s, e in step]
        ids = torch.tensor([t for i, s, e in step for t in seqs[i][s:e]])
        logits = h.rt.forward(ids, spans)
        longer = sum(1 for _, s, e in step if e - s > 1 or s == 0)
        single = len(step) - longer
        if single == len(step):  # all decode: the batched decode path, no plan
            assert calls["prefill"] == []
        else:
            assert calls["prefill"] == [longer] * layers
            assert calls["decode"] == (layers if single else 0)
        for row, (i, _, e) in enumerate(step):
            got[i][e - 1] = logits[row]
    for i, seq in enumerate(seqs):
        ref = reference_forward(v4_tiny, seq[: max(got[i]) + 1])
        at = sorted(got[i])
        assert_matches(torch.stack([got[i][p] for p in at]), ref[torch.tensor(at)])


def test_greedy_decode_matches_oracle(v4_tiny):
    h = Harness(v4_tiny)
    prompts = [tokens(29, seed=3), tokens(40, seed=4)]
    tables = [h.blocks(5), h.blocks(5)]
    seqs, starts = [list(p) for p in prompts], [0, 0]
    for _ in range(16):
        spans = [Span(st, len(s), 1 + i, tables[i]) for i, (s, st) in enumerate(zip(seqs, starts))]
        ids = torch.tensor([t for s, st in zip(seqs, starts) for t in s[st:]])
        logits = h.rt.forward(ids, spans)
        for i, row in enumerate(logits):
            starts[i] = len(seqs[i])
            seqs[i].append(int(row.argmax()))
    for prompt, seq in zip(prompts, seqs):
        assert seq[len(prompt) :] == reference_generate(v4_tiny, prompt, 16)


def test_batched_decode_of_sequences_at_different_positions(v4_tiny, monkeypatch):
    """Decode steps of 4 sequences at once (``paged_decode``), at positions that complete
    their CSA and HCA groups at different steps and wrap their windows apart (one starts at
    position 1, no compressed row visible yet), equal the oracle at every step."""
    import atom.models.deepseek_v4.model as v4_model

    calls = []
    real = v4_model.decode_attention
    monkeypatch.setattr(
        v4_model, "decode_attention", lambda *a: calls.append(a[2].pos.tolist()) or real(*a)
    )
    h = Harness(v4_tiny)
    prompts = [tokens(n, seed=20 + n) for n in (29, 40, 1, 14)]
    tables = [h.blocks(5) for _ in prompts]
    seqs = [list(p) for p in prompts]
    for i, p in enumerate(prompts):  # prefill each alone
        h.rt.forward(torch.tensor(p), [Span(0, len(p), i, tables[i])])
    steps = []
    for _ in range(20):
        spans = [Span(len(s), len(s) + 1, i, tables[i]) for i, s in enumerate(seqs)]
        nxt = tokens(4, seed=len(steps))
        for s, t in zip(seqs, nxt):
            s.append(t)
        steps.append(h.rt.forward(torch.tensor(nxt), spans))
    layers = len(v4_tiny.layers)
    assert len(calls) == 20 * layers and calls[0] == [29, 40, 1, 14]
    for i, seq in enumerate(seqs):
        ref = reference_forward(v4_tiny, seq)
        n = len(prompts[i])
        assert_matches(torch.stack([st[i] for st in steps]), ref[n : n + 20])


def test_workload_exercises_every_layer_kind(v4_tiny):
    """70 tokens: top-k (3) below the visible CSA rows (17), HCA rows visible (8), the window
    (8) wraps, and the first two layers route by token id."""
    c = v4_tiny.config
    assert 70 // 4 > c.index_topk and 70 // 8 > 1 and 70 > c.sliding_window
    assert c.layers_of(V4LayerKind.WINDOW) and c.num_hash_layers == 2
    assert c.layer_kinds[1] is V4LayerKind.CSA  # a hash-routed CSA layer


def test_hash_layers_route_by_token_id(v4_tiny):
    moe = v4_tiny.layers[0].ffn
    x = torch.randn(5, v4_tiny.config.hidden_size)
    ids = torch.tensor([3, 3, 7, 11, 3])
    idx, w = moe.route_ids(x, ids)
    assert torch.equal(idx, moe.gate.tid2eid[ids])
    assert torch.allclose(w.sum(-1), torch.full((5,), v4_tiny.config.routed_scaling_factor))
    scored = v4_tiny.layers[3].ffn  # a noaux_tc layer ignores the ids
    a, _ = scored.route_ids(x, ids)
    b, _ = scored.route_ids(x, ids + 1)
    assert torch.equal(a, b)
    seq = tokens(20, seed=5)
    before = reference_forward(v4_tiny, seq)
    saved = moe.gate.tid2eid.clone()
    try:
        moe.gate.tid2eid.copy_((saved + 1) % v4_tiny.config.n_routed_experts)  # other experts
        assert not torch.allclose(reference_forward(v4_tiny, seq), before)
    finally:
        moe.gate.tid2eid.copy_(saved)


def test_forward_refuses_a_span_not_at_the_cursor(v4_tiny):
    h = Harness(v4_tiny)
    seq, table = tokens(20, seed=6), h.blocks(2)
    h.run_chunks(seq, [10], slot=0, table=table)
    with pytest.raises(StateMismatchError, match="state is at 10, forward starts at 12"):
        h.run_chunks(seq, [15], slot=0, table=table, start=12)
    with pytest.raises(StateMismatchError, match="holds no state of this layout"):
        h.run_chunks(seq, [15], slot=3, table=table, start=10)


def test_quantization_simulation_on_matches_reference():
    """With the FP8 (window and compressed NoPE dims) and Hadamard + FP4 (indexer) simulations
    on, as published, the paged path still follows the oracle: the same greedy tokens, logits
    within 1e-2. Splits off the group grid compute a group's projections in two matmuls of other
    shapes; a 1e-7 difference then flips one FP8 rounding of one compressed row here (measured:
    4.2e-3 from position 8 with a split at 3 or 5; 2e-6 with splits on the grid)."""
    cfg = preset_config(
        "v4-tiny", head_dim=80, kv_fp8_sim=True, index_fp4_sim=True, index_head_dim=32
    )
    model = DeepseekV4ForCausalLM(cfg).init_weights(1)
    seq = tokens(50, seed=7)
    h = Harness(model)
    paged = h.run_chunks(seq, [5, 16, 30, 31, 50], slot=1, table=h.blocks(4))
    ref = reference_forward(model, seq)
    assert_matches(paged, ref, atol=1e-2)
    plain = DeepseekV4ForCausalLM(cfg.model_copy(update=dict(kv_fp8_sim=False))).init_weights(1)
    assert not torch.allclose(reference_forward(plain, seq), ref)  # the simulation is live


def test_a_decode_forward_computes_each_rope_tables_angles_once(v4_tiny, monkeypatch):
    """A batched decode forward computes cos and sin once per rope table for its tokens and
    once per table and ratio for its compressed groups (``DecodeBatch.cos_sin``), not once per
    layer: as many calls as there are distinct (table, ratio) pairs among the layers."""
    from atom.models.common.rope import Rope

    calls = []
    real = Rope.cos_sin
    monkeypatch.setattr(Rope, "cos_sin", lambda self, p: calls.append(1) or real(self, p))
    attns = [layer.attn for layer in v4_tiny.layers]
    want = {(a.rope.table_key, 0) for a in attns} | {
        (a.rope.table_key, a.ratio) for a in attns if a.ratio
    }
    assert len(want) < len(attns) + sum(1 for a in attns if a.ratio)  # shared tables
    h = Harness(v4_tiny)
    prompts = [tokens(n, seed=60 + n) for n in (9, 14)]
    tables = [h.blocks(2) for _ in prompts]
    for i, p in enumerate(prompts):
        h.rt.forward(torch.tensor(p), [Span(0, len(p), i, tables[i])])
    calls.clear()
    spans = [Span(len(p), len(p) + 1, i, tables[i]) for i, p in enumerate(prompts)]
    h.rt.forward(torch.tensor(tokens(2, seed=1)), spans)
    assert len(calls) == len(want)
