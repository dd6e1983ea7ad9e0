"""Reading a manifest's sections: unknown keys and values of the wrong type refused with their key path.

`sections_from_dict` turns the TOML tables of a manifest into the keyword arguments of each section's
frozen dataclass (`config.RunManifest.from_dict` calls it). Before a dataclass runs its own range checks,
every value is checked against the field's annotation by pydantic in strict mode, so
``block_size = "128"`` is refused as ``model.block_size must be an integer, got '128' (a string): write
block_size = 128, without quotes`` instead of failing deep inside a comparison. Strict means no silent
conversion: a string is never taken for a number (the manifest hash would then depend on the spelling).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from enum import Enum
from typing import Any, Literal

import pydantic

from p2p_diloco.errors import ConfigError

HIDDEN_FIELDS = ("base_dir", "resolved_config")  # set by the loader, never written in a manifest


def _widen(annotation: Any) -> Any:
    """The annotation as TOML values must match it: an enum field takes the plain string of a member."""
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return Literal[tuple(m.value for m in annotation)]  # type: ignore[misc]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return typing.Union[tuple(_widen(a) for a in typing.get_args(annotation))]  # noqa: UP007
    return annotation


@functools.cache
def _shape(klass: type) -> tuple[type[pydantic.BaseModel], dict[str, Any]]:
    """A pydantic model of `klass`'s manifest keys (a key left out is not checked: its default holds)."""
    hints = typing.get_type_hints(klass)
    names = [f.name for f in dataclasses.fields(klass) if f.name not in HIDDEN_FIELDS and f.init]
    fields = {name: _widen(hints[name]) for name in names}
    model = pydantic.create_model(  # type: ignore[call-overload]
        f"{klass.__name__}Values",
        __config__=pydantic.ConfigDict(strict=True, arbitrary_types_allowed=True),
        **{name: (annotation, None) for name, annotation in fields.items()},
    )
    return model, fields


def describe(annotation: Any) -> str:
    """What a value of `annotation` looks like in TOML, for messages."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(annotation) if a is not type(None))
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


def _unquoted(value: Any, annotation: Any) -> str | None:
    """`value` written without quotes, when it is a string that spells a valid value of `annotation`."""
    if not isinstance(value, str):
        return None
    text = value.strip()
    if annotation is bool and text.lower() in ("true", "false"):
        return text.lower()
    for kind in (int, float):
        if annotation is kind or (kind is float and annotation is float):
            try:
                kind(text)
            except ValueError:
                return None
            return text
    return None


def _message(where: str, section: str, fields: dict[str, Any], values: dict[str, Any], error: Any) -> str:
    key = str(error["loc"][0])
    annotation = fields.get(key)
    value = values.get(key)
    shown = list(value) if isinstance(value, tuple) else value
    text = f"{where}: {section}.{key} must be {describe(annotation)}, got {shown!r} ({toml_type(value)})"
    unquoted = _unquoted(value, annotation)
    if unquoted is not None:
        return f"{text}: write {key} = {unquoted} under [{section}], without quotes"
    if isinstance(value, str) and typing.get_origin(annotation) is tuple:
        return f"{text}: write {key} = [{value!r}] under [{section}]"
    return f"{text}: fix {key} under [{section}]"


def check_types(section: str, klass: type, values: dict[str, Any], *, where: str = "manifest") -> None:
    """`ConfigError` naming the first key of `values` (a `[section]` of `klass`) whose type is wrong."""
    model, fields = _shape(klass)
    try:
        model.model_validate(values, strict=True)
    except pydantic.ValidationError as exc:
        raise ConfigError(_message(where, section, fields, values, exc.errors()[0])) from None


def section_values(
    name: str, klass: type, section: Any, *, where: str, base_dir: str | None = None
) -> dict[str, Any]:
    """The keyword arguments of `klass` from the TOML table `[name]`, checked for unknown keys and types."""
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: [{name}] must be a table, got {section!r} ({toml_type(section)})")
    fields = {f.name for f in dataclasses.fields(klass) if f.name not in HIDDEN_FIELDS}
    bad = sorted(set(section) - fields)
    if bad:
        raise ConfigError(f"{where}: unknown keys in [{name}]: {bad}; valid keys are {sorted(fields)}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in section.items()}
    check_types(name, klass, values, where=where)
    if base_dir is not None:
        values["base_dir"] = base_dir
    return values


def build_section(name: str, klass: type, values: dict[str, Any], *, where: str) -> Any:
    """`klass(**values)`; its own checks raise `ConfigError` with the key's name, prefixed by `where`."""
    try:
        return klass(**values)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except TypeError as exc:
        raise ConfigError(f"{where}: [{name}]: {exc}") from exc
