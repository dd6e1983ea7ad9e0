"""What a run trains, on what text, and how one inner step runs: `ModelConfig`, `DataConfig`, `TrainConfig`.

Owns the manifest sections ``[model]``, ``[data]`` and ``[train]`` (re-exported by `p2p_diloco.config`).
Every section is a frozen pydantic dataclass (`schema.section`); a bad value raises `ConfigError` naming
the key path and the fix. Kinds are `StrEnum`s, so TOML strings compare and hash as the plain strings.

Relative paths in ``[model]`` and ``[data]`` resolve against `base_dir` (the manifest's folder, set by
`RunManifest.load`; not part of the manifest hash, so peers may keep the run's files anywhere), falling
back to the working directory (`resolve_path`). A model
``config = "config.json"`` is read at construction: its content, not its path, is hashed
(`resolved_config`), so two peers with different config files never mix.
"""

from __future__ import annotations

import json
from dataclasses import field
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, model_validator

from p2p_diloco.errors import ConfigError
from p2p_diloco.schema import LAX, Number, Rule, section


class Choice(StrEnum):
    """A manifest choice: compares, hashes, prints and reprs as its plain string, so a message shows
    ``'custom'`` as the manifest spells it, never ``<ModelKind.CUSTOM: 'custom'>``."""

    def __repr__(self) -> str:
        return repr(self.value)


def resolve_path(base_dir: str, path: str) -> Path:
    """`path` as written in a manifest: absolute, or relative to the manifest's folder `base_dir`, or,
    when nothing is there but the path exists from the working directory, relative to that (a manifest
    installed with the package names data its user prepared where they run it)."""
    p = Path(path).expanduser()
    if p.is_absolute() or not base_dir:
        return p
    beside = Path(base_dir) / p
    return beside if beside.exists() or not p.exists() else p


class ModelKind(Choice):
    GPT = "gpt"  # the built-in byte-level GPT (model/gpt.py)
    HF = "hf"  # any transformers causal LM built from a config (model/external.py)
    CUSTOM = "custom"  # `factory = "package.module:function"` returning an nn.Module


@section("model")
class ModelConfig:
    """The model. `gpt` uses n_layer..dropout; `hf` needs `config` or `pretrained`; `custom` needs `factory`.

    `block_size` is the training sequence length for every kind. `seed` seeds the initial weights (the
    same on every peer); `init` names local weights (a ``.safetensors`` file or a folder holding them)
    that replace the seeded ones; `weights_digest`, when set, must equal the checksum of the built
    initial weights (`p2p-diloco model-digest MANIFEST` prints it), so it becomes part of the run identity.
    `pretrained` (hf only, instead of `config`) starts from the weights and config.json of a local folder
    or of a Hub model ``"ORG/NAME"`` in the local cache (model/hub.py: never downloaded unless
    ``HF_HUB_OFFLINE=0``). `dropout` is every dropout probability of an hf model too (model/external.py).
    """

    kind: Annotated[ModelKind, LAX] = ModelKind.GPT
    n_layer: Annotated[int, Field(ge=1)] = 2
    n_head: Annotated[int, Field(ge=1)] = 2
    n_embd: Annotated[int, Field(ge=1)] = 64
    block_size: Annotated[int, Field(ge=2, description="the training sequence length")] = 64
    dropout: Annotated[Number, Field(ge=0, lt=1)] = 0.0
    seed: int = 0  # initial weights are identical on every peer
    config: dict[str, Any] | str | None = None  # hf: inline table or path to config.json; custom: kwargs
    init: str = ""  # hf/custom: local weights file or folder
    factory: str = ""  # custom: "package.module:function"
    pretrained: str = ""  # hf: a folder or a Hub name "ORG/NAME" whose config and weights start the run
    weights_digest: str = ""  # checksum of the initial weights (see `model.external.weights_digest`)
    base_dir: str = field(default="", compare=False)  # the manifest's folder; not hashed
    # the hashed content of `config`, computed at construction (a value passed in is replaced)
    resolved_config: dict[str, Any] = field(default_factory=dict, repr=False)

    @model_validator(mode="after")
    def _kind_rules(self) -> ModelConfig:
        object.__setattr__(self, "resolved_config", {})
        if self.kind == ModelKind.GPT:
            if self.n_embd % self.n_head:
                raise Rule("n_embd", self.n_embd, f"must be a multiple of n_head ({self.n_head})")
            for key in ("config", "init", "factory", "pretrained"):
                if getattr(self, key):
                    raise Rule(
                        key, getattr(self, key), "is for kind = 'hf' or 'custom'; remove it or set kind"
                    )
            return self
        if self.kind == ModelKind.HF:
            if self.factory:
                raise Rule("factory", self.factory, "is for kind = 'custom'; remove it")
            if (self.config is None) == (not self.pretrained):
                raise Rule(
                    "kind",
                    "hf",
                    "needs a transformers config (an inline [model.config] table with "
                    'model_type = "llama", ..., or config = "path/config.json") '
                    'or pretrained = "ORG/NAME" (or a '
                    "folder holding config.json and *.safetensors), not both: a pretrained model brings its "
                    "own config (its dropout comes from [model] dropout)",
                )
            if self.pretrained and self.init:
                raise Rule("init", self.init, "and pretrained both give the initial weights; keep one")
        else:
            if self.pretrained:
                raise Rule("pretrained", self.pretrained, "is for kind = 'hf'; remove it")
            module, _, func = self.factory.partition(":")
            if not (module and func.isidentifier()):
                raise Rule(
                    "factory", self.factory, "kind = 'custom' needs factory = \"package.module:function\""
                )
            if not (self.config is None or isinstance(self.config, dict)):
                raise Rule(
                    "config",
                    self.config,
                    "a custom model's config is the [model.config] table of keyword arguments",
                )
        object.__setattr__(self, "resolved_config", self._read_config())
        return self

    def _read_config(self) -> dict[str, Any]:
        if self.config is None:  # a custom factory without keyword arguments
            return {}
        if isinstance(self.config, dict):
            return dict(self.config)
        path = self.path(self.config)
        if not path.is_file():
            raise ConfigError(
                f"model.config file {path} does not exist; fix the path (relative to the manifest's folder) "
                "or inline the config as a [model.config] table"
            )
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"model.config file {path} is not readable JSON ({exc})") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"model.config file {path} must hold a JSON object")
        return raw

    def path(self, path: str) -> Path:
        """A path named in ``[model]``, resolved against the manifest's folder."""
        return resolve_path(self.base_dir, path)


class DataSource(Choice):
    BUILTIN = "builtin"  # Python's bundled pydoc text, as bytes
    FILES = "files"  # local text files, as bytes
    SHARDS = "shards"  # token shards written by `p2p-diloco data prepare` (model/shards.py)


@section("data")
class DataConfig:
    """Where training tokens come from.

    `builtin`/`files`: bytes of text, split into train and eval by `eval_fraction`. `shards`: the folder
    `shards` written by `p2p-diloco data prepare`, whose content digest must equal `digest` (printed by
    prepare); the eval split is the one prepare held out. `seed` is the run seed of every peer's stream.
    """

    source: Annotated[DataSource, LAX] = DataSource.BUILTIN
    paths: Annotated[tuple[str, ...], LAX] = ()
    eval_fraction: Annotated[Number, Field(gt=0, lt=0.5)] = 0.05
    seed: int = 0
    shards: str = ""  # folder holding index.json and the shard files
    digest: str = ""  # the dataset's content digest, as `p2p-diloco data prepare` printed it
    base_dir: str = field(default="", compare=False)  # the manifest's folder; not hashed

    @model_validator(mode="after")
    def _source_rules(self) -> DataConfig:
        if self.source == DataSource.FILES and not self.paths:
            raise Rule("paths", [], "source = 'files' needs paths = ['corpus.txt', ...]")
        if self.source == DataSource.SHARDS and not (self.shards and self.digest):
            raise Rule(
                "shards" if not self.shards else "digest",
                self.shards if not self.shards else self.digest,
                "source = 'shards' needs shards = 'folder written by p2p-diloco data prepare' and "
                "digest = '...' (the digest that command printed)",
            )
        if self.source != DataSource.SHARDS and (self.shards or self.digest):
            raise Rule(
                "shards" if self.shards else "digest",
                self.shards or self.digest,
                "data.shards and data.digest are for data.source = 'shards'; remove them or set source",
            )
        return self

    def path(self, path: str) -> Path:
        return resolve_path(self.base_dir, path)


class Precision(Choice):
    FP32 = "fp32"
    BF16 = "bf16"  # autocast to bfloat16 (weights and optimizer state stay fp32)
    FP16 = "fp16"  # autocast to float16 with a gradient scaler (CUDA; other devices use bf16)


class InnerOptimizer(Choice):
    ADAMW = "adamw"  # torch AdamW, fp32 state (model/gpt.py make_inner_optimizer)
    ADAMW_8BIT = "adamw8bit"  # bitsandbytes AdamW8bit: blockwise 8-bit state on CUDA; AdamW elsewhere


class LRSchedule(Choice):
    CONSTANT = "constant"
    COSINE = "cosine"  # linear warmup, then cosine decay to min_lr_ratio * inner_lr over decay_steps


@section("train")
class TrainConfig:
    """How one inner step runs (model/trainer.py). A step is always `diloco.batch_size` sequences; a
    volunteer may split it into micro-batches (`join --micro-batch N`) without changing what it means."""

    precision: Annotated[Precision, LAX] = Precision.FP32
    # max global gradient norm; 0: no clipping
    grad_clip: Annotated[Number, Field(ge=0, description="0 = off")] = 0.0
    lr_schedule: Annotated[LRSchedule, LAX] = LRSchedule.CONSTANT
    warmup_steps: Annotated[int, Field(ge=0)] = 0  # linear warmup of the inner lr over this many local steps
    decay_steps: Annotated[int, Field(ge=0)] = (
        0  # cosine: steps after warmup to reach min_lr_ratio * inner_lr
    )
    min_lr_ratio: Annotated[Number, Field(ge=0, le=1)] = 0.1
    activation_checkpointing: bool = False  # hf models: recompute activations in backward
    loss_every: Annotated[int, Field(ge=1)] = (
        1  # read the loss from the device every N steps (a sync point on GPUs)
    )
    optimizer: Annotated[InnerOptimizer, LAX] = (
        InnerOptimizer.ADAMW
    )  # adamw8bit: a quarter of AdamW's state memory on CUDA

    @model_validator(mode="after")
    def _cosine_needs_decay(self) -> TrainConfig:
        if self.lr_schedule == LRSchedule.COSINE and self.decay_steps <= 0:
            raise Rule(
                "decay_steps",
                self.decay_steps,
                "lr_schedule = 'cosine' needs decay_steps > 0 (steps from warmup's end to the minimum lr)",
            )
        return self
