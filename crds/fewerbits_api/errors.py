"""Turning validation errors into messages that name the field, for conditions and the CLI."""

from __future__ import annotations

import json
import re

from pydantic import ValidationError

_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


def field_path(loc: tuple) -> str:
    """A pydantic error location as the field a person wrote: ``spec.serving.targets[0]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            # pydantic puts a validator tag (`function-after[...]`) in loc for validators of a
            # union member; skip those. A capitalised key is a field the user wrote (a typo of
            # `serving` as `Serving`): it must be named, not dropped.
            if isinstance(part, str) and ("[" in part or "(" in part):
                continue
            part = str(part)
            if not _PLAIN_KEY.fullmatch(part):
                # A key with spaces, newlines or quotes would be invisible or ambiguous: quote it.
                out += f"[{json.dumps(part)}]"
            else:
                out += f".{part}" if out else part
    return out


def format_validation_error(err: ValidationError, prefix: str = "") -> list[str]:
    """One line per error: ``spec.serving.maxModelLen: Input should be greater than or equal to 128``."""
    lines = []
    for e in err.errors(include_url=False):
        field = field_path(tuple(e["loc"]))
        if prefix:
            field = (f"{prefix}{field}" if field.startswith("[") else f"{prefix}.{field}") if field else prefix
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{field}: {msg}" if field else msg)
    return lines
