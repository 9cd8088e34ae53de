"""One validation mechanism for every input file: pydantic v2 models, errors turned into paths.

Every file a user writes (topology, its ``adb:`` section, device profiles, measurement files) is
described by a :class:`Schema` subclass and checked with :func:`parse`. A failed check raises one
:class:`testbed.errors.InputError` (or the subclass the caller names) listing *every* problem with
its path in the file's own notation (``devices[1].link.up: ...``), so the CLI prints it once and
exits 2.

Why pydantic: it checks a whole document in one pass and reports every error with its location,
which is what our hand-written checkers did, in three different shapes; unknown keys are refused
by ``extra="forbid"``; and field validators keep unit parsing (``100Mbit``) next to the field.
Models describe the *file*; the frozen dataclasses the rest of testbed reads are built from them,
so a schema change never leaks pydantic types into the PS or the agent (which must import without
pydantic on a phone).
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from testbed.errors import InputError

S = TypeVar("S", bound="Schema")


class Schema(BaseModel):
    """Base of every file schema: unknown keys are errors, values are immutable once read."""

    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=True)


def error_path(loc: tuple[int | str, ...], root: str = "") -> str:
    """``('devices', 1, 'link', 'up')`` -> ``devices[1].link.up`` (``root`` prefixes it)."""
    out = root
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out = f"{out}.{part}" if out else str(part)
    return out or "<top>"


def problems_of(exc: ValidationError, root: str = "") -> list[str]:
    """Every error of a pydantic ValidationError as ``path: message (got value)``."""
    problems = []
    for err in exc.errors(include_url=False):
        # pydantic appends the branch of a union it tried ("function-after[...]", "str", "int")
        # to the location; a user never wrote those, so keep only the keys and indices.
        loc = tuple(p for p in err["loc"] if isinstance(p, int) or _is_user_key(p))
        message = str(err["msg"])
        if message.startswith("Value error, "):
            message = message[len("Value error, "):]
        if err["type"] == "extra_forbidden":
            message = "unknown key"
        elif err["type"] == "missing":
            message = "required key is missing"
        elif "input" in err and err["type"] not in ("value_error",):
            message += f" (got {_short(err['input'])})"
        problems.append(f"{error_path(loc, root)}: {message}")
    return problems


def parse(model: type[S], raw: Any, source: str, *, error: type[InputError] = InputError,
          root: str = "") -> S:
    """Validate ``raw`` (plain data read from ``source``) against ``model``; raise ``error``."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise error(source, problems_of(exc, root)) from None


def finite(value: float, name: str = "value") -> float:
    """A field validator's helper: refuse NaN and infinities with a message that says so."""
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


def _is_user_key(part: str) -> bool:
    return not (part.endswith("]") or "[" in part or part in ("str", "int", "float", "bool",
                                                             "list", "dict", "none"))


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
