"""Model resolution: a preset name (random weights from a seed) or a checkpoint directory.

The engine asks this module for a ``ModelRuntime``; it never names a model class itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from atom.models.deepseek_v41.config import ConfigError, V41Config
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.presets import PRESET_BLOCK_SIZE, PRESETS, preset_config
from atom.models.deepseek_v41.runtime import V41Runtime
from atom.models.deepseek_v41.weights import load_weights

SUPPORTED_MODEL_TYPES = ("deepseek_v41", "deepseek_v4")


def resolve_config(model: str) -> tuple[V41Config, Path | None]:
    """(config, checkpoint directory or None for a preset)."""
    if model in PRESETS:
        return preset_config(model), None
    path = Path(model)
    if path.is_dir() and (path / "config.json").exists():
        data = json.loads((path / "config.json").read_text())
        kind = data.get("model_type", "deepseek_v41")
        if kind not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{path}/config.json has model_type={kind!r}; supported: {SUPPORTED_MODEL_TYPES}"
            )
        return V41Config.from_dict(data, source=str(path / "config.json")), path
    raise ConfigError(
        f"model={model!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a directory "
        "holding config.json and *.safetensors"
    )


def default_block_size(model: str) -> int:
    return PRESET_BLOCK_SIZE.get(model, 256)


def load_runtime(
    model: str,
    *,
    dtype: torch.dtype,
    kv_dtype: str,
    index_dtype: str,
    block_size: int,
    device: str | torch.device,
    seed: int,
    speculative_tokens: int = 0,
) -> V41Runtime:
    config, path = resolve_config(model)
    net = DeepseekV41ForCausalLM(
        config, dtype=dtype, kv_dtype=kv_dtype, index_dtype=index_dtype, device=device
    )
    if path is None:
        net.init_weights(seed)
    else:
        load_weights(net, path)
    net.eval()
    return V41Runtime(net, block_size=block_size, speculative_tokens=speculative_tokens)
