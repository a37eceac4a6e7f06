"""Tensor parallelism of the V4.1 model (atom.distributed) on CPU: 2 ranks as processes, gloo.

Split across ranks: attention heads (q_b_proj rows, attn_sink), the output projection's groups
(o_a_proj rows, o_b_proj columns), every expert's intermediate dimension (routed and shared).
Replicated: embedding, LM head, norms, mHC, q_a_proj, kv_proj, compressor, indexer, Engram,
the MoE gate, draft layers. Two all-reduces per layer (attention output, MoE output).

Split reductions change the last bits of the logits, so TP=2 is compared with TP=1 at fp32
tolerance, and a discrete choice (index top-k, candidate blocks, routing) that TP=1 makes
within ``TIE_TOL`` of a tie is forced into TP=2 and reported rather than failed on
(tests/model/ties.py). The paged state is replicated: its bytes must be identical on the ranks.
"""

import warnings

import pytest
import torch

from atom.distributed import (
    ParallelState,
    TensorParallelError,
    build_v41_tp,
    check_divides,
    shard_for_ranks,
)
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.presets import preset_config
from atom.models.deepseek_v41.weights import WeightLoadError, deepseek_names, save_weights

from . import workers
from .spawn import results_of, run_ranks

WORLD = 2


def _same_on_ranks(reports, key):
    values = [r[key] for r in reports]
    assert all(v == values[0] for v in values), f"{key} differs across ranks: {values}"
    return values[0]


def _report_ties(where, forced):
    if forced:
        warnings.warn(
            f"{where}: near-tie choices forced from TP=1 into TP=2: {forced}", stacklevel=2
        )


def test_tp2_paged_forward_matches_tp1_with_state_identical_on_ranks():
    reports = results_of(
        run_ranks(workers.paged_equivalence, WORLD, 6, timeout_s=120)  # 2 + 6 forwards
    )
    heads = _same_on_ranks(reports, "heads")
    assert heads == [preset_config("v41-tiny").num_attention_heads // WORLD] * len(heads)
    # replicated: every rank's pool, slot bytes and logits hash alike, after every forward
    digests = _same_on_ranks(reports, "digests")
    assert len(digests) == 8
    _same_on_ranks(reports, "reference_digest")
    forced = _same_on_ranks(reports, "forced")  # decided from replicated inputs: alike
    _report_ties("paged", forced)
    _report_ties("reference", _same_on_ranks(reports, "reference_forced"))
    rel = reports[0]["rel"]
    assert max(rel) < workers.TOL, f"max |TP2 - TP1| / max |TP1| per forward: {rel}"
    assert reports[0]["reference_rel"] < workers.TOL
    assert reports[0]["decisions"] > 1000  # the choices were traced, all of them


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The whole seed-0 v41-tiny model saved twice: HF names and DeepSeek names."""
    from safetensors.torch import load_file, save_file

    whole = DeepseekV41ForCausalLM(preset_config("v41-tiny")).init_weights(workers.SEED)
    hf = save_weights(whole, tmp_path_factory.mktemp("hf"))
    ds = save_weights(whole, tmp_path_factory.mktemp("ds"))
    names = deepseek_names(whole.state_dict())
    tensors = load_file(str(ds / "model.safetensors"))
    save_file({names.get(k, k): v for k, v in tensors.items()}, str(ds / "model.safetensors"))
    return [str(hf), str(ds)]


def test_weight_loading_takes_each_ranks_slice(checkpoints):
    reports = results_of(run_ranks(workers.load_split, WORLD, checkpoints, timeout_s=90))
    c = preset_config("v41-tiny")
    hd, ql, d = c.head_dim, c.q_lora_rank, c.hidden_size
    per_group = c.num_attention_heads // c.o_groups * hd
    h, g, inter = c.num_attention_heads // WORLD, c.o_groups // WORLD, c.moe_intermediate_size
    p = "model.layers.2."
    shapes = _same_on_ranks(reports, "shapes")
    assert shapes[p + "self_attn.q_b_proj.weight"] == [h * hd, ql]
    assert shapes[p + "self_attn.attn_sink"] == [h]
    assert shapes[p + "self_attn.o_a_proj.weight"] == [g * c.o_lora_rank, per_group]
    assert shapes[p + "self_attn.o_b_proj.weight"] == [d, g * c.o_lora_rank]
    for e in ("experts.3", "shared_experts"):
        assert shapes[f"{p}mlp.{e}.gate_proj.weight"] == [inter // WORLD, d]
        assert shapes[f"{p}mlp.{e}.up_proj.weight"] == [inter // WORLD, d]
        assert shapes[f"{p}mlp.{e}.down_proj.weight"] == [d, inter // WORLD]
    assert len(shapes) == 4 + 3 * (c.n_routed_experts + 1)  # nothing else of a layer splits
    _same_on_ranks(reports, "digests")
    assert max(reports[0]["rel"]) < workers.TOL


def test_a_world_size_that_does_not_divide_is_refused(checkpoints):
    tiny = preset_config("v41-tiny")  # 2 heads, 2 groups, intermediate 32
    with pytest.raises(TensorParallelError) as e:
        check_divides(tiny, 3)
    msg = str(e.value)
    assert "tensor_parallel_size=3" in msg
    assert "num_attention_heads=2, o_groups=2, moe_intermediate_size=32" in msg
    wide = preset_config("v41-tiny", num_attention_heads=4, o_groups=4, moe_intermediate_size=34)
    with pytest.raises(TensorParallelError, match=r"does not divide moe_intermediate_size=34$"):
        check_divides(wide, 4)
    three = ParallelState(rank=0, world_size=3)
    model = DeepseekV41ForCausalLM(tiny).init_weights(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TensorParallelError, match="tensor_parallel_size=3"):
        shard_for_ranks(model, three)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched
    with pytest.raises(TensorParallelError, match="tensor_parallel_size=3"):
        build_v41_tp(tiny, three, checkpoint=checkpoints[0])
    # split twice: refused; a checkpoint of another shape: named with the whole shapes
    two = ParallelState(rank=1, world_size=2)
    shard_for_ranks(model, two)
    with pytest.raises(TensorParallelError, match="already split"):
        shard_for_ranks(model, two)
    other = preset_config("v41-tiny", moe_intermediate_size=48)
    with pytest.raises(WeightLoadError, match=r"has shape \[32, 64\] .* expects \[48, 64\]"):
        build_v41_tp(other, two, checkpoint=checkpoints[0])


def test_world_size_one_is_the_unsplit_model():
    model = DeepseekV41ForCausalLM(preset_config("v41-tiny")).init_weights(0)
    shard_for_ranks(model, ParallelState.single())
    attn, moe = model.model.layers[2].self_attn, model.model.layers[2].mlp
    assert attn.reduce_output is None and moe.reduce_output is None
    assert attn.heads == preset_config("v41-tiny").num_attention_heads


def test_a_rank_that_dies_fails_the_others_collective_instead_of_hanging():
    timeout = 10.0
    outcomes = run_ranks(workers.dies_mid_run, WORLD, timeout, timeout_s=60)
    survivor, dead = outcomes
    assert dead.exitcode == 3 and not dead.reported
    assert not survivor.timed_out, "the surviving rank hung in its collective"
    assert survivor.error is None, survivor.error
    got = survivor.result
    assert got["error"] is not None, "the forward after the peer died did not fail"
    assert got["seconds"] < timeout + 5, got


def test_a_rank_that_stops_taking_part_times_the_others_collective_out():
    """The forward group's timeout (not the control group's long one) bounds the wait."""
    timeout = 3.0
    first, last = results_of(run_ranks(workers.hangs_mid_run, WORLD, timeout, timeout_s=60))
    assert first["error"] is not None, "the forward with an absent peer did not fail"
    assert timeout - 0.5 <= first["seconds"] < timeout + 5, first
    assert last["error"] is None
