"""Config errors that name the field, the bad value and what is allowed."""

from __future__ import annotations

from typing import Any, NamedTuple

from pydantic import ValidationError


class EngineConfigError(ValueError):
    """An engine config that cannot run; the message names the field, value and fix."""


UNKNOWN_ENGINE_FIELD = "unknown field (check the spelling; see --print-config for every field)"


class FieldError(NamedTuple):
    loc: str  # dotted field path ("" for a model-level check)
    msg: str  # pydantic's message, without its "Value error, " prefix
    value: Any  # the input that was refused (absent: None)
    kind: str  # pydantic's error type ("extra_forbidden", "missing", "json_invalid", ...)
    ctx: dict
    given: bool  # the error carries the input (None can be a given value)


def field_errors(errors: list[dict], skip: tuple[str, ...] = ()) -> list[FieldError]:
    """pydantic's errors as (field, message, value, kind): the one reading of them that every
    message the project writes (configs, HTTP requests) is built from."""
    return [
        FieldError(
            ".".join(str(p) for p in err["loc"] if p not in skip),
            err["msg"].removeprefix("Value error, "),
            err.get("input"),
            err["type"],
            err.get("ctx") or {},
            "input" in err,
        )
        for err in errors
    ]


def format_validation_error(
    exc: ValidationError, source: str, unknown: str = UNKNOWN_ENGINE_FIELD
) -> str:
    """One message for every config in the project: ``field=value: what is allowed`` per error
    (``unknown`` is what an unknown field is told)."""
    lines = []
    for e in field_errors(exc.errors()):
        msg = unknown if e.kind == "extra_forbidden" else e.msg
        lines.append(f"{e.loc}={e.value!r}: {msg}" if e.loc else msg)
    return f"invalid {source}: " + "; ".join(lines)
