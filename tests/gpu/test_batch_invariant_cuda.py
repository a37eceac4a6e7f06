"""The batch-invariant mode on CUDA in bfloat16, both families: a request alone and inside
batches of other requests (other lengths, positions and chunk budgets) computes the same
logprobs, tokens and PAGE/image bytes, bit for bit (tests/engine/test_batch_invariant.py is
the CPU twin)."""

from __future__ import annotations

import pytest
import torch

from tests.engine import test_batch_invariant as cpu

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA_KW = {**cpu.KW, "device": "cuda", "dtype": "bfloat16", "kv_dtype": "bf16"}
CUDA_KW.pop("index_dtype")


@pytest.mark.parametrize("preset", ["v41-tiny", "v4-tiny"])
def test_a_request_computes_the_same_bits_alone_and_in_any_batch_on_cuda(preset, monkeypatch):
    monkeypatch.setattr(cpu, "KW", CUDA_KW)
    cpu.test_a_request_computes_the_same_bits_alone_and_in_any_batch(preset)


@pytest.mark.parametrize("preset", ["v41-mini", "v4-mini"])
def test_graph_replays_equal_eager_runs_bit_for_bit(preset):
    """In the mode the decode steps replay CUDA graphs (its MoE needs no host sync on CUDA):
    batches padded to their bucket and tables to their width give the eager run's bits."""
    from atom import LLM, SamplingParams

    from .tier_two_pass import assert_same_bits

    kw = dict(
        device="cuda",
        dtype="bfloat16",
        batch_invariant=True,
        num_blocks=48,
        max_num_seqs=8,
        max_num_batched_tokens=1024,
    )
    prompts = cpu.prompts_of((40, 300, 530, 90, 260, 700), seed=12)
    params = [SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True, logprobs=3) for i in range(6)]
    graphed = LLM(preset, **kw)
    graphs = graphed.engine.runtime.graphs
    assert graphs is not None, "no decode graphs in the batch-invariant mode"
    outs = graphed.generate(prompts, params)
    assert not graphs.failed, graphs.failed
    assert graphs.replays > 0 and len({b for b, _ in graphs.graphs}) >= 2, graphs.graphs.keys()
    graphed.shutdown()
    eager = LLM(preset, **kw, cuda_graphs=False)
    assert eager.engine.runtime.graphs is None
    assert_same_bits(outs, eager.generate(prompts, params))
    eager.shutdown()


@pytest.mark.parametrize("vocab", [320, 129280])
def test_the_samplers_reductions_keep_a_rows_bits_in_any_batch(vocab):
    """The sampler's log-probabilities (``token_logprobs``: float32 log-softmax and top-k) and
    greedy argmax run as torch's own in either arithmetic: a row's are the same bits alone and
    among 1-63 other rows (torch sizes these kernels by the row's length, not by the rows)."""
    from atom.engine.sampler import token_logprobs

    g = torch.Generator(device="cuda").manual_seed(3)
    rows = (torch.randn(64, vocab, device="cuda", generator=g) * 4).bfloat16()
    alone = token_logprobs(rows[:1], [7], 5)[0]
    top = int(rows[:1].argmax(-1))
    for n in (2, 7, 16, 33, 64):
        assert token_logprobs(rows[:n], [7] * n, 5)[0] == alone, n
        assert int(rows[:n].argmax(-1)[0]) == top, n


@pytest.mark.parametrize(
    "preset, block", [("v41-tiny-draft", 16), ("v4-mini", 256)]  # v4-mini: its MTP layer
)
def test_drafts_replay_span_graphs_in_the_mode_bit_for_bit(preset, block):
    """With drafts the mode replays the verify and draft graphs too: greedy requests (walked
    on the device) decode the same tokens as the eager run in the mode, and requests asking
    for logprobs (walked on the host) the same bits; both the tokens of plain decoding in the
    mode (a verify row is a decode row's bits: row-local arithmetic). The pool holds every
    request at once: a preempted request recomputes its generated tokens as prefill rows,
    which the mode does not promise to be decode rows' bits (at 48 blocks of 16 it preempted,
    and its outputs parted from plain decoding's with or without drafts)."""
    from atom import LLM, SamplingParams
    from tests.engine.test_speculative import ScriptedDrafter

    from .tier_two_pass import assert_same_bits

    kw = dict(
        device="cuda",
        dtype="bfloat16",
        batch_invariant=True,
        block_size=block,
        num_blocks=48 if block == 256 else 400,
        max_num_seqs=8,
        max_num_batched_tokens=1024,
    )
    prompts = cpu.prompts_of((40, 300, 530, 90, 260, 700), seed=14)
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    listed = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2)

    def both(llm):  # greedy requests (the device walk), then requests listing logprobs
        return llm.generate(prompts, greedy) + llm.generate(prompts, listed)

    base = LLM(preset, **kw)
    plain = both(base)
    assert base.engine.stats()["preemptions"] == 0
    truth = {tuple(p): p + o.token_ids for p, o in zip(prompts, plain)}
    runs = {}
    for graphs in (True, False):
        llm = LLM(preset, speculative_tokens=2, cuda_graphs=graphs, **kw)
        llm.engine.drafter = ScriptedDrafter(llm.engine.drafter, truth, lambda p: p % 5 == 0)
        runs[graphs] = both(llm)
        assert llm.engine.stats()["preemptions"] == 0
        stats = llm.engine.stats()["speculative"]
        # the scripted proposals (4 in 5 right) reach the host walk's requests; the device
        # walk's run the random draft layer's own (0.48 overall on the H100 at ac76acb)
        assert stats["acceptance_rate"] > 0.3 and stats["device_walk_steps"] > 0, stats
        span = llm.engine.runtime.span_graphs
        if graphs:
            assert span is not None, "no span graphs in the batch-invariant mode"
            assert not span.failed, span.failed
            assert span.replays["verify"] > 0 and span.replays["draft"] > 0, span.replays
        else:
            assert span is None
        llm.shutdown()
    assert_same_bits(runs[True], runs[False])
    assert [o.token_ids for o in runs[True]] == [o.token_ids for o in plain]


@pytest.mark.parametrize("preset", ["v41-tiny", "v4-tiny"])
def test_a_decoded_token_has_the_bits_of_the_same_token_prefilled_on_cuda(preset, monkeypatch):
    """The prefill kernel runs each query over its own window (``kernel_tile_attention``), as
    the mode's decode rows do: decoded and prefilled tokens give the same bits in bfloat16."""
    monkeypatch.setattr(cpu, "KW", CUDA_KW)
    cpu.test_a_decoded_token_has_the_bits_of_the_same_token_prefilled(preset)


@pytest.mark.parametrize("preset", ["v41-tiny", "v4-tiny"])
def test_a_preempted_request_decodes_the_bits_of_one_never_preempted_on_cuda(preset, monkeypatch):
    monkeypatch.setattr(cpu, "KW", CUDA_KW)
    cpu.test_a_preempted_request_decodes_the_bits_of_one_never_preempted(preset)
