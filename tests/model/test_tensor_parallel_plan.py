"""Tensor parallelism as the layers declare it (atom/models/common/tensor_parallel.py), for
every model family, in one process: 2 or 4 ranks as threads whose all-reduce meets at a
barrier. The ranks' logits are the same bits, and equal one rank's in float32 up to the split
sums' roundings; the plan names parameters the model has, on the main layers only. The
processes-and-gloo form (the engine across ranks, the tier) is tests/distributed."""

from __future__ import annotations

import threading

import pytest
import torch

from atom.model_api import Span
from atom.models.common.tensor_parallel import (
    TensorParallelError,
    check_divides,
    shard_model,
    split_plan,
)
from atom.models.deepseek_v4.presets import preset_config as v4_config
from atom.models.deepseek_v41.presets import preset_config as v41_config
from atom.models.registry import family

WORLD = 2
FAMILIES = ["v41-tiny", "v4-tiny"]


def _model(preset: str, **overrides):
    config = (v4_config if preset.startswith("v4-") else v41_config)(preset, **overrides)
    fam = family(config)
    net = fam.get("model")(config, dtype=torch.float32, kv_dtype="fp32", index_dtype="fp32")
    return fam, net.init_weights(0).eval()


class BarrierReduce:
    """An all-reduce of ``world`` threads: each posts its tensor, all add them in rank order."""

    def __init__(self, world: int):
        self.barrier, self.posted, self.world = threading.Barrier(world, timeout=60), {}, world

    def for_rank(self, rank: int):
        def reduce(t: torch.Tensor) -> torch.Tensor:
            self.posted[rank] = t
            self.barrier.wait()
            total = self.posted[0].clone()
            for r in range(1, self.world):
                total += self.posted[r]
            self.barrier.wait()  # every rank has read before the next post
            return total

        return reduce

    def gather_for(self, rank: int):
        """The all-gather of ``world`` threads: every rank's tensor, concatenated along the
        last dimension in rank order."""

        def gather(t: torch.Tensor) -> torch.Tensor:
            self.posted[rank] = t
            self.barrier.wait()
            whole = torch.cat([self.posted[r] for r in range(self.world)], dim=-1)
            self.barrier.wait()
            return whole

        return gather


def on_ranks(world: int, fn) -> dict[int, object]:
    """``fn(rank)`` of every rank, each on a thread of its own (their collectives meet at the
    ``BarrierReduce``); rank -> its result, and an error naming a rank whose call failed."""
    got: dict[int, object] = {}
    threads = [threading.Thread(target=lambda r=r: got.__setitem__(r, fn(r))) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(got) == set(range(world)), f"rank(s) {sorted(set(range(world)) - set(got))} failed"
    return got


def _logits(fam, net, prompt: torch.Tensor, steps: int, feed=None) -> torch.Tensor:
    """A 37-token prefill, then ``steps`` greedy decode steps: every forward's logits.
    ``feed``: the tokens each step decodes from (teacher forcing) instead of its own argmax."""
    rt = fam.get("runtime")(net, block_size=16, speculative_tokens=0)
    spec = rt.spec
    pool = torch.zeros(
        spec.pool_shape(8 + getattr(rt, "reserved_blocks", 0)), dtype=spec.pool_dtype
    )
    slots = torch.zeros(1 + getattr(rt, "reserved_slots", 0), spec.state_bytes, dtype=torch.uint8)
    rt.bind(pool, slots)
    table, n = torch.arange(4), prompt.numel()
    out = [rt.forward(prompt, [Span(0, n, 0, table)])]
    for i, p in enumerate(range(n, n + steps)):
        token = out[-1][-1:].argmax(-1) if feed is None else feed[i : i + 1]
        out.append(rt.forward(token, [Span(p, p + 1, 0, table)]))
    return torch.cat(out)


@pytest.mark.parametrize("preset", FAMILIES)
def test_the_plan_names_main_layer_parameters_the_model_has(preset):
    _, net = _model(preset)
    plan = split_plan(net)
    params = dict(net.named_parameters())
    assert plan and set(plan) <= set(params)
    layers = net.config.num_hidden_layers
    vocab = {"model.embed_tokens.weight", "lm_head.weight", "embed.weight", "head.weight"}
    assert len(vocab & set(plan)) == 2 and all(plan[n] == 0 for n in vocab & set(plan))
    for name, dim in plan.items():
        assert params[name].shape[dim] % WORLD == 0, name
        if name not in vocab:
            assert int(name.split("layers.")[1].split(".")[0]) < layers  # no draft layer
    # every routed expert and the shared one split along their intermediate dimension
    experts = [n for n in plan if ".experts." in n or ".shared_experts." in n]
    assert len(experts) == layers * 3 * (net.config.n_routed_experts + 1)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("preset", FAMILIES)
def test_ranks_compute_one_ranks_logits(preset, world):
    """TP=2 and TP=4 (the tiny presets widened to 4 heads and 4 output groups, so 4 divides
    them) against TP=1 of the same weights."""
    wide = dict(num_attention_heads=4, o_groups=4)
    fam, whole = _model(preset, **wide)
    prompt = torch.randint(0, 200, (37,), generator=torch.Generator().manual_seed(3))
    want = _logits(fam, whole, prompt, steps=6)
    reduce = BarrierReduce(world)
    ranks = [
        shard_model(_model(preset, **wide)[1], r, world, reduce.for_rank(r), reduce.gather_for(r))
        for r in range(world)
    ]
    heads = whole.config.num_attention_heads // world
    assert all(m.heads == heads for m in ranks[0].tp_layers().values() if hasattr(m, "heads"))
    got = on_ranks(world, lambda r: _logits(fam, ranks[r], prompt, 6))
    assert all(torch.equal(got[0], got[r]) for r in range(1, world))  # the same sums everywhere
    assert torch.equal(got[0].argmax(-1), want.argmax(-1))
    assert (got[0] - want).abs().max().item() < 1e-4


def test_a_split_model_is_refused_a_second_split_and_world_one_changes_nothing():
    _, net = _model("v4-tiny")
    before = {k: v.clone() for k, v in net.state_dict().items()}
    shard_model(net, 0, 1, reduce=None)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert net.layers[0].attn.reduce_output is None
    with pytest.raises(TensorParallelError, match="already split"):
        shard_model(net, 0, 2, reduce=None)
    with pytest.raises(TensorParallelError, match="tensor_parallel_size=3"):
        shard_model(_model("v4-tiny")[1], 0, 3, reduce=None)


@pytest.mark.parametrize("world", [2, 4])
def test_engram_tables_split_by_columns_gather_the_unsplit_rows_exactly(world):
    """Each rank holds head_dim / N columns of every row; the gathered rows, and so the
    Engram layer's output, are the unsplit layer's bits (nothing is summed)."""
    wide = dict(num_attention_heads=4, o_groups=4)
    _, whole = _model("v41-tiny", **wide)
    layer_ids = whole.config.engram_layer_ids
    plan = split_plan(whole)
    for i in layer_ids:
        assert plan[f"model.layers.{i}.engram.embed.weight"] == 1
    gen = torch.Generator().manual_seed(5)
    i = layer_ids[0]
    engram = whole.model.layers[i].engram
    x = torch.randn(7, engram.hc, engram.dim, generator=gen)
    rows = torch.randint(0, engram.embed.num_embeddings, (7, engram.n_hash_cols), generator=gen)
    want = engram(x, rows)
    reduce = BarrierReduce(world)
    ranks = [
        shard_model(
            _model("v41-tiny", **wide)[1], r, world, reduce.for_rank(r), reduce.gather_for(r)
        )
        for r in range(world)
    ]
    cols = engram.head_dim // world
    for r, net in enumerate(ranks):
        part = net.model.layers[i].engram.embed.weight
        assert torch.equal(part, engram.embed.weight[:, r * cols : (r + 1) * cols])
    got = on_ranks(world, lambda r: ranks[r].model.layers[i].engram(x, rows))
    assert all(torch.equal(got[r], want) for r in range(world))


def test_a_world_size_that_does_not_divide_the_engram_columns_is_refused():
    """64 ranks divide these heads, groups and experts' width, not the tables' 32 columns."""
    wide = dict(num_attention_heads=64, o_groups=64, moe_intermediate_size=64)
    config = v41_config("v41-tiny", **wide)
    with pytest.raises(TensorParallelError, match=r"it does not divide engram_head_dim=32$"):
        check_divides(config, 64)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("preset", FAMILIES)
def test_the_embedding_and_head_split_by_vocabulary(preset, world):
    """Each rank holds V/N rows of both; a lookup is the unsplit lookup bit for bit (one
    rank's row plus zeros), and the gathered logits are the unsplit head's (each one rank's
    dot product, up to that product's own rounding)."""
    wide = dict(num_attention_heads=4, o_groups=4)
    _, whole = _model(preset, **wide)
    embed_name, head_name = (
        ("model.embed_tokens", "lm_head") if preset.startswith("v41") else ("embed", "head")
    )
    embed, head = whole.get_submodule(embed_name), whole.get_submodule(head_name)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, embed.num_embeddings, (9,), generator=gen)
    x = torch.randn(9, head.in_features, generator=gen)
    want_rows, want_logits = embed(ids), head(x)
    reduce = BarrierReduce(world)
    ranks = [
        shard_model(_model(preset, **wide)[1], r, world, reduce.for_rank(r), reduce.gather_for(r))
        for r in range(world)
    ]
    rows_per_rank = embed.num_embeddings // world
    for r, net in enumerate(ranks):
        part = net.get_submodule(embed_name)
        assert part.weight.shape[0] == rows_per_rank and part.vocab_start == r * rows_per_rank
        assert net.get_submodule(head_name).weight.shape[0] == rows_per_rank
    got = on_ranks(
        world,
        lambda r: (ranks[r].get_submodule(embed_name)(ids), ranks[r].get_submodule(head_name)(x)),
    )
    for rows, logits in got.values():
        assert torch.equal(rows, want_rows)
        assert logits.shape == want_logits.shape
        assert (logits - want_logits).abs().max().item() < 1e-5
    assert all(torch.equal(got[0][1], got[r][1]) for r in range(world))
