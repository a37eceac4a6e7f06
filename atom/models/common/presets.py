"""Preset helpers every family's ``presets`` module uses (the presets themselves stay there:
each is a fact of its own model)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from atom.models.common.config import ConfigError, ConfigT


def yarn(factor: float, original_max_position_embeddings: int) -> dict[str, Any]:
    """DeepSeek's YaRN ``rope_scaling`` (beta_fast 32, beta_slow 1) for a context extension."""
    return dict(
        type="yarn",
        factor=factor,
        original_max_position_embeddings=original_max_position_embeddings,
        beta_fast=32,
        beta_slow=1,
    )


def build_preset(
    config_cls: type[ConfigT], presets: Mapping[str, dict[str, Any]], name: str, overrides: dict
) -> ConfigT:
    """The config of preset ``name`` with field overrides, validated like a config.json."""
    if name not in presets:
        raise ConfigError(f"unknown model preset {name!r}; known presets: {sorted(presets)}")
    return config_cls.from_dict({**presets[name], **overrides}, source=f"preset {name}")
