"""Frozen config sections validated by pydantic, and pydantic's errors as lines a user can act on.

`section("diloco")` makes a class a frozen pydantic dataclass (still a `dataclasses` dataclass, so
`dataclasses.replace`, `asdict` and `fields` work) whose constructor raises `ConfigError`, never pydantic's
`ValidationError`: one line per problem, naming the key path (``[diloco] inner_steps``), the value given,
what is allowed and the fix. Limits on one key are `Field` constraints on its annotation
(``Annotated[int, Field(ge=1)]``; `description` says what the key is); rules across keys are
`model_validator`s that raise `Rule(key, value, text)`.

`Number` (``int | float``) is a float key that keeps an integer as written: pydantic's ``float`` would turn
``outer_lr = 1`` into ``1.0`` and change the manifest hash of existing runs.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import annotated_types
import pydantic

from p2p_diloco.errors import ConfigError

T = TypeVar("T")

Number = int | float
# Values are strict, as in a manifest: "0.1" is no number and true no 1. A choice takes its plain string
# (``codec="topk-int8"``) and a list of names a list or a tuple: annotate those `Annotated[..., LAX]`.
LAX = pydantic.Strict(False)

CONFIG = pydantic.ConfigDict(arbitrary_types_allowed=True, strict=True)


class Rule(ValueError):
    """A rule across keys broken: `key` is the key to change, `text` what is wrong and the fix."""

    def __init__(self, key: str, value: Any, text: str):
        super().__init__(text)
        self.key, self.value, self.text = key, value, text


@typing.dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, pydantic.Field))
def section(name: str) -> Callable[[type[T]], type[T]]:
    """Class decorator: a frozen pydantic dataclass for the manifest table ``[name]``."""

    def wrap(cls: type[T]) -> type[T]:
        built: Any = pydantic.dataclasses.dataclass(frozen=True, config=CONFIG)(cls)
        init = built.__init__

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            try:
                init(self, *args, **kwargs)
            except pydantic.ValidationError as exc:
                raise ConfigError(explain(built, name, exc)) from None

        built.__init__ = __init__
        built.SECTION = name
        return typing.cast(type[T], built)

    return wrap


def explain(klass: type, name: str, exc: pydantic.ValidationError) -> str:
    """One line per problem in `exc`, raised validating `klass` (the table ``[name]``): the errors of one
    key (the members of a union it failed) are one line saying what the key takes."""
    by_key: dict[tuple[str, str], list[Any]] = {}
    for error in exc.errors():
        table, key, _, _ = _field(klass, tuple(error["loc"]))
        by_key.setdefault((table, key) if key else (table, str(len(by_key))), []).append(error)
    return "\n".join(
        dict.fromkeys(_line(klass, e[0]) if len(e) == 1 else _union_line(klass, e) for e in by_key.values())
    )


def _union_line(klass: type, errors: list[Any]) -> str:
    table, key, info, annotation = _field(klass, tuple(errors[0]["loc"]))
    value = errors[0].get("input")
    described = info.description if info is not None and info.description else ""
    if all(e["type"].endswith(TYPE_ERRORS) for e in errors) or not described:
        what = describe(annotation) + (f" ({described})" if described else "")
    else:
        what = described
    place = f"under [{table}]" if table else "at the top"
    return f"{key_path(table, key)} = {toml(value)} ({toml_type(value)}): must be {what}; fix {key} {place}"


def key_path(name: str, key: str) -> str:
    """``[diloco] inner_steps``; a top-level key (`name` empty) is just its name."""
    return f"[{name}] {key}" if name else key


def _field(klass: type, loc: tuple[Any, ...]) -> tuple[str, str, Any, Any]:
    """(its table's name, the key, the pydantic FieldInfo with its limits, its annotation) where `loc` points:
    nested sections followed (a `RunManifest` given a table for `diloco`), the members of a union
    (``density.float``) skipped."""
    name, key, info = getattr(klass, "SECTION", ""), "", None
    for part in loc:
        found = getattr(klass, "__pydantic_fields__", {}).get(str(part))
        if found is None:
            continue
        key, info = str(part), found
        inner = found.annotation
        if isinstance(inner, type) and dataclasses.is_dataclass(inner):
            klass, name, key, info = inner, getattr(inner, "SECTION", key), "", None
    annotation = getattr(info, "annotation", None)
    if info is not None and not info.metadata:  # `Annotated[Number, Field(...)] | None`: the inner Field
        for arg in typing.get_args(info.annotation):
            inner_info = [m for m in typing.get_args(arg)[1:] if isinstance(m, pydantic.fields.FieldInfo)]
            if typing.get_origin(arg) is typing.Annotated and inner_info:
                info = inner_info[0]
    return name, key, info, annotation


def allowed(info: Any) -> str:
    """What a key's `Field` constraints allow, as a reader writes it: ``in (0, 1]``, ``>= 1``."""
    if info is None:
        return ""
    low = high = ""
    extra = []
    for m in info.metadata:
        if isinstance(m, annotated_types.Ge):
            low = f"[{m.ge}"
        elif isinstance(m, annotated_types.Gt):
            low = f"({m.gt}"
        elif isinstance(m, annotated_types.Le):
            high = f"{m.le}]"
        elif isinstance(m, annotated_types.Lt):
            high = f"{m.lt})"
        elif isinstance(m, annotated_types.MultipleOf):
            extra.append(f"a multiple of {m.multiple_of}")
    if low and high:
        text = f"in {low}, {high}"
    elif low:
        text = (">= " if low[0] == "[" else "> ") + low[1:]
    elif high:
        text = ("<= " if high[-1] == "]" else "< ") + high[:-1]
    else:
        text = ""
    return " and ".join([t for t in (text, *extra) if t])


def describe(annotation: Any) -> str:
    """What a value of `annotation` looks like in TOML, for messages."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return describe(typing.get_args(annotation)[0])
    if origin is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        kinds = [describe(a) for a in typing.get_args(annotation) if a is not type(None)]
        if kinds[:2] == ["an integer", "a number"]:  # `schema.Number`: a float that keeps integers
            kinds = kinds[1:]
        return " or ".join(kinds)
    if origin is tuple:
        args = typing.get_args(annotation)
        return f"a list of {describe(args[0]).removeprefix('a ').removeprefix('an ')}s" if args else "a list"
    if origin is dict or annotation is dict:
        return "a table"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        annotation, getattr(annotation, "__name__", str(annotation))
    )


def toml_type(value: Any) -> str:
    """The TOML kind of a parsed value: 'a string', 'an integer', ..."""
    for kind, name in (
        (bool, "a boolean"),
        (int, "an integer"),
        (float, "a number"),
        (str, "a string"),
        (tuple, "a list"),
        (list, "a list"),
        (dict, "a table"),
    ):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def toml(value: Any) -> str:
    """`value` as a manifest spells it: ``true``, ``'carry'``, ``0.5``."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        value = list(value)
    return repr(value)


TYPE_ERRORS = ("_type", "_parsing", "_instance_of")


LIMITS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "multiple_of")


def _line(klass: type, error: Any) -> str:
    table, key, info, annotation = _field(klass, tuple(error["loc"]))
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, Rule):
        return f"{key_path(table, cause.key)} = {toml(cause.value)}: {cause.text}"
    if isinstance(cause, ConfigError):  # a check that reads files (a model's config.json) says it all
        return str(cause)
    value = error.get("input")
    if not key:
        return f"[{table}] = {toml(value)}: {error['msg']}; write it as a table [{table}]"
    path, place, kind = key_path(table, key), f"under [{table}]" if table else "at the top", error["type"]
    what = f" ({info.description})" if info is not None and info.description else ""
    limits = allowed(info)
    if kind == "missing":
        return f"{path} is missing: add {key} = ... {place}"
    if limits and kind in LIMITS:
        return f"{path} = {toml(value)}: must be {limits}{what}; set {key} {place} to a value {limits}"
    if kind.endswith(TYPE_ERRORS) and info is not None:
        return (
            f"{path} = {toml(value)} ({toml_type(value)}): must be {describe(annotation)}{what}; "
            f"fix {key} {place}"
        )
    if kind in ("literal_error", "enum"):
        return f"{path} = {toml(value)}: must be one of {error['ctx']['expected']}{what}; fix {key} {place}"
    if info is not None and info.description and kind in ("string_pattern_mismatch", "string_too_long"):
        return f"{path} = {toml(value)}: must be {info.description}; fix {key} {place}"
    text = str(cause) if cause is not None else error["msg"][0].lower() + error["msg"][1:]
    return f"{path} = {toml(value)}: {text}{what}; fix {key} {place}"
