"""Tensor parallelism at stored precision (``weight_dtype`` fp8: FP8 linears, FP4 routed
experts), both families, in one process: ranks as threads whose all-reduce meets at a barrier
(tests/model/test_tensor_parallel_plan.py's ``BarrierReduce``).

Each rank holds its slice of every split FP8 weight's bytes with the matching slice of its
block scales, and of every FP4 expert's codes with its group scales; a published-format
checkpoint is read slice by slice, scales included; TP=2 and TP=4 decode TP=1's greedy tokens;
a world size that would cut a block is refused, naming the layer.

The tiny presets are widened (4 heads, 4 output groups, expert width 128) so that 4 ranks each
hold whole 32 x 32 blocks. Compute is float32. The logits of a split model are not TP=1's to
the last bit: the split sums round differently (as in bf16), and an FP8 or FP4 linear rounds
its input to E4M3, so a difference of one float32 ulp that moves an input across a rounding
boundary moves that input by an E4M3 step. What is exact is asserted exactly: the split
layers, given the same input, sum to the whole layer's output, and every rank's logits are the
same bits.
"""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from atom import LLM
from atom.distributed.split_models import build_tp_model
from atom.models.common import checkpoint_tensors
from atom.models.common.formats import e8m0_to_float
from atom.models.common.fp4_linear import Fp4Linear
from atom.models.common.fp8_linear import Fp8Linear
from atom.models.common.tensor_parallel import TensorParallelError, shard_model, split_plan
from atom.models.deepseek_v4.presets import preset_config as v4_config
from atom.models.deepseek_v41.presets import preset_config as v41_config
from atom.models.registry import build_model, family, load_runtime

from .test_tensor_parallel_plan import BarrierReduce, _logits

WIDE = dict(num_attention_heads=4, o_groups=4, moe_intermediate_size=128)
PRESETS = ["v41-tiny-fp8", "v4-tiny-fp8"]
KW = dict(dtype=torch.float32, kv_dtype="fp32", index_dtype="fp32", device="cpu")


def _config(preset: str, **overrides):
    return (v4_config if preset.startswith("v4-") else v41_config)(preset, **overrides)


def _model(config, weight_dtype: str = "fp8"):
    return build_model(config, None, seed=0, weight_dtype=weight_dtype, **KW)


def _run_ranks(fam, ranks, prompt, steps: int, feed=None) -> dict[int, torch.Tensor]:
    got: dict[int, torch.Tensor] = {}
    threads = [
        threading.Thread(
            target=lambda r=r: got.__setitem__(r, _logits(fam, ranks[r], prompt, steps, feed))
        )
        for r in range(len(ranks))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(got) == set(range(len(ranks))), "a rank's forward failed"
    return got


def _stored(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, (Fp8Linear, Fp4Linear))}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("preset", PRESETS)
def test_each_rank_holds_its_slice_of_the_stored_bytes_and_scales(preset, world):
    config = _config(preset, **WIDE)
    whole = _model(config)
    ranks = [shard_model(_model(config), r, world, reduce=None) for r in range(world)]
    plan = split_plan(ranks[0])
    stored = _stored(whole)
    split = {n.removesuffix(".weight"): d for n, d in plan.items() if n.endswith(".weight")}
    fp8 = [n for n in split if isinstance(stored.get(n), Fp8Linear)]
    fp4 = [n for n in split if isinstance(stored.get(n), Fp4Linear)]
    layers, experts = config.num_hidden_layers, config.n_routed_experts
    # split: the heads' query projection and the output projection's second half (FP8; V4.1
    # keeps its first half bf16, V4 reads it dense), the shared expert (FP8), the routed ones
    # (FP4), each weight with its scales
    assert len(fp8) == layers * 5 and len(fp4) == layers * 3 * experts
    assert all(plan[f"{n}.weight_scale"] == split[n] for n in fp8 + fp4)
    for name in fp8 + fp4:
        dim, big = split[name], stored[name]
        for r, rank in enumerate(ranks):
            part = rank.get_submodule(name)
            assert type(part) is type(big)
            for t in ("weight", "weight_scale"):
                want = getattr(big, t).chunk(world, dim)[r]
                got = getattr(part, t)
                assert got.shape == want.shape, (name, t, got.shape, want.shape)
                assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))
            assert part.in_features * (world if dim == 1 else 1) == big.in_features
            assert part.out_features * (world if dim == 0 else 1) == big.out_features
    # what is not split is whole, byte for byte, on every rank
    whole_only = [n for n in stored if n not in split]
    assert whole_only
    for name in whole_only:
        for rank in ranks:
            part = rank.get_submodule(name)
            assert torch.equal(part.weight.view(torch.uint8), stored[name].weight.view(torch.uint8))
            assert torch.equal(part.weight_scale, stored[name].weight_scale)


@pytest.mark.parametrize("preset", PRESETS)
def test_split_stored_precision_layers_sum_to_the_whole_layer(preset):
    """Given the same input, the ranks' partial MoE outputs (FP4 experts, FP8 shared expert)
    and their FP8 output projections' partial products sum to the whole layer's output, up to
    the float32 rounding of the sum: no input or block is rounded differently on a rank."""
    world = 4
    config = _config(preset, **WIDE)
    whole = _model(config)
    ranks = [shard_model(_model(config), r, world, reduce=None) for r in range(world)]
    x = torch.randn(9, config.hidden_size, generator=torch.Generator().manual_seed(1))
    layers = whole.tp_layers()
    with torch.no_grad():
        for prefix, layer in layers.items():
            if hasattr(layer, "experts"):  # routed as the whole layer routes (V4: by ids too)
                ids = torch.arange(x.shape[0])
                route = layer.route_ids(x, ids) if hasattr(layer, "route_ids") else layer.route(x)
                want = layer.mix(x, *route)
                got = sum(rank.get_submodule(prefix).mix(x, *route) for rank in ranks)
                assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item(), prefix
            out = "o_b_proj" if hasattr(layer, "o_b_proj") else "wo_b"
            if hasattr(layer, out):
                lin = getattr(layer, out)
                assert isinstance(lin, Fp8Linear)
                h = torch.randn(5, lin.in_features, generator=torch.Generator().manual_seed(2))
                parts = h.chunk(world, 1)
                got = sum(
                    getattr(rank.get_submodule(prefix), out)(p) for rank, p in zip(ranks, parts)
                )
                want = lin(h)
                assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item(), prefix


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("preset", PRESETS)
def test_ranks_at_stored_precision_decode_one_ranks_greedy_tokens(preset, world):
    config = _config(preset, **WIDE)
    fam = family(config)
    whole = _model(config)
    assert _stored(whole), "the model is not at stored precision"
    prompt = torch.randint(0, 200, (37,), generator=torch.Generator().manual_seed(3))
    want = _logits(fam, whole, prompt, steps=8)
    reduce = BarrierReduce(world)
    ranks = [
        shard_model(_model(config), r, world, reduce.for_rank(r), reduce.gather_for(r))
        for r in range(world)
    ]
    got = _run_ranks(fam, ranks, prompt, 8, want.argmax(-1)[-9:-1])  # one rank's tokens
    assert all(torch.equal(got[0], got[r]) for r in range(1, world))  # the same sums everywhere
    _assert_within_rounding(f"{preset} TP={world}", got[0], want)


def test_a_split_that_cuts_a_block_is_refused_naming_the_layer():
    """v41-tiny at fp8 (its linears quantized in 32 x 32 blocks; expert width 32) over 2 ranks
    would give each 16 rows of the shared expert's FP8 weight: refused before anything changes,
    naming the layer, the dimension, the size, the world size and the fix; the same model at
    bf16 splits."""
    net = _model(_config("v41-tiny"))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(TensorParallelError) as err:
        shard_model(net, 0, 2, reduce=None)
    msg = str(err.value)
    print(msg)
    for needle in (
        "tensor_parallel_size=2 cannot split model.layers.0.mlp.shared_experts.gate_proj",
        "Fp8Linear, E4M3 in 32 x 32 blocks",
        "along dim 0: its rows (out_features=32) would be 16 per rank, not a multiple of 32",
        "Use a tensor_parallel_size that keeps whole blocks on every rank (1)",
        "weight_dtype=bf16",
    ):
        assert needle in msg
    assert getattr(net, "tp_shard", None) is None
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    dense = shard_model(_model(_config("v41-tiny"), "bf16"), 0, 2, reduce=None)
    assert dense.model.layers[0].mlp.shared_experts.gate_proj.weight.shape[0] == 16


def test_an_fp4_split_that_cuts_a_scale_group_is_refused():
    """FP8 blocks of 16 fit 16 rows per rank, but the FP4 experts' K (16 per rank) would cut
    their 32-input scale groups."""
    config = _config("v4-tiny-fp8")
    quant = dict(config.quantization_config, weight_block_size=[16, 16])
    net = _model(_config("v4-tiny-fp8", quantization_config=quant))
    with pytest.raises(TensorParallelError) as err:
        shard_model(net, 1, 2, reduce=None)
    msg = str(err.value)
    assert "cannot split layers.0.ffn.experts.0.down_proj (Fp4Linear, packed FP4" in msg
    assert "along dim 1: its columns (in_features=32) would be 16 per rank" in msg
    assert "not a multiple of 32" in msg


def test_the_engine_refuses_a_cutting_split_before_any_rank_starts():
    kw = dict(block_size=16, num_blocks=40, dtype="float32", kv_dtype="fp32", device="cpu")
    with pytest.raises(TensorParallelError, match="tensor_parallel_size=2 cannot split"):
        LLM("v41-tiny-fp8", tensor_parallel_size=2, weight_dtype="fp8", **kw)
    assert not multiprocessing.active_children()


# ---- a published-format checkpoint, read slice by slice ---------------------------------


BYTE_TOKENIZER = Path(__file__).parents[2] / "atom" / "byte_tokenizer" / "tokenizer.json"


def _write(preset: str, directory):
    """A published-format checkpoint of the widened tiny model: FP8 in 32 x 32 blocks with
    E8M0 scales, FP4 experts (V4: int8 bytes; V4.1: ``float4_e2m1fn_x2``), two files, the
    scales in the other one."""
    if preset.startswith("v4-"):
        from .test_v4_checkpoint import PRESETS as V4_PRESETS
        from .test_v4_checkpoint import write_checkpoint

        cfg = dict(V4_PRESETS["v4-tiny"], **WIDE, expert_dtype="fp4")
        cfg["quantization_config"] = dict(quant_method="fp8", weight_block_size=[32, 32])
        write_checkpoint(directory, seed=7, config=cfg, block=(32, 32), shape=WIDE)
    else:
        import shutil

        from .test_v41_published_checkpoint import write_checkpoint

        # as published: the Engram hashes over its tokenizer's compressed vocabulary (the byte
        # tokenizer's 258 ids normalise to 229), the tokenizer.json beside the weights
        shape = dict(WIDE, engram_compressed_vocab_size=229)
        write_checkpoint(directory, seed=7, shape=shape)
        shutil.copy(BYTE_TOKENIZER, directory / "tokenizer.json")


def _stored_tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                if sf.get_slice(k).get_dtype() == "F4":
                    out[k] = checkpoint_tensors.read_f4(f, k)
                else:
                    out[k] = sf.get_tensor(k)
    return out


def _published_names(model) -> dict[str, str]:
    """parameter name -> published name."""
    if model.config.model_type == "deepseek_v4":
        from atom.models.deepseek_v4.checkpoint import expected_names
    else:
        from atom.models.deepseek_v41.published_weights import published_names as expected_names
    return {param: name for name, (param, _) in expected_names(model).items()}


@pytest.mark.parametrize("preset", PRESETS)
def test_a_published_checkpoint_at_tp2_reads_rank_slices_and_decodes_what_one_rank_does(
    preset, tmp_path, monkeypatch
):
    world = 2
    _write(preset, tmp_path)
    one = load_runtime(str(tmp_path), block_size=16, seed=0, weight_dtype="fp8", **KW).model
    config, fam = one.config, family(one.config)
    stored = _stored_tensors(tmp_path)
    reads: list[tuple[str, tuple | None, tuple[int, ...], int]] = []
    real = checkpoint_tensors.Reader.__call__

    def recorded(self, name, cut=None):
        t = real(self, name, cut)
        reads.append((name, cut, tuple(t.shape), t.numel() * t.element_size()))
        return t

    monkeypatch.setattr(checkpoint_tensors.Reader, "__call__", recorded)
    reduce = BarrierReduce(world)
    ranks, read_by = [], []
    for r in range(world):
        reads.clear()
        state = SimpleNamespace(
            rank=r, world_size=world, all_reduce=reduce.for_rank(r), all_gather=reduce.gather_for(r)
        )
        ranks.append(build_tp_model(fam, config, tmp_path, state, seed=0, weight_dtype="fp8", **KW))
        read_by.append(list(reads))
    plan = split_plan(ranks[0])
    names = _published_names(ranks[0])
    split_names = {names[p]: d for p, d in plan.items() if p in names}
    fp8 = fp4 = 0
    for r, rank in enumerate(ranks):
        # every split tensor, and its scale, was read as the rank's slice only
        by_name = {name: (cut, shape, nbytes) for name, cut, shape, nbytes in read_by[r]}
        for name, dim in split_names.items():
            cut, shape, nbytes = by_name[name]
            assert cut is not None and cut[0] == dim, (name, cut)
            whole = stored[name]
            assert shape == whole.chunk(world, dim)[0].shape, (name, shape, whole.shape)
            assert nbytes * world == whole.numel() * whole.element_size()
            sname = checkpoint_tensors.scale_name(name)
            if sname in stored and whole.dtype != torch.bfloat16:
                scut, sshape, _ = by_name[sname]
                assert scut is not None and sshape == stored[sname].chunk(world, dim)[0].shape
        # the bytes it holds are the stored slice's (weights and scales), as TP=1 holds the
        # whole stored tensors
        for param, module in _stored(rank).items():
            name = names[f"{param}.weight"]
            sname = checkpoint_tensors.scale_name(name)
            dim = plan.get(f"{param}.weight")
            w, s = stored[name].view(torch.uint8), stored[sname]
            if dim is not None:
                w, s = w.chunk(world, dim)[r], s.chunk(world, dim)[r]
            assert torch.equal(module.weight.view(torch.uint8), w), param
            if isinstance(module, Fp8Linear):
                assert torch.equal(module.weight_scale, e8m0_to_float(s)), param
                fp8 += dim is not None
            else:
                assert torch.equal(module.weight_scale, s.view(torch.uint8)), param
                fp4 += dim is not None
            whole = one.get_submodule(param)
            assert module.weight.numel() * (world if dim is not None else 1) == whole.weight.numel()
    layers, experts = config.num_hidden_layers, config.n_routed_experts
    assert fp8 == world * layers * 5 and fp4 == world * layers * 3 * experts
    prompt = torch.randint(0, 200, (29,), generator=torch.Generator().manual_seed(4))
    want = _logits(fam, one, prompt, steps=6)
    # both decode from one rank's tokens (teacher forcing): a near-tie that rounds the other
    # way at one step does not carry into every later step's context
    feed = want.argmax(-1)[-7:-1]
    got = _run_ranks(fam, ranks, prompt, 6, feed)
    assert torch.equal(got[0], got[1])
    _assert_within_rounding(f"{preset} checkpoint TP=2", got[0], want)


def _assert_within_rounding(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Ranks' logits against one rank's, both decoded from one rank's tokens. At stored
    precision a rank's partial sums round activations (E4M3 inputs, V4's FP4 rows) at other
    points than one rank's whole sums, so logits move by rounding steps and a near-tie can
    flip, at positions that depend on the host's float32 kernels (a published v4-tiny-fp8 at
    TP=2 on a Sapphire Rapids host: mean 0.033, 0.70 at one position whose 0.026 lead changed;
    the presets here about 1e-6, v41-tiny-fp8 at TP=4 up to 0.16). A rank that read or summed
    a wrong slice moves every logit by the logits' own scale."""
    diff = (got - want).abs()
    agree = int((got.argmax(-1) == want.argmax(-1)).sum())
    print(
        f"{what}: |logit - TP=1| max {diff.max().item():.3g}, mean {diff.mean().item():.3g}; "
        f"logits' std {want.std().item():.3g}; argmax equal at {agree} of {want.shape[0]}"
    )
    assert diff.mean() < 0.15 * want.std(), (diff.mean(-1).tolist(), want.std().item())


def test_an_unquantized_checkpoint_asked_for_fp8_splits_one_ranks_quantization(tmp_path):
    """``weight_dtype fp8`` on a checkpoint stored unquantized: each rank quantizes the slices
    it read, and holds exactly the slices of what one rank quantizes (whole blocks: the same
    amax per block); a world size that would cut a block is refused before any rank builds."""
    from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from atom.models.deepseek_v41.weights import save_weights

    world = 2
    for name, shape in (("wide", WIDE), ("narrow", {})):
        plain = DeepseekV41ForCausalLM(v41_config("v41-tiny", **shape)).init_weights(0)
        save_weights(plain, tmp_path / name)
    one = load_runtime(str(tmp_path / "wide"), block_size=16, seed=0, weight_dtype="fp8", **KW)
    one = one.model
    config, fam = one.config, family(one.config)
    states = [
        SimpleNamespace(rank=r, world_size=world, all_reduce=None, all_gather=None)
        for r in range(world)
    ]
    ranks = [
        build_tp_model(fam, config, tmp_path / "wide", s, seed=0, weight_dtype="fp8", **KW)
        for s in states
    ]
    plan = split_plan(ranks[0])
    fp8 = _stored(one)
    assert fp8 and all(isinstance(m, Fp8Linear) for m in fp8.values())
    assert sum(f"{n}.weight" in plan for n in fp8) == config.num_hidden_layers * 5
    for name, big in fp8.items():
        dim = plan.get(f"{name}.weight")
        for r, rank in enumerate(ranks):
            part = rank.get_submodule(name)
            w, s = big.weight, big.weight_scale
            if dim is not None:
                w, s = w.chunk(world, dim)[r], s.chunk(world, dim)[r]
            assert torch.equal(part.weight.view(torch.uint8), w.contiguous().view(torch.uint8))
            assert torch.equal(part.weight_scale, s), name
    narrow = family(plain.config)
    with pytest.raises(TensorParallelError, match="tensor_parallel_size=2 cannot split"):
        build_tp_model(
            narrow, plain.config, tmp_path / "narrow", states[0], seed=0, weight_dtype="fp8", **KW
        )


def test_a_stored_fp8_preset_at_bf16_splits_the_weights_one_rank_runs():
    """At bf16 a preset whose config stores FP8 runs its weights rounded through FP8 and FP4
    (``set_weight_precision``); each rank holds the slices of those very values."""
    config = _config("v4-tiny-fp8", **WIDE)
    whole = _model(config, "bf16").state_dict()
    state = SimpleNamespace(rank=1, world_size=2, all_reduce=None, all_gather=None)
    rank = build_tp_model(family(config), config, None, state, seed=0, weight_dtype="bf16", **KW)
    assert not _stored(rank)
    plan = split_plan(rank)
    assert plan
    for name, value in rank.state_dict().items():
        want = whole[name].chunk(2, plan[name])[1] if name in plan else whole[name]
        assert torch.equal(value, want), name
