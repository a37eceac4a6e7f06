"""Tensor parallelism for the DeepSeek-V4.1 model: which tensors are split, sharding, loading.

Split across the ranks (rank r of N holds the r-th of N equal contiguous slices):
  * attention heads: ``q_b_proj`` rows (head-major, so whole heads) and ``attn_sink``; each
    rank attends its heads against the full latent KV;
  * the grouped output projection: ``o_a_proj`` rows (whole groups; group g reads heads
    g*H/G .. (g+1)*H/G - 1, so a rank's heads are exactly its groups' heads) and ``o_b_proj``
    columns; each rank's output is a partial sum, and one all-reduce sums it;
  * MoE: every expert's intermediate dimension, routed and shared alike (``gate_proj`` /
    ``up_proj`` rows, ``down_proj`` columns); one all-reduce (float32) sums shared + routed.
    Why the intermediate dimension rather than whole experts per rank: the routing, the code
    path (dense / grouped / loop) and every token's expert list stay exactly the unsplit ones
    (no expert-id remapping, no token dispatch), every rank does 1/N of every expert's work
    whatever the routing's skew (expert parallelism would leave a rank idle while another
    computes a popular expert), and the shared expert and the routed ones share the one
    all-reduce. The cost: each expert's GEMMs are N times narrower (2304 / N columns on
    V4.1-Flash), which expert parallelism would avoid at large N.

Replicated (whole and computed identically on every rank): the embedding and the LM head, all
norms, the mHC hyper-connections, ``q_a_proj`` (the query latent, which the indexer reads),
``kv_proj`` (the latent KV), the compressor, the indexer (its queries come from the replicated
latent), Engram, the MoE gate, and the draft layers (``mtp``). So the paged state (PAGE rows,
window and compressor rings, cursors) is written from replicated inputs and is byte-identical
on every rank, and every discrete choice (index top-k, candidate blocks, expert routing) is
made from replicated inputs, identically everywhere.

Collectives of a forward: two all-reduces per main decoder layer and nothing else (the
attention output [N, hidden] in the compute dtype, after ``o_b_proj``; the MoE output
[N, hidden] in float32). After each, every rank holds the same tensor. Draft layers: none.
Every rank must therefore run the same forwards (the same tokens and spans, in the same order,
against its own pool and slots of the same geometry); the logits are the same on every rank.

At world size 1 nothing is split and no hook is set: the model is the unsplit one, bit for bit.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from atom.distributed.parallel_state import ParallelState
from atom.models.common.config import ConfigError
from atom.models.deepseek_v41.attention import CSA2Attention
from atom.models.deepseek_v41.config import V41Config
from atom.models.deepseek_v41.engram import EngramHash
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.weights import load_weights

__all__ = [
    "TensorParallelError",
    "SPLIT_RULES",
    "check_v41_tp",
    "v41_split_dims",
    "shard_v41_model",
    "load_v41_weights_tp",
    "build_v41_tp",
    "TIER_BYTES_REPLICATED",
]

#: Every rank's PAGE blocks and checkpoint images hold the same bytes: what a block stores
#: (the latent KV, the index keys, the compressed rows) and what an image holds (window and
#: compressor rings, the Engram cursor) come from replicated modules (kv_proj, compressor,
#: indexer, Engram) applied to hidden states that every rank holds whole after each
#: all-reduce. So one stored copy serves every rank (the tier's rank collapse).
TIER_BYTES_REPLICATED = True


class TensorParallelError(ConfigError):
    """A world size the model cannot be split over, or a model that is already split."""


# (parameter name within a main decoder layer, the dimension split across the ranks)
SPLIT_RULES: tuple[tuple[str, int], ...] = (
    (r"self_attn\.q_b_proj\.weight", 0),
    (r"self_attn\.attn_sink", 0),
    (r"self_attn\.o_a_proj\.weight", 0),
    (r"self_attn\.o_b_proj\.weight", 1),
    (r"mlp\.(experts\.\d+|shared_experts)\.(gate_proj|up_proj)\.weight", 0),
    (r"mlp\.(experts\.\d+|shared_experts)\.down_proj\.weight", 1),
)
_SPLIT_RE = tuple((re.compile(rf"model\.layers\.(\d+)\.{pat}$"), dim) for pat, dim in SPLIT_RULES)


def check_v41_tp(config: V41Config, world_size: int) -> None:
    """Refuse a world size that does not divide what is split, naming each value."""
    if world_size < 1:
        raise TensorParallelError(f"tensor_parallel_size={world_size} must be >= 1")
    fields = ("num_attention_heads", "o_groups", "moe_intermediate_size")
    bad = [f"{f}={getattr(config, f)}" for f in fields if getattr(config, f) % world_size]
    if bad:
        raise TensorParallelError(
            f"tensor_parallel_size={world_size} must divide num_attention_heads, o_groups and "
            f"moe_intermediate_size (the ranks split the attention heads, the output "
            f"projection's groups and every expert's intermediate dimension); it does not "
            f"divide {', '.join(bad)}"
        )


def v41_split_dims(names, num_hidden_layers: int) -> dict[str, int]:
    """Parameter (or HF checkpoint) name -> the dimension split across ranks, for the names
    that are split (main decoder layers only: draft layers stay whole)."""
    out = {}
    for name in names:
        for pat, dim in _SPLIT_RE:
            m = pat.match(name)
            if m and int(m[1]) < num_hidden_layers:
                out[name] = dim
                break
    return out


def _narrow(model: nn.Module, name: str, dim: int, rank: int, world: int) -> None:
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    p = getattr(module, attr)
    n = p.shape[dim] // world
    part = p.detach().narrow(dim, rank * n, n).clone()  # own storage: the whole one is freed
    setattr(module, attr, nn.Parameter(part, requires_grad=p.requires_grad))


@torch.no_grad()
def shard_v41_model(model: DeepseekV41ForCausalLM, state: ParallelState) -> DeepseekV41ForCausalLM:
    """Split a whole model in place for ``state``'s rank (module doc) and return it.

    The model may hold weights (each rank built the same whole model: same seed or the same
    checkpoint) or be on ``meta`` (``build_v41_tp`` then materializes it and loads only this
    rank's slices). Its forwards then all-reduce on ``state``; nothing else about using it
    changes. Refuses a world size that does not divide the split dimensions, and a model that
    is already split. At world size 1 the model is returned untouched."""
    config = model.config
    check_v41_tp(config, state.world_size)
    if getattr(model, "tp_state", None) is not None:
        raise TensorParallelError("the model is already split for tensor parallelism")
    model.tp_state = state
    world, rank = state.world_size, state.rank
    if world == 1:
        return model
    split = v41_split_dims(dict(model.named_parameters()), config.num_hidden_layers)
    for name, dim in split.items():
        _narrow(model, name, dim, rank, world)
    for layer in model.model.layers:
        attn, moe = layer.self_attn, layer.mlp
        attn.heads //= world
        attn.groups //= world
        attn.reduce_output = state.all_reduce
        moe._stack = None  # the stacked whole expert weights, if built: restacked from slices
        moe.reduce_output = state.all_reduce
    return model


def load_v41_weights_tp(model: DeepseekV41ForCausalLM, path: str | Path) -> None:
    """Load a whole HF-style checkpoint into a model split by ``shard_v41_model``: each split
    tensor's slice of this rank is read (and only it), the rest whole; shapes are checked
    against the whole tensors (``weights.load_weights``)."""
    state = getattr(model, "tp_state", None) or ParallelState.single()
    dims = v41_split_dims(model.state_dict(), model.config.num_hidden_layers)
    shards = {} if state.world_size == 1 else dims
    load_weights(
        model,
        path,
        shards={n: (d, state.rank, state.world_size) for n, d in shards.items()},
    )


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
    """This rank's split model, in eval mode: from ``checkpoint`` (built on ``meta``, split,
    materialized on ``device``: only this rank's slices are ever allocated or read), or else
    from ``seed`` (the whole model is built and initialized as ``init_weights(seed)`` does
    at world size 1 on that device, then split: the same weights as the unsplit model)."""
    check_v41_tp(config, state.world_size)
    kw = dict(dtype=dtype, kv_dtype=kv_dtype, index_dtype=index_dtype)
    if checkpoint is None:
        if seed is None:
            raise ValueError("build_v41_tp needs a checkpoint or a seed")
        model = DeepseekV41ForCausalLM(config, device=device, **kw).init_weights(seed)
        return shard_v41_model(model, state).eval()
    model = shard_v41_model(DeepseekV41ForCausalLM(config, device="meta", **kw), state)
    materialize(model, device)
    load_v41_weights_tp(model, checkpoint)
    return model.eval()


def materialize(model: DeepseekV41ForCausalLM, device: torch.device | str) -> None:
    """Allocate (uninitialized) on ``device`` a model built on ``meta``, and rebuild what is
    not a parameter or buffer (the RoPE tables); the caller loads every tensor afterwards."""
    model.to_empty(device=device)
    with torch.device(device):
        for m in model.modules():
            if isinstance(m, CSA2Attention):
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
