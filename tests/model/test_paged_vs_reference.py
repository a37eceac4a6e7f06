"""The paged forward (pages, rings, chunks, batches) against the oracle (full recompute).

Tolerance: fp32 compute with fp32 storage agrees with the reference to 1e-4 absolute on logits
of magnitude ~5 (only reduction order differs); greedy tokens must be identical.
"""

import pytest
import torch

from atom.models.deepseek_v41.attention import candidate_row_mask, select_topk
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.presets import preset_config
from atom.models.deepseek_v41.reference import reference_forward, reference_generate

from .harness import Harness
from .ties import DecisionTrace

ATOL = 1e-4


def tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 300, (n,), generator=g).tolist()


def assert_matches(paged, ref):
    assert paged.shape == ref.shape
    diff = (paged - ref).abs().max().item()
    assert diff < ATOL, f"max |paged - reference| = {diff}"
    assert torch.equal(paged.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize(
    "bounds",
    [
        [70],  # one forward
        [16, 32, 48, 64, 70],  # on block boundaries
        [5, 13, 16, 17, 33, 47, 70],  # odd positions, inside blocks, straddling ratio-2 groups
        list(range(1, 71)),  # token by token (decode-like): every window wrap-around
        [7, 8, 9, 31, 32, 33, 70],  # around window (8) and block (16) edges
    ],
)
def test_chunk_splits_match_reference(tiny_model, bounds):
    seq = tokens(70, seed=1)
    h = Harness(tiny_model, block_size=16)
    paged = h.run_chunks(seq, bounds, slot=2, table=h.blocks(5), all_logits=True)
    assert_matches(paged, reference_forward(tiny_model, seq))


def test_batch_of_sequences_with_different_lengths_and_chunks(tiny_model):
    h = Harness(tiny_model, block_size=16)
    seqs = [tokens(n, seed=10 + n) for n in (37, 16, 53, 1)]
    plans = [[5, 16, 29, 37], [16], [13, 32, 33, 48, 53], [1]]
    tables = [h.blocks(4) for _ in seqs]
    got = {i: [] for i in range(len(seqs))}
    starts = [0] * len(seqs)
    for step in range(max(len(p) for p in plans)):
        work, who = [], []
        for i, plan in enumerate(plans):
            if step < len(plan):
                work.append((seqs[i], starts[i], plan[step], 1 + i, tables[i]))
                who.append(i)
        logits = h.step(work)
        for row, i in enumerate(who):
            got[i].append(logits[row])
            starts[i] = plans[i][step]
    for i, plan in enumerate(plans):
        ref = reference_forward(tiny_model, seqs[i])
        assert_matches(torch.stack(got[i]), ref[torch.tensor(plan) - 1])


def test_greedy_decode_matches_oracle_for_32_steps(tiny_model):
    h = Harness(tiny_model, block_size=16)
    prompts = [tokens(29, seed=3), tokens(40, seed=4)]
    tables = [h.blocks(5), h.blocks(5)]
    seqs = [list(p) for p in prompts]
    starts = [0, 0]
    for _ in range(32):
        work = [(s, st, len(s), 1 + i, tables[i]) for i, (s, st) in enumerate(zip(seqs, starts))]
        logits = h.step(work)
        for i, row in enumerate(logits):
            starts[i] = len(seqs[i])
            seqs[i].append(int(row.argmax()))
    for prompt, seq in zip(prompts, seqs):
        assert seq[len(prompt) :] == reference_generate(tiny_model, prompt, 32)


def test_workload_exercises_topk_and_candidates(tiny_config):
    """The sequences above are long enough that top-k is smaller than the visible rows and the
    candidate blocks restrict REINDEX (ratio-1 rows visible > candidate rows)."""
    c = tiny_config
    assert 70 // 2 > c.index_topk
    assert 70 // 1 > c.candidate_topk_blocks * c.candidate_block_size
    assert 70 > c.sliding_window


def test_select_topk_ties_go_to_smaller_rows():
    scores = torch.tensor([[1.0, 3.0, 3.0, -float("inf"), 3.0]])
    ids, valid = select_topk(scores, 3)
    assert ids.tolist() == [[1, 2, 4]] and valid.all()
    ids, valid = select_topk(scores, 5)
    assert ids.tolist() == [[1, 2, 4, 0, 3]] and valid.tolist() == [[True] * 4 + [False]]


def test_candidate_blocks_restrict_and_keep_newest():
    inf = float("inf")
    # 7 visible rows in blocks of 2: block scores 5, 9, 1, (newest, partial) 0.5
    scores = torch.tensor([[5.0, 0.0, 9.0, 1.0, 1.0, 0.0, 0.5, -inf]])
    mask = candidate_row_mask(scores, torch.tensor([7]), block_rows=2, keep_blocks=2)
    # newest block (rows 6-7) is forced in, then the best other block (rows 2-3)
    assert mask.tolist() == [[False, False, True, True, False, False, True, True]]


def test_reindex_selection_differs_from_unrestricted(tiny_model):
    """The restriction is live: REINDEX picks only rows inside the candidate blocks."""
    from atom.models.deepseek_v41.attention import layer_selection, mask_invisible

    attn = tiny_model.model.layers[8].self_attn
    n, rows = 40, 40
    g = torch.Generator().manual_seed(0)
    u = torch.randn(n, tiny_model.config.hidden_size, generator=g)
    pos = torch.arange(n)
    cs = attn.rope.cos_sin(pos)
    _, qlat = attn.queries(u, cs)
    keys = torch.randn(rows, tiny_model.config.index_head_dim, generator=g)
    visible = pos + 1
    cand = candidate_row_mask(
        mask_invisible(torch.randn(n, rows, generator=g), visible), visible, 2, 4
    )
    (ids, valid), _ = layer_selection(attn, qlat, u, cs, keys, visible, cand)
    picked = cand.gather(1, ids)
    assert picked[valid].all()
    assert (~cand[-1]).sum() > 0  # late queries have rows outside their candidates


def test_engram_history_starts_at_minus_one(tiny_model):
    h = Harness(tiny_model, block_size=16)
    seq = tokens(5, seed=7)
    h.run_chunks(seq, [2], slot=0, table=h.blocks(1))
    assert h.rt.slots.cursor[0].tolist() == [2, -1, seq[0], seq[1]]
    h.run_chunks(seq[:5], [2, 5], slot=1, table=h.blocks(1))
    assert h.rt.slots.cursor[1].tolist() == [5, seq[2], seq[3], seq[4]]
    # positions before the sequence hash as the pad token (published), cumulatively: once the
    # look-back crosses the start, every longer n-gram is padded too
    pad, a, b, t = tiny_model.config.engram_pad_token_id, seq[0], seq[1], seq[2]
    rows = tiny_model.engram_rows(
        torch.tensor([[-1, -1, -1, t], [-1, a, b, t], [a, -1, b, t], [a, a, b, t]])
    )
    padded = tiny_model.engram_rows(
        torch.tensor([[pad, pad, pad, t], [pad, a, b, t], [pad, pad, b, t], [a, a, b, t]])
    )
    assert torch.equal(rows, padded)
    assert not torch.equal(rows[1], rows[3])  # the oldest id matters when it is in the sequence


def test_mini_block_256_matches_reference():
    cfg = preset_config("v41-mini")
    model = DeepseekV41ForCausalLM(cfg, kv_dtype="fp32", index_dtype="fp32").init_weights(1)
    seq = tokens(600, seed=5)
    h = Harness(model, block_size=256, num_blocks=8, num_slots=2)
    trace = DecisionTrace()  # v41-mini has choices that rounding decides: test_near_ties.py
    with trace.recording():
        paged = h.run_chunks(
            seq, [256, 301, 512, 513, 600], slot=1, table=h.blocks(3), all_logits=True
        )
    with trace.forcing():
        ref = reference_forward(model, seq)
    assert_matches(paged, ref)


def test_bfloat16_matches_reference_within_bf16_tolerance(tiny_config):
    model = DeepseekV41ForCausalLM(
        tiny_config, dtype=torch.bfloat16, kv_dtype="bf16", index_dtype="bf16"
    ).init_weights(0)
    seq = tokens(48, seed=2)
    h = Harness(model, block_size=16)
    paged = h.run_chunks(seq, [16, 21, 48], slot=0, table=h.blocks(3), all_logits=True)
    ref = reference_forward(model, seq)
    rel = ((paged - ref).norm() / ref.norm()).item()
    assert rel < 0.05, rel
    assert (paged.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
