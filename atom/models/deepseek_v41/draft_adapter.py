"""A trained draft layer kept as a small file: the draft's init recipe plus what training changed.

A bench-size draft layer holds half a billion parameters (v41-bench-draft: 0.5 B, 1 GB in
bf16), too many to ship beside a preset whose target is rebuilt from a seed. A **draft
adapter** stores the rest of the recipe instead:

    draft = init_from_last_layer(model)             # a copy of the target's last layer
    W    += B @ A      for each adapted linear       # low-rank deltas, rank r
    t     = stored t   for each small tensor         # norms, mHC mixers, sinks, the router

``init_from_last_layer`` is deterministic given the target's weights (a preset's seed or a
checkpoint), so the draft is reproducible from the target and the adapter file. The file is a
safetensors file whose metadata names its format (``FORMAT``), the layer it adapts, the target
it was trained on (``target_signature``: the config fields the draft's shapes and inputs depend
on; ``target_fingerprint``: a checksum of the weights the init copies) and the recipe it came
from; ``apply_adapter`` refuses a file for another model, a missing
or misshapen tensor, or a draft linear that is not a plain weight (FP8 at load: adapt before
quantizing).

Training (``tools/train_draft_adapter.py``) wraps the adapted linears with ``LowRank``
parametrizations (the weight read as ``W0 + B @ A``, gradients into A and B only) and trains
the small tensors whole; ``adapter_tensors`` collects both for ``save_adapter``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.nn.utils import parametrize

FORMAT = "atom-draft-adapter/1"

# the draft layer's linears that get low-rank deltas (relative to ``mtp.{i}``); the routed
# experts stay the last layer's (8 x 3 large matrices: the adapter would be the size of one)
ADAPTED = (
    "eh_proj",
    "self_attn.q_a_proj",
    "self_attn.q_b_proj",
    "self_attn.kv_proj",
    "self_attn.o_a_proj",
    "self_attn.o_b_proj",
    "mlp.shared_experts.gate_proj",
    "mlp.shared_experts.up_proj",
    "mlp.shared_experts.down_proj",
)

# small tensors stored whole (every parameter of the layer whose name starts with one of these)
WHOLE = (
    "enorm.",
    "hnorm.",
    "shared_head.norm.",
    "head_hc.",
    "attn_hc.",
    "ffn_hc.",
    "input_layernorm.",
    "post_attention_layernorm.",
    "self_attn.attn_sink",
    "self_attn.q_a_layernorm.",
    "self_attn.kv_norm.",
    "mlp.gate.weight",  # not its e_score_correction_bias: it only picks experts (no gradient)
)


class AdapterError(ValueError):
    """A draft adapter that does not fit the model it is applied to (the message says why)."""


class LowRank(torch.nn.Module):
    """Parametrization ``W -> W + B @ A`` (A [r, in] small random, B [out, r] zero: the delta
    starts at 0), computed in float32 and cast to W's dtype."""

    def __init__(self, out_features: int, in_features: int, rank: int, gen: torch.Generator):
        super().__init__()
        a = torch.randn(rank, in_features, generator=gen) / in_features**0.5
        self.a = torch.nn.Parameter(a)
        self.b = torch.nn.Parameter(torch.zeros(out_features, rank))

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return (w.float() + self.b @ self.a).to(w.dtype)


def target_signature(config) -> dict:
    """The config fields a draft layer's shapes and inputs depend on (an adapter applies only to
    a model whose signature equals the one it was trained on)."""
    keys = (
        "hidden_size",
        "vocab_size",
        "num_hidden_layers",
        "hc_mult",
        "num_attention_heads",
        "head_dim",
        "q_lora_rank",
        "o_lora_rank",
        "o_groups",
        "n_routed_experts",
        "moe_intermediate_size",
        "sliding_window",
    )
    return {k: getattr(config, k, None) for k in keys}


@torch.no_grad()
def target_fingerprint(model) -> float:
    """A checksum of the target weights the draft's init copies (the last layer's KV projection
    and the final norm): a preset's seed and a checkpoint both show in it, so an adapter trained
    on one target's weights is refused on another's of the same shape."""
    last = model.model.layers[-1]
    w = last.self_attn.kv_proj.weight
    if type(w) is not torch.nn.Parameter:  # FP8 at load: its dequantized values
        w = w.dequantize() if hasattr(w, "dequantize") else w
    return float(w.double().abs().sum() + model.model.norm.weight.double().abs().sum())


@torch.no_grad()
def init_from_last_layer(
    model, layer: int = 0, *, embed_rms: float = 1.0, stream_rms: float = 1.0
) -> None:
    """Draft layer ``layer`` from the target's last layer: its mHC mixers, norms, attention and
    MoE copied; ``head_hc`` from the ``pre`` part of the last FFN's mixer (the main head collapses
    the streams with it); ``shared_head.norm`` the model's final norm; ``enorm`` / ``hnorm`` filled
    with ``embed_rms`` / ``stream_rms`` (the scales of the embeddings and the streams, so both
    keep theirs); ``eh_proj`` = [I, I] (the residual passed through, the next token's embedding
    added, as the model's own input is)."""
    if not 0 <= layer < len(model.mtp):
        raise AdapterError(f"draft layer {layer} out of range: the model has {len(model.mtp)}")
    block, last = model.mtp[layer], model.model.layers[-1]
    ours = dict(block.named_parameters())
    for name, src in last.named_parameters():
        if name in ours and ours[name].shape == src.shape:
            ours[name].copy_(src.to(ours[name].dtype))
    hc, mixer = model.config.hc_mult, last.ffn_hc
    block.head_hc.fn.copy_(mixer.fn[:hc])
    block.head_hc.base.copy_(mixer.base[:hc])
    block.head_hc.scale.copy_(mixer.scale[:1])
    block.shared_head.norm.weight.copy_(model.model.norm.weight)
    block.enorm.weight.fill_(embed_rms)
    block.hnorm.weight.fill_(stream_rms)
    d = model.config.hidden_size
    w = block.eh_proj.weight
    eye = torch.eye(d, dtype=w.dtype, device=w.device)
    w.copy_(torch.cat([eye, eye], dim=1))


def submodule(block, path: str) -> torch.nn.Module:
    mod = block
    for part in path.split("."):
        mod = getattr(mod, part)
    return mod


def _whole_names(block) -> list[str]:
    """The block's parameters stored whole (``WHOLE``), by name."""
    return [name for name, _ in block.named_parameters() if name.startswith(WHOLE)]


def add_low_rank(model, layer: int, rank: int, seed: int) -> None:
    """Parametrize the draft layer's ``ADAPTED`` linears with ``LowRank`` (rank ``rank``, A
    drawn from ``seed``, on the weights' device); ``trainable`` names the new factors."""
    block = model.mtp[layer]
    gen = torch.Generator().manual_seed(seed)
    for path in ADAPTED:
        mod = submodule(block, path)
        w = mod.weight
        if type(w) is not torch.nn.Parameter or not w.is_floating_point():
            raise AdapterError(f"mtp.{layer}.{path} is not a plain weight ({type(w).__name__})")
        low = LowRank(w.shape[0], w.shape[1], rank, gen).to(w.device)
        parametrize.register_parametrization(mod, "weight", low)


def trainable(model, layer: int) -> dict[str, torch.nn.Parameter]:
    """What training changes in draft layer ``layer``, by the adapter's tensor names: the small
    tensors stored whole and the low-rank factors (after ``add_low_rank``)."""
    block = model.mtp[layer]
    named = dict(block.named_parameters())
    params = {f"whole.{n}": named[n] for n in _whole_names(block)}
    for path in ADAPTED:
        low = submodule(block, path).parametrizations.weight[0]
        params[f"lowrank.{path}.a"], params[f"lowrank.{path}.b"] = low.a, low.b
    return params


def adapter_tensors(
    model, layer: int, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """The adapter's tensors (``dtype`` on the CPU; float32 tensors of the layer stay float32):
    ``whole.<name>`` and ``lowrank.<path>.a/.b``."""
    block = model.mtp[layer]
    named = dict(block.named_parameters())

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", torch.float32 if t.dtype == torch.float32 else dtype)

    out = {f"whole.{n}": cast(named[n]) for n in _whole_names(block)}
    for path in ADAPTED:
        low = submodule(block, path).parametrizations.weight[0]
        out[f"lowrank.{path}.a"] = low.a.detach().to("cpu", dtype)
        out[f"lowrank.{path}.b"] = low.b.detach().to("cpu", dtype)
    return {k: v.contiguous() for k, v in out.items()}


def save_adapter(
    model, layer: int, path: str | Path, recipe: dict, dtype: torch.dtype = torch.float32
) -> Path:
    """Write draft layer ``layer``'s adapter to ``path`` (safetensors; metadata: ``FORMAT``, the
    layer, the target's signature and weights' fingerprint, the low-rank rank and ``recipe``);
    ``dtype``: the low-rank factors' and the layer's non-float32 tensors' (bf16 halves the file
    of a bf16 model, whose merged weights are rounded to bf16 anyway)."""
    from safetensors.torch import save_file

    tensors = adapter_tensors(model, layer, dtype)
    rank = tensors[f"lowrank.{ADAPTED[0]}.a"].shape[0]
    meta = {
        "format": FORMAT,
        "layer": str(layer),
        "rank": str(rank),
        "target": json.dumps(target_signature(model.config), sort_keys=True),
        "fingerprint": repr(target_fingerprint(model)),
        "recipe": json.dumps(recipe, sort_keys=True),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)  # a reader never sees half a file
    return path


def read_adapter(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, metadata) of an adapter file; ``AdapterError`` if it is not one."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise AdapterError(f"draft adapter {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error types
        raise AdapterError(f"{path} is not a safetensors file: {exc}") from None
    if meta.get("format") != FORMAT:
        raise AdapterError(
            f"{path} is not a draft adapter of format {FORMAT} (its format: "
            f"{meta.get('format')!r}); write one with tools/train_draft_adapter.py"
        )
    return tensors, meta


@torch.no_grad()
def apply_adapter(model, path: str | Path) -> dict:
    """Make the model's draft layer the adapter's: ``init_from_last_layer``, then each low-rank
    delta merged into its weight and each whole tensor copied. Returns the file's metadata
    (``recipe`` decoded). Raises ``AdapterError`` (nothing changed) for a file of another format,
    another target, a layer the model lacks, or tensors that do not fit."""
    tensors, meta = read_adapter(path)
    layer = int(meta.get("layer", "0"))
    if not 0 <= layer < len(getattr(model, "mtp", ())):
        raise AdapterError(
            f"{path} adapts draft layer {layer}, but the model has "
            f"{len(getattr(model, 'mtp', ()))} draft layers (num_nextn_predict_layers); use a "
            "model with draft layers (e.g. v41-bench-draft)"
        )
    want = target_signature(model.config)
    have = json.loads(meta.get("target", "{}"))
    diff = {k: (have.get(k), v) for k, v in want.items() if have.get(k) != v}
    if diff:
        detail = ", ".join(f"{k}: adapter {a!r}, model {b!r}" for k, (a, b) in diff.items())
        raise AdapterError(f"{path} was trained for another target ({detail})")
    have_fp, want_fp = float(meta.get("fingerprint", "nan")), target_fingerprint(model)
    if not abs(have_fp - want_fp) <= 1e-3 * abs(want_fp):
        raise AdapterError(
            f"{path} was trained on other target weights (fingerprint {have_fp!r}, this "
            f"model's {want_fp!r}): the same preset with another seed, or another checkpoint"
        )
    block = model.mtp[layer]
    named = dict(block.named_parameters())
    whole = {k[len("whole.") :]: v for k, v in tensors.items() if k.startswith("whole.")}
    missing = [n for n in _whole_names(block) if n not in whole]
    extra = [n for n in whole if n not in named]
    lows = {}
    for p in ADAPTED:
        a, b = tensors.get(f"lowrank.{p}.a"), tensors.get(f"lowrank.{p}.b")
        if a is None or b is None:
            missing.append(f"lowrank.{p}")
            continue
        w = submodule(block, p).weight
        if type(w) is not torch.nn.Parameter:
            raise AdapterError(
                f"mtp.{layer}.{p} is stored as {type(w).__name__}, not a plain weight: apply the "
                "adapter at weight_dtype bf16"
            )
        if (b.shape[0], a.shape[1]) != tuple(w.shape) or a.shape[0] != b.shape[1]:
            raise AdapterError(
                f"{path}: lowrank.{p} is [{b.shape[0]} x {b.shape[1]}] @ "
                f"[{a.shape[0]} x {a.shape[1]}], the weight is {list(w.shape)}"
            )
        lows[p] = (a, b)
    bad = [n for n, v in whole.items() if n in named and named[n].shape != v.shape]
    if missing or extra or bad:
        raise AdapterError(
            f"{path} does not fit draft layer {layer}: missing {missing}, unexpected {extra}, "
            f"misshapen {bad}"
        )
    init_from_last_layer(model, layer)  # enorm / hnorm: the file's whole tensors below
    for p, (a, b) in lows.items():
        w = submodule(block, p).weight
        merged = w.float() + b.to(w.device).float() @ a.to(w.device).float()
        w.copy_(merged.to(w.dtype))
    for n, v in whole.items():
        named[n].copy_(v.to(named[n].device, named[n].dtype))
    return {**meta, "recipe": json.loads(meta.get("recipe", "{}"))}
