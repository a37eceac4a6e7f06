"""benchmarks/memory_plan.py counts what one rank holds: the bytes of the tensors a split model
on meta has, by kind; V4.1's Engram tables at FP8 split by columns with the scale groups each
rank's columns touch."""

from __future__ import annotations

from atom.models.deepseek_v41.presets import preset_config
from benchmarks.memory_plan import rank_bytes


def test_one_ranks_engram_tables_are_its_columns_and_their_scale_groups():
    spec = preset_config("v41-tiny-fp8").engram_spec
    rows = sum(spec.num_embeddings)
    wide = {"moe_intermediate_size": 64}  # 2 ranks hold whole FP4 groups of the experts
    one = rank_bytes("v41-tiny-fp8", 1, "fp8", wide)
    two = rank_bytes("v41-tiny-fp8", 2, "fp8", wide)
    assert spec.head_dim == 32  # 16 columns a rank: both ranks hold the one scale group
    assert one["bytes"]["engram tables"] == rows * 32 + rows * 1
    assert two["bytes"]["engram tables"] == rows * 16 + rows * 1
    assert one["engram_replicated_bf16"] == rows * 32 * 2
    assert two["bytes"]["routed experts"] * 2 == one["bytes"]["routed experts"]
    assert sum(two["bytes"].values()) == two["total"] < one["total"]


def test_a_world_size_the_model_cannot_split_is_reported():
    assert "tensor_parallel_size=3" in rank_bytes("v41-tiny", 3, "bf16")["refused"]
