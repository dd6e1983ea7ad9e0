"""Models the run brings itself: any transformers causal LM (`kind = "hf"`) or a custom factory (`"custom"`).

Owns `build_external_model` (called by `model.gpt.build_model` for these kinds), the `HFCausalLM`
wrapper, `weights_digest` (the checksum of initial weights a manifest may pin) and the checks that
make a missing file, or a `[model.config]` key a custom factory does not take, a `ConfigError` naming it.

An `hf` model is built from its `[model.config]` (seeded random weights) or, with ``pretrained``, loaded
with `from_pretrained` from a local folder or the local Hugging Face cache (model/hub.py: offline unless
``HF_HUB_OFFLINE=0``); the bytes of that folder's config.json then count in `weights_digest`. Every
dropout probability of an hf config (``attn_pdrop``, ``attention_dropout``, ...) is set to
``[model] dropout`` unless the `[model.config]` table sets that key itself: transformers' own defaults
(GPT-2's 0.1) never apply silently.

Both kinds are built on CPU in float32 inside `torch.random.fork_rng` seeded with `model.seed`, so
their random initializers see the same generator state on every peer and the global RNG is left
untouched: initial weights are bit-identical for the same torch version. `init` then overwrites them
with local weights. A manifest's `weights_digest` is checked against the result; a peer with another
torch build or another weights file is refused with both digests in the message.

The custom factory contract: ``factory = "package.module:function"`` names a function called as
``function(**config)`` with the ``[model.config]`` table as keyword arguments (no arguments without
one). It must return a `torch.nn.Module` with float32 parameters whose
``forward(idx, targets)`` takes int64 token ids of shape (batch, block_size) and returns
``(logits, loss)``: logits (batch, block_size, vocab) and the mean next-token cross-entropy against
`targets` (None when `targets` is None). Token and position embeddings should be `nn.Embedding`
modules: the synchronizer merges their parameters by plain weighted mean (`embedding_parameter_names`).
The factory's signature is checked against the table before it is called (`bind_factory`); its model's
forward is probed once before a peer joins and by ``model-digest`` (`model.contract`).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import inspect
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from p2p_diloco.config import ModelConfig, ModelKind
from p2p_diloco.errors import ConfigError
from p2p_diloco.model.hf_check import check_hf_config
from p2p_diloco.model.hub import local_folder

HF_PREFIX = "hf."  # parameter names of an `HFCausalLM` are the transformers names behind this prefix


class HFCausalLM(nn.Module):
    """A transformers causal LM with the project's forward: `model(x, y) -> (logits, loss)`.

    `y` is already shifted (the next token of each position), so the loss is a plain cross-entropy;
    transformers' own `labels=` path would shift a second time.
    """

    def __init__(self, hf_model: nn.Module, source_config: bytes = b""):
        super().__init__()
        self.hf = hf_model
        self.source_config = source_config  # a pretrained folder's config.json (part of the digest)

    @property
    def config(self) -> Any:
        return self.hf.config

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        logits = self.hf(input_ids=idx, use_cache=False).logits
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss

    def enable_activation_checkpointing(self) -> None:
        """Recompute each decoder layer's activations in backward (transformers' gradient checkpointing)."""
        kwargs = {"use_reentrant": False}
        if hasattr(self.hf, "activation_checkpointing_enable"):  # transformers >= 5.x
            self.hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def pretrained_folder(cfg: ModelConfig) -> Path:
    """The local folder of `cfg.pretrained`: the folder it names, or its snapshot in the Hub cache."""
    return local_folder(
        cfg.pretrained,
        cfg.path(cfg.pretrained),
        what="model.pretrained",
        fetch_hint="HF_HUB_OFFLINE=0 p2p-diloco model-digest RUN.toml",
    )


def dropout_keys(config: Any) -> list[str]:
    """The config's dropout probabilities: numeric keys named ``*dropout*`` or ``*pdrop``."""
    return sorted(
        key
        for key, value in config.to_dict().items()
        if ("dropout" in key or key.endswith("pdrop"))
        and isinstance(value, int | float)
        and not isinstance(value, bool)
    )


def _table_config(cfg: ModelConfig) -> Any:
    from transformers import AutoConfig

    raw = dict(cfg.resolved_config)
    model_type = raw.pop("model_type", None)
    if not model_type:
        raise ConfigError(
            'model.config needs model_type (e.g. "llama", "gpt2", "qwen2") to pick the transformers class'
        )
    check_model_type(model_type)
    try:
        config = AutoConfig.for_model(model_type, **raw)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"model.config: transformers refused it: {exc}") from exc
    except Exception as exc:  # huggingface_hub's strict dataclass checks: a value of the wrong type
        raise ConfigError(typed_value_message(raw, exc)) from exc
    check_hf_config(cfg.resolved_config, config)  # unknown keys, heads that do not fit (model/hf_check.py)
    check_token_ids(cfg.resolved_config, config)
    return config


def check_model_type(model_type: str) -> None:
    """`ConfigError` naming the few closest known types when transformers has no `model_type`."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    known = list(CONFIG_MAPPING.keys())
    if model_type in known:
        return
    close = difflib.get_close_matches(str(model_type), known, n=5, cutoff=0.5)
    hint = f"the closest: {', '.join(close)}" if close else 'e.g. "llama", "gpt2", "qwen2", "mistral"'
    raise ConfigError(
        f"model.config.model_type = {model_type!r} is not a model type of this transformers; {hint}"
    )


def typed_value_message(raw: Mapping[str, Any], exc: Exception) -> str:
    """A strict config field's refusal (huggingface_hub's `StrictDataclassFieldValidationError`, which
    names the field) as the `[model.config]` key, its value and the fix."""
    match = re.search(r"field '(\w+)'", str(exc))
    key = match.group(1) if match else None
    detail = str(exc).strip().splitlines()[-1].strip()
    if key is None or key not in raw:
        return f"model.config: transformers refused it: {detail}"
    return f"model.config.{key} = {raw[key]!r} has the wrong type ({detail}): write a whole number such as 2"


def check_token_ids(table: Mapping[str, Any], config: Any) -> None:
    """`ConfigError` when the padding token is outside the vocabulary (transformers' embedding asserts on
    it: Phi-3's default pad_token_id 32000 with a 4096-token vocabulary)."""
    vocab = getattr(config, "vocab_size", None)
    pad = getattr(config, "pad_token_id", None)
    if not isinstance(vocab, int) or not isinstance(pad, int) or 0 <= pad < vocab:
        return
    source = "set in [model.config]" if "pad_token_id" in table else f"the {config.model_type} default"
    raise ConfigError(
        f"model.config.pad_token_id = {pad} ({source}) is outside the vocabulary of vocab_size = {vocab}: "
        f"set pad_token_id under [model.config] to a token id below {vocab} (e.g. 0), or raise vocab_size"
    )


def _pretrained_config(folder: Path) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"model.pretrained folder {folder} has no usable config.json ({exc})") from exc


def hf_config(cfg: ModelConfig, folder: Path | None = None) -> Any:
    """The transformers `PretrainedConfig` of `cfg`: its `[model.config]` table (needs its `model_type`) or
    the config.json of its pretrained folder (`folder`, resolved when None), with `[model] dropout`."""
    if cfg.pretrained:
        config = _pretrained_config(folder or pretrained_folder(cfg))
    else:
        config = _table_config(cfg)
    for key in dropout_keys(config):
        if key not in cfg.resolved_config:
            setattr(config, key, cfg.dropout)
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions is not None and max_positions < cfg.block_size:
        raise ConfigError(
            f"model.block_size {cfg.block_size} exceeds the config's max_position_embeddings {max_positions}"
        )
    return config


def _build_hf(cfg: ModelConfig) -> nn.Module:
    from transformers import AutoModelForCausalLM

    if not cfg.pretrained:
        config = hf_config(cfg)  # its ConfigError says what is wrong by itself
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        except (ValueError, TypeError, AssertionError) as exc:
            raise ConfigError(f"model.config: transformers cannot build a causal LM from it: {exc}") from exc
        return HFCausalLM(model)
    folder = pretrained_folder(cfg)
    config = hf_config(cfg, folder)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), config=config, dtype=torch.float32, local_files_only=True
        )
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(
            f"model.pretrained {cfg.pretrained!r}: transformers cannot load a causal LM from {folder} ({exc})"
        ) from exc
    return HFCausalLM(model, source_config=(folder / "config.json").read_bytes())


_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def bind_factory(factory: str, func: Callable[..., Any], config: Mapping[str, Any]) -> None:
    """`ConfigError` unless `func(**config)` fits `func`'s signature, naming the `[model.config]` key to
    rename, remove or add (a function without a readable signature is not checked)."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(**config)
    except TypeError as exc:
        params = signature.parameters
        keywords = [name for name, param in params.items() if param.kind in _KEYWORD]
        takes_any = any(param.kind == inspect.Parameter.VAR_KEYWORD for param in params.values())
        unknown = [] if takes_any else [key for key in config if key not in keywords]
        missing = [
            name
            for name in keywords
            if params[name].default is inspect.Parameter.empty and name not in config
        ]
        if unknown:
            raise ConfigError(
                f"model.factory {factory!r} takes no keyword {unknown[0]!r} (it takes: "
                f"{', '.join(keywords) or 'none'}): rename {unknown[0]!r} "
                "under [model.config] to the keyword the factory means, or remove it"
            ) from exc
        if missing:
            raise ConfigError(
                f"model.factory {factory!r} needs the keyword {missing[0]!r}, which [model.config] does not "
                f"set: add {missing[0]} = ... under [model.config]"
            ) from exc
        raise ConfigError(
            f"model.factory {factory!r} cannot be called as {func.__name__}(**[model.config]) ({exc}): give "
            "it keyword parameters matching the [model.config] keys"
        ) from exc


def _build_custom(cfg: ModelConfig) -> nn.Module:
    module_name, _, func_name = cfg.factory.partition(":")
    try:
        func = getattr(importlib.import_module(module_name), func_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"model.factory {cfg.factory!r} cannot be imported ({exc}); install the package that holds it "
            "or put it on PYTHONPATH"
        ) from exc
    bind_factory(cfg.factory, func, cfg.resolved_config)
    model = func(**cfg.resolved_config)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.factory {cfg.factory!r} returned {type(model).__name__}, not an nn.Module")
    return model


def _weight_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.init folder {path} holds no *.safetensors files")
    return files


def load_init_weights(model: nn.Module, cfg: ModelConfig) -> None:
    """Overwrite `model`'s parameters with the tensors of `cfg.init` (names with or without the wrapper's
    prefix); every parameter must be found with its shape."""
    from safetensors.torch import load_file

    path = cfg.path(cfg.init)
    if not path.exists():
        raise ConfigError(
            f"model.init {path} does not exist; copy the run's initial weights there or fix model.init "
            "(relative paths start at the manifest's folder)"
        )
    tensors: dict[str, Tensor] = {}
    for file in _weight_files(path):
        try:
            tensors.update(load_file(str(file)))
        except Exception as exc:  # safetensors raises its own error types
            raise ConfigError(f"model.init file {file} is not a readable safetensors file ({exc})") from exc
    prefixed = isinstance(model, HFCausalLM)
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = tensors.get(name)
            if value is None and prefixed:
                value = tensors.get(name.removeprefix(HF_PREFIX))
            if value is None:
                raise ConfigError(f"model.init {path} lacks parameter {name!r}: it holds another model")
            if tuple(value.shape) != tuple(param.shape):
                raise ConfigError(
                    f"model.init {path}: {name} has shape {tuple(value.shape)}, the model expects "
                    f"{tuple(param.shape)}"
                )
            param.copy_(value.to(torch.float32))


def weights_digest(model: nn.Module) -> str:
    """16 hex digits over every parameter's name, shape and float32 bytes, in `named_parameters()` order
    (and a pretrained model's config.json bytes)."""
    h = hashlib.blake2b(digest_size=8)
    if isinstance(model, HFCausalLM) and model.source_config:
        h.update(b"config.json:" + model.source_config)
    for name, param in model.named_parameters():
        h.update(f"{name}:{tuple(param.shape)};".encode())
        h.update(param.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def build_external_model(cfg: ModelConfig) -> nn.Module:
    """An `hf` or `custom` model on CPU in float32, identical on every peer (module docstring)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = _build_hf(cfg) if cfg.kind == ModelKind.HF else _build_custom(cfg)
    model = model.to(torch.float32)
    if cfg.init:
        load_init_weights(model, cfg)
    if cfg.weights_digest:
        check_weights_digest(model, cfg.weights_digest)
    return model


def check_weights_digest(model: nn.Module, expected: str) -> None:
    """`ConfigError` unless `model`'s initial weights have the digest the manifest pins."""
    found = weights_digest(model)
    if found != expected:
        raise ConfigError(
            f"the initial weights built here have digest {found}, the run's manifest says {expected}: "
            "use the run's torch/transformers versions and model.init file (or model.pretrained folder)"
        )


def build_skeleton(cfg: ModelConfig) -> nn.Module:
    """The model of `cfg` on the meta device: names and shapes only, nothing initialized or loaded."""
    with torch.device("meta"):
        if cfg.kind == ModelKind.HF and cfg.pretrained:  # the pretrained folder's config, no weights read
            from transformers import AutoModelForCausalLM

            return HFCausalLM(AutoModelForCausalLM.from_config(hf_config(cfg), dtype=torch.float32))
        return _build_hf(cfg) if cfg.kind == ModelKind.HF else _build_custom(cfg)


def embedding_names(model: nn.Module) -> set[str]:
    """Parameters of every `nn.Embedding` module (token and learned position embeddings), generically."""
    names = set()
    for module_name, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            names.add(f"{module_name}.weight" if module_name else "weight")
    params = {name for name, _ in model.named_parameters()}
    return names & params
