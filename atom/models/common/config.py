"""The base of every model config: reading config.json, the error type, the shared checks.

A family's config subclasses ``ModelConfig`` and declares its own fields (their order is the
order of ``to_dict()``). Its cross-field check calls the functions below where its rule and its
wording are the same as every family's, and keeps its own checks where its model differs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from atom.config_errors import format_validation_error


class ConfigError(ValueError):
    """A model config value that cannot be used; the message names the field and the fix."""


SCORING_ALIASES = {"sqrtsoftplus": "sqrt_softplus"}
ConfigT = TypeVar("ConfigT", bound="ModelConfig")


class ModelConfig(BaseModel):
    """A frozen, validated model config; unknown fields are ignored (HF configs carry many).

    ``from_dict``/``from_json`` raise ``ConfigError`` naming the source, the field and the fix.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    @field_validator("scoring_func", mode="before", check_fields=False)
    @classmethod
    def _scoring_alias(cls, v: Any) -> Any:
        # DeepSeek's configs spell it "sqrtsoftplus"; both spellings are one function, kept
        # under one name so the layout id (and the tier namespace) does not depend on spelling
        return SCORING_ALIASES.get(v, v)

    @classmethod
    def from_dict(cls: type[ConfigT], data: dict[str, Any], source: str = "config") -> ConfigT:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, f"model config ({source})")) from None

    @classmethod
    def from_json(cls: type[ConfigT], path: str | Path) -> ConfigT:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"model config not found: {path}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_dict(data, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()


def fail(field: str, value: Any, allowed: str) -> NoReturn:
    """Refuse a value inside a validator (pydantic wraps it into the ``ConfigError``)."""
    raise ValueError(f"{field}={value!r} is invalid: {allowed}")


def check_positive(c: ModelConfig, names: Iterable[str]) -> None:
    for name in names:
        if getattr(c, name) <= 0:
            fail(name, getattr(c, name), "must be a positive integer")


def check_attention_dims(c: ModelConfig) -> None:
    """The RoPE part of a head and of an index key, and the output groups over the heads."""
    if c.qk_rope_head_dim <= 0 or c.qk_rope_head_dim % 2 or c.qk_rope_head_dim >= c.head_dim:
        fail("qk_rope_head_dim", c.qk_rope_head_dim, f"must be even and in (0, {c.head_dim})")
    if c.qk_rope_head_dim >= c.index_head_dim:
        fail(
            "index_head_dim",
            c.index_head_dim,
            f"must exceed qk_rope_head_dim={c.qk_rope_head_dim} (index keys are rotated too)",
        )
    if c.num_attention_heads % c.o_groups:
        fail("o_groups", c.o_groups, f"must divide num_attention_heads={c.num_attention_heads}")


def check_rope_scaling(rope_scaling: dict[str, Any] | None) -> None:
    """None (plain RoPE) or YaRN with its two required keys."""
    if rope_scaling is None:
        return
    kind = rope_scaling.get("type", rope_scaling.get("rope_type"))
    if kind != "yarn":
        fail("rope_scaling.type", kind, "only 'yarn' (or no rope_scaling) is supported")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in rope_scaling:
            fail(f"rope_scaling.{key}", None, "required for yarn")
