"""Turning validation errors into messages that name the field, for conditions and the CLI."""

from __future__ import annotations

from pydantic import ValidationError


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            # pydantic puts the validator's class name in loc for model validators; skip those.
            if isinstance(part, str) and part[:1].isupper() and not out:
                continue
            out += f".{part}" if out else str(part)
    return out


def format_validation_error(err: ValidationError, prefix: str = "") -> list[str]:
    """One line per error: ``spec.serving.maxModelLen: Input should be greater than or equal to 128``."""
    lines = []
    for e in err.errors(include_url=False):
        field = _path(tuple(e["loc"]))
        if prefix:
            field = f"{prefix}.{field}" if field else prefix
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{field}: {msg}" if field else msg)
    return lines
