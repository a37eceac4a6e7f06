"""The batch-invariant mode (``EngineConfig.batch_invariant``) on CPU, both families: a request's
logits (as its logprobs, float32), tokens and the PAGE and image bytes of its prompt are the same
bits alone and inside batches of other requests of other lengths, at other positions in the
batch and under other prefill chunk sizes; the mode's engine still matches the oracle.

The default mode is not invariant on CPU (MKL runs 1-3 row GEMMs through other kernels, the MoE
switches to its dense path for small batches, V4's HCA attention scans the batch's longest row
count); the function tests below show the mode's operations move no bit with the batch.
"""

from __future__ import annotations

import pytest
import torch

from atom import LLM, SamplingParams
from atom.config import EngineConfig
from atom.config_errors import EngineConfigError
from atom.engine.block_pool import block_hashes
from atom.kernels import invariant
from atom.models.common.prefill_tiles import tile_attention

from .test_engine_oracle import assert_greedy_matches_oracle

BLOCK = 16
KW = dict(
    block_size=BLOCK,
    num_blocks=4000,
    max_num_seqs=64,
    dtype="float32",
    kv_dtype="fp32",
    index_dtype="fp32",
    device="cpu",
    batch_invariant=True,
)
PARAMS = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=4)


def prompts_of(lengths, seed, vocab: int = 256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def prompt_bytes(llm: LLM, prompt: list[int], blocks: int | None = None):
    """(PAGE block bytes, image bytes or None) of each full block of ``prompt`` (the first
    ``blocks`` of them), as the engine's pool holds them after the request finished (the blocks
    stay cached)."""
    eng = llm.engine
    pool = eng.runner.pool
    out = []
    for h in block_hashes(prompt, eng.config.block_size)[:blocks]:
        block = eng.pool.lookup(h)
        assert block is not None, "a prompt block left the prefix cache"
        image = eng.store.images.get(h)
        img = None if image is None else pool[list(image.units)].cpu().numpy().tobytes()
        out.append((pool[block].cpu().numpy().tobytes(), img))
    return out


def run(preset: str, target: list[int], others: list[list[int]], at: int, chunk: int):
    """The target's output and prompt bytes, run with ``others`` (target at index ``at``)."""
    llm = LLM(preset, **KW, max_num_batched_tokens=chunk)
    prompts = others[:at] + [target] + others[at:]
    out = llm.generate(prompts, PARAMS)[at]
    got = (out.token_ids, out.logprobs, prompt_bytes(llm, target))
    llm.shutdown()
    return got


@pytest.mark.parametrize("preset", ["v41-tiny", "v4-tiny"])
def test_a_request_computes_the_same_bits_alone_and_in_any_batch(preset):
    target = prompts_of([150], seed=11)[0]
    alone = run(preset, target, [], 0, 256)
    assert any(img is not None for _, img in alone[2]), "no image was stored"
    cases = [  # (other requests' lengths, the target's index, prefill chunk budget)
        ([40], 1, 32),
        ([300, 17, 90, 64, 128, 33, 200], 3, 64),
        ([23 + 9 * i for i in range(31)], 17, 128),
        ([150] * 8, 0, 1024),
        ([10 + i for i in range(63)], 40, 256),
    ]
    for k, (lengths, at, chunk) in enumerate(cases):
        others = prompts_of(lengths, seed=100 + k)
        got = run(preset, target, others, at, chunk)
        assert got[0] == alone[0], f"case {k}: tokens {got[0]} alone {alone[0]}"
        assert got[1] == alone[1], f"case {k}: logprobs differ from the request alone"
        for j, (a, b) in enumerate(zip(got[2], alone[2])):
            assert a[0] == b[0], f"case {k}: PAGE bytes of block {j} differ"
            assert a[1] == b[1], f"case {k}: image bytes at block {j} differ"


@pytest.mark.parametrize("preset", ["v41-tiny", "v4-tiny"])
def test_randomized_batches_and_chunkings_give_the_same_bits(preset):
    """Seeded random cases: how many others (1-40), their lengths (1-400), the target's place
    and the chunk budget (16-512), each against the target alone."""
    import random

    target = prompts_of([200], seed=12)[0]
    alone = run(preset, target, [], 0, 512)
    rng = random.Random(35)
    for k in range(4):
        lengths = [rng.randint(1, 400) for _ in range(rng.randint(1, 40))]
        at, chunk = rng.randint(0, len(lengths)), rng.choice([16, 48, 100, 256, 512])
        got = run(preset, target, prompts_of(lengths, seed=200 + k), at, chunk)
        case = f"case {k} ({len(lengths)} others, at {at}, chunk {chunk})"
        assert got[:2] == alone[:2], f"{case}: tokens or logprobs differ from the request alone"
        assert got[2] == alone[2], f"{case}: PAGE or image bytes differ"


@pytest.mark.parametrize("preset", ["v41-tiny", "v4-tiny"])
def test_a_one_token_tail_chunk_gives_the_same_bits(preset):
    """A 145-token prompt (9 blocks and one token) with images every 16 blocks: in one chunk
    (budget 145), and as 144 tokens then a 1-token chunk (budget 144). The 1-token chunk ran
    as a decode row, whose bits a prefill row's need not be, and the outputs parted (float32):
    a prompt chunk now prefills whatever its length (``Span.prefill``)."""
    prompt = prompts_of([145], seed=4)[0]
    params = SamplingParams(max_tokens=3, ignore_eos=True, logprobs=3)
    outs = []
    for budget in (145, 144):
        kw = dict(KW, max_num_seqs=2, max_num_batched_tokens=budget, checkpoint_interval=16)
        llm = LLM(preset, **kw)
        out = llm.generate([prompt], params)[0]
        outs.append((out.token_ids, [lp.top for lp in out.logprobs]))
        llm.shutdown()
    assert outs[1] == outs[0]


@pytest.mark.parametrize("preset", ["v41-tiny", "v4-tiny"])
def test_a_decoded_token_has_the_bits_of_the_same_token_prefilled(preset):
    """Decode rows and prefill rows compute a token alike: the logprobs of a request's 24
    generated tokens (decode steps) are those a second engine computes for the same tokens as
    prompt tokens (the prompt and the output as one prompt, prefilled in chunks of 32). So the
    next turn of a conversation, resumed from blocks the first turn decoded into (here from
    HBM), computes what a cold engine computes for it. A prefill tile's shared window keys
    once ordered its queries' reductions by their place in the tile (``query_windows``); in
    float32 that moved the last bits (in bfloat16 on CPU the rounding hid it)."""
    kw = dict(KW, max_num_batched_tokens=32)
    prompt, extra = prompts_of([150, 20], seed=5)
    listed = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3)
    llm = LLM(preset, **kw)
    first = llm.generate([prompt], listed)[0]
    full = prompt + first.token_ids[:-1]
    cold = LLM(preset, **kw)
    prefilled = cold.generate(
        [full], SamplingParams(max_tokens=1, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    )[0]
    assert prefilled.prompt_logprobs[len(prompt) :] + prefilled.logprobs == first.logprobs
    # the next turn: its prefix is the first turn's, decoded blocks included
    turn = prompt + first.token_ids + extra
    resumed = llm.generate([turn], listed)[0]
    assert resumed.hbm_hit_tokens > len(prompt), resumed.hbm_hit_tokens
    cold.shutdown()
    fresh = LLM(preset, **kw)
    recomputed = fresh.generate([turn], listed)[0]
    assert recomputed.hbm_hit_tokens == 0
    assert resumed.logprobs == recomputed.logprobs
    llm.shutdown()
    fresh.shutdown()


@pytest.mark.parametrize("preset", ["v41-tiny", "v4-tiny"])
def test_a_preempted_request_decodes_the_bits_of_one_never_preempted(preset):
    """A pool too small for six requests preempts some of them mid-decode; they recompute
    their generated tokens as prefill rows and still give every logprob of the run with room
    for all (decode rows and prefill rows agree in the mode)."""
    prompts = prompts_of([40, 90, 70, 120, 55, 100], seed=8)
    params = SamplingParams(max_tokens=30, ignore_eos=True, logprobs=3)
    outs, preempted = [], []
    for blocks in (4000, 40):
        llm = LLM(preset, **dict(KW, num_blocks=blocks, max_num_batched_tokens=64))
        outs.append([o.logprobs for o in llm.generate(prompts, params)])
        preempted.append(llm.engine.stats()["preemptions"])
        llm.shutdown()
    assert preempted[0] == 0 and preempted[1] > 0, preempted
    assert outs[1] == outs[0]


@pytest.mark.parametrize("preset", ["v41-tiny", "v4-tiny"])
def test_the_mode_matches_the_oracle(preset):
    llm = LLM(preset, **KW, max_num_batched_tokens=48)
    prompts = prompts_of([70, 33, 129, 16, 250], seed=4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    model = llm.engine.runtime.model
    for p, o in zip(prompts, outs):
        assert_greedy_matches_oracle(model, p, o.token_ids)
    llm.shutdown()


# bfloat16 with the storage dtypes the engine resolves for it (on CPU: bf16 KV and index)
BF16 = dict(dtype="bfloat16", kv_dtype="auto", index_dtype="auto")


@pytest.mark.parametrize(
    "preset, lengths, seed, tokens, precision",
    [
        ("v4-tiny", [5, 17, 33, 40], 21, 24, {}),
        ("v41-tiny-draft", [5, 17, 33, 40], 21, 24, {}),
        # lone requests: their plain steps are 1-row decode batches, their verify spans 3-row
        # ones, which torch's bfloat16 CPU GEMMs ran through other kernels (a logprob 1 ulp
        # apart at output 5 resp. 9, before the mode multiplied them as float32)
        ("v4-tiny", [40], 13, 8, BF16),
        ("v41-tiny-draft", [5], 12, 12, BF16),
    ],
)
def test_drafts_change_no_bit_in_the_mode(preset, lengths, seed, tokens, precision):
    """Greedy with drafts (k=2, the model's MTP layer) against plain decoding in the mode:
    the same tokens and logprobs, bit for bit: both families run a verify span's rows as
    decode rows (when V4.1 ran them through its prefill tiles, whose window keys sit at other
    offsets, its logprobs came out 1 ulp apart), whose arithmetic does not depend on how many
    rows share the batch, in float32 and in bfloat16."""
    prompts = prompts_of(lengths, seed=seed)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, logprobs=2)
    kw = dict(KW, max_num_seqs=8, max_num_batched_tokens=128, **precision)
    plain = LLM(preset, **kw).generate(prompts, params)
    llm = LLM(preset, **kw, speculative_tokens=2)
    spec = llm.generate(prompts, params)
    assert llm.engine.stats()["speculative"]["verify_spans"] > 0
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.logprobs for o in spec] == [o.logprobs for o in plain]


def test_the_config_field_flag_and_refusals():
    assert EngineConfig().batch_invariant is False
    assert EngineConfig(batch_invariant="true").batch_invariant is True
    with pytest.raises(EngineConfigError, match="batch_invariant='maybe': use true or false"):
        EngineConfig.build(batch_invariant="maybe")
    with pytest.raises(EngineConfigError, match="tensor_parallel_size=2 with batch_invariant"):
        EngineConfig.build(batch_invariant=True, tensor_parallel_size=2)


def test_building_an_engine_sets_the_mode_for_the_process():
    llm = LLM("v41-tiny", **{**KW, "batch_invariant": True}, max_num_batched_tokens=64)
    assert invariant.enabled()
    llm.shutdown()
    llm = LLM("v41-tiny", **{**KW, "batch_invariant": False}, max_num_batched_tokens=64)
    assert not invariant.enabled()
    llm.shutdown()


def rows_alone(fn, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([fn(x[i : i + 1]) for i in range(x.shape[0])])


@pytest.mark.parametrize("k, n", [(64, 96), (256, 129), (7, 5)])
def test_linear_rows_do_not_depend_on_the_batch(k, n):
    g = torch.Generator().manual_seed(k)
    w, x = torch.randn(n, k, generator=g), torch.randn(100, k, generator=g)
    lin = lambda v: invariant.linear(v, w)  # noqa: E731
    invariant.configure(False)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, w))  # off: the torch call
    invariant.configure(True)
    alone = rows_alone(lin, x)
    for m in (1, 2, 3, 5, 16, 17, 64, 100):
        assert torch.equal(lin(x[:m]), alone[:m]), f"{m} rows"
    perm = torch.randperm(100, generator=g)
    assert torch.equal(lin(x[perm]), alone[perm])


def test_grouped_linear_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(4, 24, 32, generator=g), torch.randn(40, 4, 32, generator=g)
    ref = torch.einsum("ngi,goi->ngo", x, w)
    invariant.configure(True)
    alone = rows_alone(lambda v: invariant.grouped_linear(v, w), x)
    for m in (1, 3, 17, 40):
        assert torch.equal(invariant.grouped_linear(x[:m], w), alone[:m])
    assert torch.allclose(alone, ref, atol=1e-5, rtol=1e-5)


def test_bfloat16_products_do_not_depend_on_the_batch_count():
    """bfloat16 on CPU: torch picks its GEMM kernel by the product of all the sizes, the batch
    count included (oneDNN's past 16^3 multiply-adds: a [B, 2, 64] x [B, 64, 16] product takes
    one kernel for B <= 2, another from 3 on), and the two round some outputs apart. The mode's
    products (and the decode rows' attention built on them: 1 row alone, 3 in a verify span)
    give each row the same bits whatever the batch."""
    from atom.kernels.invariant_attention import sink_attention_rows

    g = torch.Generator().manual_seed(0)
    a = torch.randn(2048, 2, 64, generator=g).bfloat16()
    b = torch.randn(2048, 64, 16, generator=g).bfloat16()
    invariant.configure(True)
    alone = torch.cat([invariant.bmm(a[i : i + 1], b[i : i + 1]) for i in range(2048)])
    for m in (2, 3, 17, 2048):
        same = torch.equal(invariant.bmm(a[:m], b[:m]), alone[:m])
        assert same, f"a batch of {m}: rows other than alone"
    assert torch.allclose(alone.float(), torch.bmm(a.float(), b.float()), atol=0.1, rtol=1e-2)
    g = torch.Generator().manual_seed(2)  # decode rows: 2 heads, a window of 8, 4 picks
    t, h, hd = 1024, 2, 64
    q = torch.randn(t, h, hd, generator=g).bfloat16()
    win = torch.randn(t, 8, hd, generator=g).bfloat16()
    mask = torch.rand(t, 8, generator=g) < 0.8
    mask[:, -1] = True  # every query's own key
    comp = torch.randn(t, 4, hd, generator=g).bfloat16()
    valid = torch.rand(t, 4, generator=g) < 0.7
    sink = torch.randn(h, generator=g)

    def rows(lo: int, hi: int) -> torch.Tensor:
        s = slice(lo, hi)
        return sink_attention_rows(q[s], win[s], mask[s], comp[s], valid[s], sink, 0.125)

    same = torch.equal(torch.cat([rows(i, i + 1) for i in range(t)]), rows(0, t))
    assert same, "decode rows attended together differ from each row alone"


def test_attention_ignores_padding_rows_and_matches_the_default():
    g = torch.Generator().manual_seed(2)
    b, t, h, hd, lw, k = 3, 4, 2, 16, 7, 70
    q = torch.randn(b, t, h, hd, generator=g)
    win = torch.randn(b, lw, hd, generator=g)
    mask = torch.rand(b, t, lw, generator=g) < 0.7
    mask[..., -1] = True  # every query's own key
    comp = torch.randn(b * t, k, hd, generator=g)
    valid = torch.rand(b * t, k, generator=g) < 0.6
    sink = torch.randn(h, generator=g)
    default = tile_attention(q, win, mask, comp, valid, sink, 0.3)
    invariant.configure(True)
    got = tile_attention(q, win, mask, comp, valid, sink, 0.3)  # routed to the mode's order
    assert torch.allclose(got, default, atol=1e-5, rtol=1e-4)
    for extra in (1, 58, 130):  # more rows scanned, none valid: a longer sequence beside it
        padded = torch.cat([comp, torch.randn(b * t, extra, hd, generator=g)], 1)
        pv = torch.cat([valid, torch.zeros(b * t, extra, dtype=torch.bool)], 1)
        assert torch.equal(tile_attention(q, win, mask, padded, pv, sink, 0.3), got), extra
    invariant.configure(False)
    padded = torch.cat([comp, torch.randn(b * t, 130, hd, generator=g)], 1)
    pv = torch.cat([valid, torch.zeros(b * t, 130, dtype=torch.bool)], 1)
    off = tile_attention(q, win, mask, padded, pv, sink, 0.3)
    assert torch.allclose(off, default, atol=1e-5, rtol=1e-4)
