"""Checks of a `[model.config]` table against its transformers config class, before any model is built.

transformers keeps every keyword a config class does not know as a plain attribute, so a typo such as
``n_layers = 2`` for GPT-2 (whose key is ``n_layer``) is accepted and silently trains the default depth.
`check_hf_config` refuses such keys naming the closest valid one, and checks that the attention heads
divide the hidden size (and the key/value heads the heads) unless the table sets ``head_dim`` itself.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from typing import Any

from p2p_diloco.errors import ConfigError


def known_keys(config_class: type) -> set[str]:
    """Every key `config_class` (a transformers `PretrainedConfig`) reads: its fields and constructor
    parameters through its class hierarchy, and the aliases of its `attribute_map`."""
    keys: set[str] = {"model_type"}
    for klass in config_class.__mro__:
        keys |= set(getattr(klass, "__dataclass_fields__", {}))
        init = klass.__dict__.get("__init__")
        if init is not None:
            try:
                parameters = inspect.signature(init).parameters.values()
            except (TypeError, ValueError):
                continue
            keys |= {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    keys |= set(getattr(config_class, "attribute_map", {}) or {})
    keys.discard("self")
    return {k for k in keys if not k.startswith("_")}


def own_keys(config_class: type) -> list[str]:
    """The keys `config_class` adds to transformers' common ones (what a message lists)."""
    common = set()
    for klass in config_class.__mro__[1:]:
        common |= set(getattr(klass, "__dataclass_fields__", {}))
    own = set(getattr(config_class, "__dataclass_fields__", {})) - common
    return sorted(own | set(getattr(config_class, "attribute_map", {}) or {}))


def unknown_keys(raw: Mapping[str, Any], config: Any) -> list[str]:
    """Keys of `raw` that `config` (built from it) neither declares nor consumed: transformers stored them
    as extra attributes and nothing reads them. Legacy keys a class converts (``rope_theta`` into
    ``rope_parameters``) are consumed, so they pass."""
    known = known_keys(type(config))
    stored = config.to_dict()
    return sorted(k for k in raw if k not in known and k in stored and stored[k] == raw[k])


def check_heads(raw: Mapping[str, Any], config: Any) -> None:
    """`ConfigError` unless the heads divide the hidden size and the key/value heads divide the heads."""
    hidden = getattr(config, "hidden_size", None)
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(hidden, int) or not isinstance(heads, int):
        return
    names = dict(getattr(config, "attribute_map", {}) or {})
    hidden_key = names.get("hidden_size", "hidden_size")
    heads_key = names.get("num_attention_heads", "num_attention_heads")
    if heads < 1:
        raise ConfigError(f"model.config.{heads_key} must be >= 1, got {heads}")
    if "head_dim" not in raw and hidden % heads:
        fits = [h for h in range(1, min(hidden, 64) + 1) if hidden % h == 0]
        raise ConfigError(
            f"model.config.{hidden_key} ({hidden}) must be a multiple of model.config.{heads_key} ({heads}): "
            f"each head gets {hidden_key} / {heads_key} dimensions; use {heads_key} in {fits[-6:]} or a "
            f"{hidden_key} such as {(hidden // heads + 1) * heads}"
        )
    kv = getattr(config, "num_key_value_heads", None)
    if isinstance(kv, int) and (kv < 1 or heads % kv):
        raise ConfigError(
            f"model.config.num_key_value_heads ({kv}) must divide model.config.{heads_key} ({heads}) "
            "(grouped-query attention shares each key/value head among heads / kv heads)"
        )


def check_hf_config(raw: Mapping[str, Any], config: Any) -> None:
    """`ConfigError` for a `[model.config]` table `raw` whose transformers config `config` (built from it)
    ignores some of its keys or whose attention heads do not fit the hidden size."""
    unknown = unknown_keys(raw, config)
    if unknown:
        known = sorted(known_keys(type(config)))
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, known, n=1)
            hints.append(f"{key} (did you mean {close[0]}?)" if close else key)
        raise ConfigError(
            f"model.config: {type(config).__name__} (model_type = {raw.get('model_type')!r}) has no "
            f"key {', '.join(hints)}; transformers would ignore it and build its default instead. "
            f"Fix or remove it; its own keys are {own_keys(type(config))}"
        )
    check_heads(raw, config)
