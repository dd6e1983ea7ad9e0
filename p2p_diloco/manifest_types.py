"""Reading a manifest's sections: unknown keys and values of the wrong type refused with their key path.

`sections_from_dict` turns the TOML tables of a manifest into the keyword arguments of each section's
frozen dataclass (`config.RunManifest.from_dict` calls it). Before a dataclass runs its own range checks,
every value is checked against the field's annotation by pydantic in strict mode, so
``block_size = "128"`` is refused as ``[model] block_size = '128' (a string): must be an integer; write
block_size = 128 under [model], without quotes`` instead of failing deep inside a comparison (one line per
key of the wrong type; the range checks that follow are the sections' own, `schema.section`). Strict means no
silent conversion: a string is never taken for a number (the manifest hash would then depend on the spelling).
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
from p2p_diloco.schema import Number, describe, key_path, toml_type

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


def _unquoted(value: Any, annotation: Any) -> str | None:
    """`value` written without quotes, when it is a string that spells a valid value of `annotation`."""
    if not isinstance(value, str):
        return None
    text = value.strip()
    if annotation is bool and text.lower() in ("true", "false"):
        return text.lower()
    kind = float if annotation == Number else annotation
    if kind not in (int, float):
        return None
    try:
        kind(text)
    except ValueError:
        return None
    return text


def _message(section: str, fields: dict[str, Any], values: dict[str, Any], error: Any) -> str:
    key = str(error["loc"][0])
    annotation = fields.get(key)
    value = values.get(key)
    shown = list(value) if isinstance(value, tuple) else value
    place = f"under [{section}]" if section else "at the top"
    text = f"{key_path(section, key)} = {shown!r} ({toml_type(value)}): must be {describe(annotation)}"
    unquoted = _unquoted(value, annotation)
    if unquoted is not None:
        return f"{text}; write {key} = {unquoted} {place}, without quotes"
    if isinstance(value, str) and typing.get_origin(annotation) is tuple:
        return f"{text}; write {key} = [{value!r}] {place}"
    if annotation is str and isinstance(value, int | float):
        return f'{text}; write {key} = "{value}" {place}'

    return f"{text}; fix {key} {place}"


def check_types(section: str, klass: type, values: dict[str, Any], *, where: str = "manifest") -> None:
    """`ConfigError` with one line per key of `values` (a `[section]` of `klass`) whose type is wrong."""
    model, fields = _shape(klass)
    try:
        model.model_validate(values, strict=True)
    except pydantic.ValidationError as exc:
        lines = dict.fromkeys(_message(section, fields, values, e) for e in exc.errors())
        raise ConfigError("\n".join(f"{where}: {line}" for line in lines)) from None


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
    """`klass(**values)`; its own checks raise `ConfigError` with the key path, each line prefixed by
    `where`."""
    try:
        return klass(**values)
    except ConfigError as exc:
        raise ConfigError("\n".join(f"{where}: {line}" for line in str(exc).splitlines())) from None
    except TypeError as exc:
        raise ConfigError(f"{where}: [{name}]: {exc}") from exc
