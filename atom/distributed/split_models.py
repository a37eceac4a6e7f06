"""Tensor parallelism for the model families: building one rank's split model.

What is split is what the layers declare (``atom.models.common.tensor_parallel``: ``tp_splits``
of each main layer's attention and MoE, ``tp_layers`` of the model): rank r of N holds the r-th
of N equal contiguous slices of

  * the attention heads: the query projection's rows (head-major, so whole heads) and the
    sinks; each rank attends its heads against the full latent KV;
  * the grouped output projection: its first projection's rows (whole groups; group g reads
    heads g*H/G .. (g+1)*H/G - 1, so a rank's heads are exactly its groups' heads) and the
    second's columns; each rank's output is a partial sum, and one all-reduce sums it;
  * MoE: every expert's intermediate dimension, routed and shared alike; one all-reduce
    (float32) sums shared + routed. Why the intermediate dimension rather than whole experts per
    rank: the routing, the code path (dense / grouped / loop) and every token's expert list stay
    exactly the unsplit ones, every rank does 1/N of every expert's work whatever the routing's
    skew, and the shared expert and the routed ones share the one all-reduce. The cost: each
    expert's GEMMs are N times narrower, which expert parallelism would avoid at large N.

  * V4.1's Engram tables by columns: each rank holds head_dim / N values of every row (the
    tables are hundreds of millions of rows per engram layer in the published model, most of
    its bytes); every rank looks up the same row ids and one all-gather concatenates the
    ranks' columns into the unsplit rows, exactly. The rest of Engram (wkv, the gate) is whole.

  * the embedding and the LM head by vocabulary: each rank holds the rows of V / N token ids
    (``atom.models.common.vocab_parallel``); a lookup's rows are summed over the ranks (one
    rank's row plus zeros: exact) and the logits all-gathered (each one rank's dot product).
    The draft layers, MTP blocks and DSpark stages share them.

Replicated (whole and computed identically on every rank): all norms, the mHC hyper-connections,
the query latent (which the indexer reads), the latent KV, the compressors, the indexers,
Engram's projections and gate, the MoE routers, and the draft layers. So the paged state (PAGE
rows, window and compressor rings, cursors) is written from replicated inputs and is byte-
identical on every rank, and every discrete choice (index top-k, candidate blocks, expert
routing) is made from replicated inputs, identically everywhere.

Collectives of a forward: two all-reduces per main decoder layer (the attention output [N,
hidden], summed in float32 and rounded to the compute dtype; the MoE output [N, hidden] in
float32), one all-gather per Engram layer (the looked-up rows [N, n_hash_cols, head_dim / N] of
each rank), one all-reduce of the embedded rows [N, hidden] and one all-gather of the logits
([rows, V / N] of each rank; a draft forward's too), nothing else. After each, every rank holds
the same tensor. Draft layers: none besides the shared embedding's and head's. Every rank must
therefore run the same forwards (the same tokens and spans, in the same order, against its own
pool and slots of the same geometry); the logits are the same on every rank.

At world size 1 nothing is split and no reduce is set: the model is the unsplit one, bit for
bit."""

from __future__ import annotations

from pathlib import Path

import torch

from atom.distributed.parallel_state import ParallelState
from atom.models.common.tensor_parallel import (
    TensorParallelError,
    check_divides,
    check_split,
    rank_slices,
    shard_model,
)
from atom.models.deepseek_v41.config import V41Config
from atom.models.deepseek_v41.engram import EngramHash
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM

__all__ = [
    "TensorParallelError",
    "check_divides",
    "check_tp_split",
    "shard_for_ranks",
    "build_v41_tp",
    "build_tp_model",
    "TIER_BYTES_REPLICATED",
]

#: Every rank's PAGE blocks and checkpoint images hold the same bytes: what a block stores
#: (the latent KV, the index keys, the compressed rows) and what an image holds (window and
#: compressor rings, the Engram cursor) come from replicated modules (the latent KV's
#: projection, compressors, indexers, Engram) applied to hidden states that every rank holds
#: whole after each all-reduce. So one stored copy serves every rank (the tier's rank collapse).
TIER_BYTES_REPLICATED = True


def shard_for_ranks(model, state: ParallelState):
    """Split a whole model in place for ``state``'s rank (``tensor_parallel.shard_model``,
    its all-reduces on ``state``) and return it. The model may hold weights (each rank built
    the same whole model: same seed or the same checkpoint) or be on ``meta`` (``build_tp_model``
    then materializes it and loads only this rank's slices)."""
    return shard_model(model, state.rank, state.world_size, state.all_reduce, state.all_gather)


def build_v41_tp(
    config: V41Config,
    state: ParallelState,
    *,
    dtype: torch.dtype = torch.float32,
    kv_dtype: str = "fp32",
    index_dtype: str = "fp32",
    device: torch.device | str = "cpu",
    seed: int | None = None,
    checkpoint: str | Path | None = None,
) -> DeepseekV41ForCausalLM:
    """This rank's split V4.1 model (``build_tp_model`` of the V4.1 family)."""
    from atom.models.registry import FAMILIES

    if checkpoint is None and seed is None:
        raise ValueError("build_v41_tp needs a checkpoint or a seed")
    return build_tp_model(
        FAMILIES["deepseek_v41"], config, checkpoint, state, dtype=dtype, kv_dtype=kv_dtype,
        index_dtype=index_dtype, device=device, seed=seed,
    )  # fmt: skip


def materialize(model, device: torch.device | str) -> None:
    """Allocate (uninitialized) on ``device`` a model built on ``meta``, and rebuild what is
    not a parameter or buffer (the RoPE tables, ``build_ropes``; V4.1's n-gram tables); the
    caller loads every tensor afterwards."""
    model.to_empty(device=device)
    with torch.device(device):
        for m in model.modules():
            if hasattr(m, "build_ropes"):
                m.build_ropes(model.config)
            if isinstance(m, EngramHash):
                m.build(device)
            if hasattr(m, "_stack"):
                m._stack = None
    left = []
    for name, m in model.named_modules():
        for attr, v in vars(m).items():
            inner = vars(v).items() if hasattr(v, "__dict__") and not callable(v) else ()
            for key, t in [(attr, v), *((f"{attr}.{k}", u) for k, u in inner)]:
                if isinstance(t, torch.Tensor) and t.device.type == "meta":
                    left.append(f"{name}.{key}")
    if left:
        raise RuntimeError(f"tensors left on meta after materializing: {left}")


def check_tp_split(config, world_size: int, *, weight_dtype: str = "bf16") -> None:
    """Refuse, before any rank builds anything, a world size the model cannot be split over:
    one that does not divide its heads, groups and experts' width (``check_divides``), or, at
    ``weight_dtype`` "fp8", one that would cut an FP8 weight block or an FP4 scale group
    (``tensor_parallel.check_split``, on the model's layers built on ``meta``)."""
    from atom.models.registry import family, keep_stored_precision

    check_divides(config, world_size)
    if weight_dtype != "fp8" or world_size == 1:
        return
    fam = family(config)
    probe = fam.get("model")(config, device="meta")
    keep_stored_precision(probe, fam)
    check_split(probe, world_size)


def build_tp_model(
    fam,
    config,
    path,
    state: ParallelState,
    *,
    dtype,
    kv_dtype,
    index_dtype,
    device,
    seed,
    weight_dtype: str = "bf16",
):
    """This rank's split model of any family (``atom.models.registry``'s ``fam``), in eval
    mode, at ``weight_dtype`` ("bf16" or "fp8", resolved; ``registry.build_model``). From the
    checkpoint at ``path``: built on ``meta`` (its FP8 linears and FP4 experts as such at
    "fp8"), split, materialized on ``device`` and loaded, so only this rank's slices, scales
    included, are ever allocated or read (the family's loader takes ``shards``). Else from
    ``seed``: the whole model built and initialized as ``init_weights(seed)`` does at world
    size 1 on that device, put at its precision, then split (the same weights as the unsplit
    model, each rank holding its slice of their bytes and scales)."""
    from atom.models.common.fp8_linear import stored_fp8
    from atom.models.registry import build_model

    check_divides(config, state.world_size)
    if weight_dtype == "fp8" and path is not None and not stored_fp8(config):
        # quantized once the rank's slices are loaded: check the blocks before anything is
        # built (elsewhere the split itself checks them, ``shard_model``)
        check_tp_split(config, state.world_size, weight_dtype=weight_dtype)

    def split(net) -> dict:
        shard_for_ranks(net, state)
        if any(t.is_meta for t in net.parameters()):
            materialize(net, device)
        return rank_slices(net)

    return build_model(
        config, path, dtype=dtype, kv_dtype=kv_dtype, index_dtype=index_dtype, device=device,
        seed=seed, weight_dtype=weight_dtype, split=split,
    )  # fmt: skip
