"""The published DeepSeek-V4.1-Flash ``config.json`` form, read as it ships.

The published file nests the text model under ``text_config`` (``model_type``
``deepseek_v41_text``) with a ``vision_config`` beside it and the checkpoint's
``quantization_config`` at the top. ``flatten`` turns it into the flat form ``V41Config``
validates. Every key is read or ignored for a stated reason (``KEYS``); docs/DESIGN_NOTES.md
lists them. A flat config (atom's own, or a checkpoint atom wrote) passes through unchanged.
"""

from __future__ import annotations

from typing import Any

# top-level keys: what becomes of each
TOP_KEYS: dict[str, str] = {
    "architectures": "ignored: the model is chosen by model_type",
    "model_type": "read: deepseek_v41 picks this family",
    "dtype": "ignored: the compute dtype is the engine's --dtype",
    "torch_dtype": "ignored: the compute dtype is the engine's --dtype",
    "transformers_version": "ignored: no transformers code runs",
    "bos_token_id": "ignored: the serving layer reads its tokenizer's special tokens",
    "eos_token_id": "ignored: the serving layer reads its tokenizer's special tokens",
    "pad_token_id": "ignored: prompts are never padded",
    "image_token_id": "read: image inputs are refused until the vision tower exists",
    "quantization_config": "read: FP8 checkpoints turn the published roundings on",
    "text_config": "read: the text model (flattened)",
    "vision_config": "read and kept: image inputs are refused until the vision tower exists",
}

# text_config keys that atom does not use, and why (every other key is a V41Config field)
IGNORED_TEXT_KEYS: dict[str, str] = {
    "model_type": "deepseek_v41_text: the nesting's own type",
    "num_key_value_heads": "always 1 (one shared latent is K and V)",
    "hidden_act": "always SiLU (clamped SwiGLU)",
    "attention_bias": "always false",
    "attention_dropout": "inference only",
    "use_cache": "the engine always caches",
    "topk_method": "noaux_tc is the only router (top-k of score + bias)",
    "norm_topk_prob": "always true (weights normalised with 1e-20)",
}

_DSPARK_KEYS = (
    "dspark_block_size",
    "dspark_noise_token_id",
    "dspark_target_layer_ids",
    "dspark_markov_rank",
    "dspark_n_routed_experts",
    "dspark_num_experts_per_tok",
)


def is_published_form(data: Any) -> bool:
    return isinstance(data, dict) and isinstance(data.get("text_config"), dict)


def flatten(data: dict[str, Any]) -> dict[str, Any]:
    """The published nested form -> V41Config's flat dict (a new dict; ``data`` untouched).

    * ``model_type`` is the top level's (``deepseek_v41``); ``rope_scaling.rope_type`` is
      read as ``type``.
    * DSpark: ``num_nextn_predict_layers`` counts its stages, which atom does not run yet
      (it drafts with its own MTP-style draft layers), so they become ``dspark_stages``, the
      stages' entries leave ``compress_ratios`` (window-only, 0), and the model builds no
      draft layers; the ``dspark_*`` keys are kept.
    * ``quantization_config`` with ``quant_method: fp8`` turns on the roundings the published
      code applies (``kv_fp8_sim``, ``compressed_fp4_sim``, ``index_fp4_sim``,
      ``act_fp8_sim``) unless the text config sets them.
    """
    text = dict(data["text_config"])
    unknown = sorted(set(data) - set(TOP_KEYS))
    if unknown:
        raise ValueError(f"unknown top-level keys {unknown} in a published V4.1 config")
    flat = {k: v for k, v in text.items() if k not in IGNORED_TEXT_KEYS}
    flat["model_type"] = data.get("model_type", "deepseek_v41")
    rs = flat.get("rope_scaling")
    if isinstance(rs, dict) and "rope_type" in rs and "type" not in rs:
        flat["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in rs.items()}
    if flat.get("dspark_block_size") and "dspark_stages" not in text:  # as DeepSeek writes it
        stages = int(flat.get("num_nextn_predict_layers", 0))
        n = int(flat["num_hidden_layers"])
        flat["dspark_stages"] = stages
        flat["num_nextn_predict_layers"] = 0
        if "compress_ratios" in flat:
            flat["compress_ratios"] = list(flat["compress_ratios"])[:n]
    quant = data.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") == "fp8":
        for key in ("kv_fp8_sim", "compressed_fp4_sim", "index_fp4_sim", "act_fp8_sim"):
            flat.setdefault(key, True)
        flat["quantization_config"] = dict(quant)
    if "vision_config" in data:
        flat["vision_config"] = dict(data["vision_config"])
    if "image_token_id" in data:
        flat["image_token_id"] = data["image_token_id"]
    return flat


ARCHITECTURES = ["DeepseekV41ForCausalLM"]
_TOP_LEVEL_FIELDS = ("quantization_config", "vision_config", "image_token_id")


def to_published(flat: dict[str, Any]) -> dict[str, Any]:
    """V41Config's flat dict -> the published nested form (``flatten`` reads it back).

    The text model's fields go under ``text_config`` (``model_type deepseek_v41_text``);
    ``quantization_config``, ``vision_config`` and ``image_token_id`` stay at the top. A
    config with DSpark stages keeps them as ``dspark_stages`` (atom's own field) rather than
    re-encoding them into ``num_nextn_predict_layers``, so the round trip is exact.
    """
    text = {k: v for k, v in flat.items() if k not in _TOP_LEVEL_FIELDS and k != "model_type"}
    text["model_type"] = "deepseek_v41_text"
    out: dict[str, Any] = {
        "architectures": list(ARCHITECTURES),
        "model_type": flat.get("model_type", "deepseek_v41"),
        "text_config": text,
    }
    for key in _TOP_LEVEL_FIELDS:
        if flat.get(key) is not None:
            out[key] = flat[key]
    return out
