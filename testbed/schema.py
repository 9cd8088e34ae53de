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

What this module adds to plain pydantic, so that every file reads the same way:

* **Messages in the file's terms.** pydantic's wording ("Input should be a valid integer") is
  rewritten to the one our checkers always used (``expected int, got str 'eight'``, ``must not be
  negative, got -3``, ``unknown key (expected one of: down, up, delay)``); a model may give a
  better message for a key it refuses on purpose (:attr:`Schema.unknown_key_hints`).
* **Order.** Problems come in the order of the model's fields, depth first, with the unknown keys
  of a mapping before the problems of its known keys (as a reader scans a mapping).
* **YAML types.** :data:`Int`, :data:`Bool`, :data:`Str` are strict (``true`` is not an int,
  ``8`` is not a string); :data:`Float` takes ints and the numeric strings YAML 1.1 leaves
  unconverted (``3e-4``) and refuses NaN and infinities everywhere.
* **Cross references inside one document** (a switch a device names, a name listed twice) use
  the parse's ``context`` dict: :func:`parse` always passes a fresh one; :func:`unique` and
  :func:`scratch` read and write it.
"""

from __future__ import annotations

import math
import re
import reprlib
import types
import typing
from typing import Annotated, Any, ClassVar, TypeVar, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Strict,
    ValidationError,
    ValidationInfo,
)

from testbed.errors import InputError

S = TypeVar("S", bound="Schema")
T = TypeVar("T")


class Schema(BaseModel):
    """Base of every file schema: unknown keys are errors, values are immutable once read."""

    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=True)

    # key -> message for keys the model refuses on purpose (instead of "unknown key ...")
    unknown_key_hints: ClassVar[dict[str, str]] = {}


def finite(value: float, name: str = "value") -> float:
    """A field validator's helper: refuse NaN and infinities with a message that says so."""
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


def _yaml_float(value: Any) -> Any:
    # YAML 1.1 (PyYAML) reads 3e-4 as a string: accept numeric strings where a float is read.
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"must be a finite number, got {value!r}")
    return value


def printable(value: str) -> str:
    """``value``, or ValueError when it holds a control character (an escape, a NUL)."""
    if not value.isprintable():
        bad = next(ch for ch in value if not ch.isprintable())
        raise ValueError(f"expected text without control characters, got {value[:80]!r} "
                         f"({bad!r}: a name or note is printed to terminals and written to files)")
    return value


Int = Annotated[int, Strict()]
# text a command prints or writes again (a device's name, a description): an escape sequence in
# a measurement file's device column reached `perf show`'s terminal through the profile it made
PrintableStr = Annotated[str, Strict(), AfterValidator(printable)]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
# ints are accepted (Strict float takes them), bools are not; NaN and infinities are refused
Float = Annotated[float, BeforeValidator(_yaml_float), Strict(), AfterValidator(_finite)]


def scratch(info: ValidationInfo) -> dict[str, Any]:
    """The parse's scratch dict (its context); an empty throwaway dict when there is none."""
    return info.context if isinstance(info.context, dict) else {}


def unique(namespace: str, what: str) -> AfterValidator:
    """An item validator refusing a value seen before under ``namespace`` in the same parse."""

    def check(value: T, info: ValidationInfo) -> T:
        seen = scratch(info).setdefault(f"unique:{namespace}", set())
        if value in seen:
            raise ValueError(f"{what} {value!r} is listed twice")
        seen.add(value)
        return value

    return AfterValidator(check)


def error_path(loc: tuple[int | str, ...], root: str = "") -> str:
    """``('devices', 1, 'link', 'up')`` -> ``devices[1].link.up`` (``root`` prefixes it)."""
    out = root
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out = f"{out}.{part}" if out else str(part)
    return out or "<top>"


def problem_pairs(exc: ValidationError, root: str = "",
                  model: type[BaseModel] | None = None) -> list[tuple[str, str]]:
    """Every error of a ValidationError as ``(path, message)``, unknown keys first per mapping."""
    errors = list(exc.errors(include_url=False))
    locs: list[tuple[int | str, ...]] = []
    for err in errors:
        # pydantic appends the branch of a union it tried ("function-after[...]", "str", "int")
        # to the location; a user never wrote those, so keep only the keys and indices.
        locs.append(tuple(p for p in err["loc"] if isinstance(p, int) or _is_user_key(p)))
    order = _unknown_keys_first(errors, locs)
    pairs = []
    for i in order:
        if errors[i]["type"] == "invalid_key":  # the key is the problem: name its mapping
            key = errors[i].get("input")
            pairs.append((error_path(locs[i][:-1], root),
                          f"key {_short(key)}: expected a str key, got {_type_name(key)}"))
        else:
            message = _message(errors[i], locs[i], model)
            loc, message = _field_in_message(locs[i], message, errors[i]["type"], model)
            pairs.append((error_path(loc, root), _clipped(message)))
    return pairs


_NAME = r"[a-z_][a-z0-9_]*(?:\[[0-9]+\])?"
_FIELD_PREFIX = re.compile(rf"({_NAME}(?:\.{_NAME})*): (.+)", re.DOTALL)


def _field_in_message(loc: tuple[int | str, ...], message: str, kind: str,
                      model: type[BaseModel] | None) -> tuple[tuple[int | str, ...], str]:
    """A mapping's check that names the field it is about (``data.files: ...`` from ``job``'s
    validator) has that field put into the path: ``job.data.files: ...``, where it read
    ``job: data.files: ...``. Only a first part that is a field of the mapping moves."""
    match = _FIELD_PREFIX.fullmatch(message)
    parent = _model_at(model, loc) if model is not None and kind == "value_error" else None
    if match is None or parent is None:
        return loc, message
    parts: list[int | str] = []
    for name in match.group(1).split("."):  # coef[1] -> coef, 1
        key, _, index = name.partition("[")
        parts += [key, int(index[:-1])] if index else [key]
    if parts[0] not in parent.model_fields:
        return loc, message
    return (*loc, *parts), match.group(2)


def problems_of(exc: ValidationError, root: str = "",
                model: type[BaseModel] | None = None) -> list[str]:
    """Every error of a pydantic ValidationError as ``path: message``."""
    return [f"{path}: {message}" for path, message in problem_pairs(exc, root, model)]


def parse(model: type[S], raw: Any, source: str, *, error: type[InputError] = InputError,
          root: str = "", context: dict[str, Any] | None = None) -> S:
    """Validate ``raw`` (plain data read from ``source``) against ``model``; raise ``error``.

    ``context`` is copied into the parse's scratch dict (validators read it, see
    :func:`scratch`), for example the directory relative paths are resolved against.
    """
    try:
        return model.model_validate(raw, context=dict(context or {}))
    except ValidationError as exc:
        raise error(source, problems_of(exc, root, model)) from None


# ----------------------------------------------------------------------------------------------
# Messages

def _message(err: Any, loc: tuple[int | str, ...], model: type[BaseModel] | None) -> str:
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    if kind == "extra_forbidden":
        parent = _model_at(model, loc[:-1]) if model is not None else None
        if parent is None:
            return "unknown key"
        hints: dict[str, str] = getattr(parent, "unknown_key_hints", {})
        if str(loc[-1]) in hints:
            return hints[str(loc[-1])]
        return f"unknown key (expected one of: {', '.join(parent.model_fields)})"
    if kind == "missing":
        return "required key is missing"
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return f"expected a mapping, got {_type_name(value)}"
    expected = _EXPECTED.get(kind)
    if expected is not None:
        return f"expected {expected}, got {_type_name(value)} {_short(value)}"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        bound = ctx.get("ge", ctx.get("gt", ctx.get("le", ctx.get("lt"))))
        if kind == "greater_than_equal" and bound == 0:
            return f"must not be negative, got {_short(value)}"
        if kind == "greater_than" and bound == 0:
            return f"must be positive, got {_short(value)}"
        sign = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=",
                "less_than": "<"}[kind]
        return f"must be {sign} {bound:,}, got {_short(value)}"
    if kind == "too_short" and ctx.get("min_length") == 1:
        return "expected a non-empty list"
    if kind in ("literal_error", "enum") and "expected" in ctx:
        # pydantic's "Input should be 'auto', 'loopback' or 'mininet' (got 'loopbak')", beside
        # the other problems' "expected ..., got ..."
        return f"expected {ctx['expected']}, got {_short(value)}"
    message = str(err["msg"])
    if message.startswith("Value error, "):
        return message[len("Value error, "):]
    if "input" in err and kind != "value_error":
        message += f" (got {_short(value)})"
    return message


_EXPECTED = {
    "int_type": "int", "int_parsing": "int", "int_from_float": "int",
    "float_type": "float", "float_parsing": "float",
    "bool_type": "true or false", "bool_parsing": "true or false",
    "string_type": "str", "list_type": "a list", "tuple_type": "a list",
}


def _type_name(value: Any) -> str:
    return {dict: "mapping", list: "list", str: "str", int: "int", float: "float",
            bool: "bool", type(None): "null"}.get(type(value), type(value).__name__)


def _is_user_key(part: str) -> bool:
    return not (part.endswith("]") or "[" in part or part in ("str", "int", "float", "bool",
                                                             "list", "dict", "none"))


_REPR = reprlib.Repr()  # keyword arguments only from Python 3.12
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 8, 8, 56, 56
MAX_MESSAGE_CHARS = 400  # one problem's line: a validator's message may quote a whole value


def _short(value: Any, limit: int = 60) -> str:
    text = _REPR.repr(value)  # bounded however large the value (a list of 10^5 items)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _clipped(message: str) -> str:
    return message if len(message) <= MAX_MESSAGE_CHARS else \
        message[:MAX_MESSAGE_CHARS - 3] + "..."


def _unknown_keys_first(errors: list[Any], locs: list[tuple[int | str, ...]]) -> list[int]:
    """Indices of ``errors`` with each mapping's unknown keys moved before its other problems.

    pydantic reports a model's fields depth first and its unknown keys after them; moving each
    unknown key to just before the first problem under the same mapping gives the order a reader
    scanning the file expects (and the order our checkers always had).
    """
    order: list[int] = []
    for i, err in enumerate(errors):
        if err["type"] != "extra_forbidden":
            order.append(i)
            continue
        parent = locs[i][:-1]
        at = next((k for k, j in enumerate(order)
                   if locs[j][:len(parent)] == parent
                   and not (errors[j]["type"] == "extra_forbidden" and locs[j][:-1] == parent)),
                  len(order))
        order.insert(at, i)
    return order


def _model_at(model: Any, loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The model class that describes the mapping at ``loc`` (None when unknown)."""
    current: list[Any] = [model]
    for part in loc:
        following: list[Any] = []
        for tp in _flatten(current):
            if isinstance(part, int):
                if typing.get_origin(tp) in (list, tuple):
                    following.extend(typing.get_args(tp)[:1])
            elif isinstance(tp, type) and issubclass(tp, BaseModel):
                field = tp.model_fields.get(part)
                if field is not None:
                    following.append(field.annotation)
            elif typing.get_origin(tp) is dict:
                following.extend(typing.get_args(tp)[1:2])
        current = following
    for tp in _flatten(current):
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            return tp
    return None


def _flatten(tps: list[Any]) -> list[Any]:
    """Unwrap Annotated, Optional and unions into the plain types they may hold."""
    out: list[Any] = []
    for tp in tps:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            out.extend(_flatten([typing.get_args(tp)[0]]))
        elif origin is Union or isinstance(tp, types.UnionType):
            out.extend(_flatten(list(typing.get_args(tp))))
        else:
            out.append(tp)
    return out

