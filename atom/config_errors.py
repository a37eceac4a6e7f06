"""Config errors that name the field, the bad value and what is allowed."""

from __future__ import annotations

from pydantic import ValidationError


class EngineConfigError(ValueError):
    """An engine config that cannot run; the message names the field, value and fix."""


UNKNOWN_ENGINE_FIELD = "unknown field (check the spelling; see --print-config for every field)"


def format_validation_error(
    exc: ValidationError, source: str, unknown: str = UNKNOWN_ENGINE_FIELD
) -> str:
    """One message for every config in the project: ``field=value: what is allowed`` per error
    (``unknown`` is what an unknown field is told)."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = unknown
        value = err.get("input")
        lines.append(f"{loc}={value!r}: {msg}" if loc else msg)
    return f"invalid {source}: " + "; ".join(lines)
