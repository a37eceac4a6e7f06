"""V4.1 target rewind (speculative decoding's verify side, ``atom.models.deepseek_v41.paged``):
a span may start up to ``speculative_tokens`` behind its slot's cursor, re-running positions
whose inputs were rejected drafts. Speculative runs (verify spans with wrong and right drafts,
then continuing from the accepted prefix) against plain token-by-token decoding: the logits at
every committed position, the state a later forward reads, the continuation, image bytes;
several slots with different rewinds in one forward; the decode graphs' eager fallback; and
the refusals, before any write."""

import pytest
import torch

from atom.model_api import Span
from atom.models.deepseek_v41.decode_graphs import EagerBackend
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.paged import StateMismatchError
from atom.models.deepseek_v41.presets import preset_config
from atom.models.deepseek_v41.runtime import V41Runtime

ATOL = 1e-4  # as the paged-vs-reference tests
BLOCKS = 6  # blocks per slot (block 16: 96 positions)


@pytest.fixture(scope="module")
def tiny():
    return DeepseekV41ForCausalLM(preset_config("v41-tiny")).init_weights(0)


def runtime(model, k, num_slots=3, graphs=False):
    """Slots 0.. (``BLOCKS`` blocks each), then room for one image at ``image_units``."""
    rt = V41Runtime(model, block_size=16, speculative_tokens=k)
    if graphs:
        assert rt.enable_decode_graphs(4, backend=EagerBackend())
    spec = rt.spec
    rt.image_units = torch.arange(spec.units_per_image) + BLOCKS * num_slots
    nb = BLOCKS * num_slots + spec.units_per_image + rt.reserved_blocks
    pool = torch.zeros(spec.pool_shape(nb), dtype=spec.pool_dtype)
    rt.bind(pool, torch.zeros(num_slots + rt.reserved_slots, spec.state_bytes, dtype=torch.uint8))
    return rt


def table(slot):
    return torch.arange(BLOCKS) + BLOCKS * slot


def tokens(n, seed):
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed))


def forward(rt, spans, ids):
    """All logits [N, V] of a forward of (start, end, slot) spans through the runtime."""
    sp = [Span(s, e, slot, table(slot)) for s, e, slot in spans]
    logits, _ = rt.forward_with_residual(torch.cat(ids), sp, all_logits=True)
    return logits


def plain(model, seq, prefill, k):
    """Plain decoding: a prefill of ``prefill`` tokens, then one token a forward. Returns the
    logits of every position [len(seq), V] and the runtime (slot 0 at len(seq))."""
    rt = runtime(model, k, num_slots=1)
    out = [forward(rt, [(0, prefill, 0)], [seq[:prefill]])]
    for p in range(prefill, len(seq)):
        if rt.cuda_graphs:
            out.append(rt.forward(seq[p : p + 1], [Span(p, p + 1, 0, table(0))]))
        else:
            out.append(forward(rt, [(p, p + 1, 0)], [seq[p : p + 1]]))
    return torch.cat(out), rt


def speculative(rt, seqs, prefill, k, seed, final=None):
    """Speculative runs of ``seqs`` in slots 0.. (one forward per step, every unfinished slot
    in it): each step runs [c, c + L) (L in [1, k + 1]) with the committed token at c and
    L - 1 drafts, the first j right, the rest random (sometimes right too), and commits
    c + 1 + j; a slot stops once it committed ``final`` positions. Returns (each slot's
    logits at its committed positions [committed, V], each slot's committed count)."""
    g = torch.Generator().manual_seed(seed)
    n = len(seqs)
    logits = [[] for _ in range(n)]
    first = forward(rt, [(0, prefill, s) for s in range(n)], [q[:prefill] for q in seqs])
    for s in range(n):
        logits[s].append(first[s * prefill : (s + 1) * prefill])
    done = [prefill] * n  # committed positions (their inputs are right, logits recorded)
    end = final or len(seqs[0])
    while any(c < end for c in done):
        spans, ids, acc = [], [], []
        for s, c in enumerate(done):
            if c >= end:
                continue
            length = int(torch.randint(1, k + 2, (1,), generator=g))
            length = min(length, len(seqs[s]) - c)
            j = int(torch.randint(0, length, (1,), generator=g))
            span = seqs[s][c : c + length].clone()
            wrong = torch.randint(0, 320, (length,), generator=g)
            keep = torch.rand(length, generator=g) < 0.3  # some later drafts right anyway
            span[1 + j :] = torch.where(keep[1 + j :], span[1 + j :], wrong[1 + j :])
            spans.append((c, c + length, s))
            ids.append(span)
            acc.append(j)
        rt.rewinds = getattr(rt, "rewinds", 0) + sum(c < rt.slots.position(s) for c, _, s in spans)
        out = forward(rt, spans, ids)
        lo = 0
        for (c, e, s), j in zip(spans, acc):
            logits[s].append(out[lo : lo + 1 + j])
            done[s] = c + 1 + j
            lo += e - c
    return [torch.cat(x) for x in logits], done


def assert_close(a, b):
    assert a.shape == b.shape
    diff = (a - b).abs().max().item()
    assert diff < ATOL, f"max |speculative - plain| = {diff}"


def assert_read_state_matches(rt, slot, ref, ref_slot, at):
    """Everything a forward at ``at`` reads from the slot (and its PAGE rows) is the plain
    run's: cursor and Engram ids exactly, window ring rows of [at - window + 1, at),
    compressor ring rows of [at - max_ratio + 1, at), PAGE rows [0, at // r)."""
    a, b = rt.slots, ref.slots
    assert a.host_position[slot] == b.host_position[ref_slot] == at
    assert torch.equal(a.cursor[slot], b.cursor[ref_slot])
    c = rt.model.config
    win = torch.arange(max(0, at - c.sliding_window + 1), at)
    rw = rt.geometry.window_rows
    assert_close(a.window[slot][:, win % rw].float(), b.window[ref_slot][:, win % rw].float())
    comp = torch.arange(max(0, at - c.max_ratio + 1), at) % rt.geometry.compressor_rows
    assert_close(a.comp_values[slot][:, comp], b.comp_values[ref_slot][:, comp])
    assert_close(a.comp_scores[slot][:, comp], b.comp_scores[ref_slot][:, comp])
    for owner in c.compressor_owners:
        count = at // c.compress_ratios[owner]
        mine = rt.kv.read_rows(owner, table(slot), count)
        theirs = ref.kv.read_rows(owner, table(ref_slot), count)
        for x, y in zip(mine, theirs):
            if x is not None:
                assert_close(x.float(), y.float())


def continue_plainly(rt, seqs, done):
    """One token a forward, every unfinished slot in it, from its committed count (the
    cursor may be up to k ahead: a rewind) to the end of its sequence; the logits."""
    out = [[] for _ in seqs]
    done = list(done)
    while any(c < len(q) for c, q in zip(done, seqs)):
        live = [s for s, q in enumerate(seqs) if done[s] < len(q)]
        spans = [(done[s], done[s] + 1, s) for s in live]
        got = forward(rt, spans, [seqs[s][done[s] : done[s] + 1] for s in live])
        for r, s in enumerate(live):
            out[s].append(got[r : r + 1])
            done[s] += 1
    return [torch.cat(x) if x else None for x in out]


@pytest.fixture(scope="module")
def tiny_draft():
    return DeepseekV41ForCausalLM(preset_config("v41-tiny-draft")).init_weights(0)


@pytest.mark.parametrize("k,seed,preset", [(1, 0, ""), (2, 1, "draft"), (3, 2, "")])
def test_speculative_equals_plain_decoding(tiny, tiny_draft, k, seed, preset):
    """v41-tiny, and v41-tiny-draft (its state also holds the draft rings and cursors)."""
    model = tiny_draft if preset else tiny
    seq = tokens(52, seed=10 + seed)  # crosses blocks at 16, 32, 48 and every ratio-2 group
    ref_logits, ref = plain(model, seq, 5, k)
    rt = runtime(model, k, num_slots=1)
    assert (rt.slots.draft_cursor is not None) == bool(preset)
    [logits], [done] = speculative(rt, [seq], 5, k, seed, final=44)
    assert 44 <= done <= 44 + k and len(logits) == done and rt.rewinds >= 3
    assert_close(logits, ref_logits[:done])
    at, f = rt.slots.position(0), rt.slots.frontier(0)
    assert done <= at <= f <= done + k
    [tail] = continue_plainly(rt, [seq], [done])
    assert_close(tail, ref_logits[done:])
    assert_read_state_matches(rt, 0, ref, 0, 52)


def test_several_slots_with_different_rewinds_in_one_forward(tiny):
    k = 3
    seqs = [tokens(n, seed=20 + n) for n in (40, 37, 45)]
    refs = [plain(tiny, q, 6, k) for q in seqs]
    rt = runtime(tiny, k)
    got, done = speculative(rt, seqs, 6, k, seed=5, final=30)
    assert rt.rewinds >= 6
    tails = continue_plainly(rt, seqs, done)
    for s, (ref_logits, ref) in enumerate(refs):
        assert_close(torch.cat([got[s], tails[s]]), ref_logits)
        assert_read_state_matches(rt, s, ref, 0, len(seqs[s]))


def test_rewound_single_token_spans_after_a_rejected_run(tiny):
    """Junk at [p, p + k) then re-running p, p + 1, ... one token each: the frontier stays
    past the cursor meanwhile (spans ending behind it), and everything matches."""
    k = 3
    seq = tokens(40, seed=3)
    ref_logits, ref = plain(tiny, seq, 4, k)
    rt = runtime(tiny, k, num_slots=1)
    out = [forward(rt, [(0, 4, 0)], [seq[:4]])]
    g = torch.Generator().manual_seed(7)
    for p in range(4, 40, k):
        forward(rt, [(p, p + k, 0)], [torch.randint(0, 320, (k,), generator=g)])
        for q in range(p, p + k):
            out.append(forward(rt, [(q, q + 1, 0)], [seq[q : q + 1]]))
            assert rt.slots.frontier(0) == p + k and rt.slots.position(0) == q + 1
    assert_close(torch.cat(out), ref_logits[:40])
    assert_read_state_matches(rt, 0, ref, 0, 40)


def test_image_after_rewind_and_rerun_equals_plain_image(tiny):
    """Rejected drafts (a verify span, or single tokens), then the positions re-run one token
    a forward (the plain run's arithmetic): at a committed boundary whose frontier is the
    cursor, the slot's image is the plain run's, byte for byte."""
    k = 2
    seq = tokens(34, seed=4)
    _, ref = plain(tiny, seq, 6, k)
    rt = runtime(tiny, k, num_slots=1)
    forward(rt, [(0, 6, 0)], [seq[:6]])
    g = torch.Generator().manual_seed(9)
    p, rounds = 6, 0
    while p + k <= 34:
        junk = torch.randint(0, 320, (k,), generator=g)
        if rounds % 2:
            forward(rt, [(p, p + k, 0)], [junk])  # a verify span, every draft rejected
        else:
            for q in range(k):
                forward(rt, [(p + q, p + q + 1, 0)], [junk[q : q + 1]])
        step = 1 + rounds % k
        for q in range(p, p + step):
            forward(rt, [(q, q + 1, 0)], [seq[q : q + 1]])
        p, rounds = p + step, rounds + 1
    for q in range(p, 34):
        forward(rt, [(q, q + 1, 0)], [seq[q : q + 1]])
    assert rt.slots.position(0) == rt.slots.frontier(0) == ref.slots.position(0) == 34
    rt.store_image(0, rt.image_units)
    ref.store_image(0, ref.image_units)
    assert torch.equal(rt.slot_bytes[0], ref.slot_bytes[0])
    mine, theirs = (x.pool.view(torch.uint8)[x.image_units] for x in (rt, ref))
    assert torch.equal(mine, theirs)


def snapshot(rt):
    return rt.slot_bytes.clone(), rt.pool.view(torch.uint8).clone()


def assert_untouched(rt, before):
    assert torch.equal(rt.slot_bytes, before[0])
    assert torch.equal(rt.pool.view(torch.uint8), before[1])


def test_refusals_before_any_write(tiny):
    seq = tokens(30, seed=6)
    rt0 = runtime(tiny, 0, num_slots=2)
    forward(rt0, [(0, 12, 0), (0, 5, 1)], [seq[:12], seq[:5]])
    before = snapshot(rt0)
    with pytest.raises(StateMismatchError, match="slot 0: state is at 12, forward starts at 11"):
        forward(rt0, [(5, 6, 1), (11, 13, 0)], [seq[5:6], seq[11:13]])  # k = 0: never behind
    assert_untouched(rt0, before)
    k = 2
    rt = runtime(tiny, k, num_slots=2)
    forward(rt, [(0, 12, 0), (0, 5, 1)], [seq[:12], seq[:5]])
    before = snapshot(rt)
    for start in (9, 13):  # the cursor more than k ahead; a span past the cursor
        with pytest.raises(StateMismatchError, match=f"state is at 12, forward starts at {start}"):
            forward(rt, [(5, 6, 1), (start, start + 1, 0)], [seq[5:6], seq[start : start + 1]])
        assert_untouched(rt, before)
    forward(rt, [(10, 11, 0)], [seq[10:11]])  # 2 behind: accepted; the frontier stays at 12
    assert (rt.slots.position(0), rt.slots.frontier(0)) == (11, 12)
    before = snapshot(rt)
    with pytest.raises(StateMismatchError, match=r"needs it in \[9, 11\], frontier 12"):
        forward(rt, [(9, 10, 0)], [seq[9:10]])  # the cursor is in range, the frontier is not
    assert_untouched(rt, before)
    forward(rt, [(11, 13, 0)], [seq[11:13]])
    assert (rt.slots.position(0), rt.slots.frontier(0)) == (13, 13)


def test_decode_graphs_replay_plain_steps_and_run_rewinds_eagerly(tiny):
    """With k >= 1 a graph replays single-token spans at their cursor (the Engram history
    shifts inside it); a rewound one (or one whose frontier is past its cursor) runs eagerly;
    the results equal the eager runtime's."""
    k = 2
    seqs = [tokens(30, seed=40 + s) for s in range(2)]
    eager = runtime(tiny, k, num_slots=2)
    graphs = runtime(tiny, k, num_slots=2, graphs=True)
    replays = []
    for rt in (eager, graphs):
        forward(rt, [(0, 8, 0), (0, 10, 1)], [seqs[0][:8], seqs[1][:10]])
    junk = tokens(2, seed=12)
    right = [(s, s + 1, 0, seqs[0][s : s + 1]) for s in range(8, 14)]
    steps = [  # slot 1: plain, rejected drafts at 11, 12, re-run 11 (behind), 12 (frontier 13)
        [(10, 11, 1, seqs[1][10:11])],
        [(11, 13, 1, junk)],
        [(11, 12, 1, seqs[1][11:12])],
        [(12, 13, 1, seqs[1][12:13])],
        [(13, 14, 1, seqs[1][13:14])],
        [(14, 15, 1, seqs[1][14:15])],
    ]
    for step, mine in zip(steps, right):
        spans = [mine, *step]
        outs = []
        for rt in (eager, graphs):
            n = rt.graphs.replays if rt.graphs is not None else 0
            sp = [Span(a, b, slot, table(slot)) for a, b, slot, _ in spans]
            out = rt.forward(torch.cat([ids for *_, ids in spans]), sp)
            outs.append(out)
            if rt.graphs is not None:
                replays.append(rt.graphs.replays - n)
        assert_close(outs[1], outs[0])
    assert replays == [1, 0, 0, 0, 1, 1]
    for s in range(2):
        at = eager.slots.position(s)
        assert torch.equal(eager.slots.cursor[s], graphs.slots.cursor[s])
        assert torch.equal(eager.slots.history[s], graphs.slots.history[s])
        assert graphs.slots.frontier(s) == eager.slots.frontier(s) == at
        assert_read_state_matches(graphs, s, eager, s, at)
