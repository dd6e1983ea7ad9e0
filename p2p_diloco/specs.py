"""What a run trains, on what text, and how one inner step runs: `ModelConfig`, `DataConfig`, `TrainConfig`.

Owns the manifest sections ``[model]``, ``[data]`` and ``[train]`` (re-exported by `p2p_diloco.config`).
Every dataclass is frozen and validates itself at construction; a bad value raises `ConfigError` naming
the key and the fix. Kinds are `StrEnum`s, so TOML strings compare and hash as the plain strings.

Relative paths in ``[model]`` and ``[data]`` resolve against `base_dir` (the manifest's folder, set by
`RunManifest.load`; not part of the manifest hash, so peers may keep the run's files anywhere), falling
back to the working directory (`resolve_path`). A model
``config = "config.json"`` is read at construction: its content, not its path, is hashed
(`resolved_config`), so two peers with different config files never mix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from p2p_diloco.errors import ConfigError


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


class Choice(StrEnum):
    """A manifest choice: compares, hashes, prints and reprs as its plain string, so a message shows
    ``'custom'`` as the manifest spells it, never ``<ModelKind.CUSTOM: 'custom'>``."""

    def __repr__(self) -> str:
        return repr(self.value)


def _enum(klass: type[StrEnum], value: object, key: str) -> StrEnum:
    try:
        return klass(value)
    except ValueError:
        raise ConfigError(f"{key} must be one of {[k.value for k in klass]}, got {value!r}") from None


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


@dataclass(frozen=True)
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

    kind: ModelKind = ModelKind.GPT
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    block_size: int = 64
    dropout: float = 0.0
    seed: int = 0  # initial weights are identical on every peer
    config: dict[str, Any] | str | None = None  # hf: inline table or path to config.json; custom: kwargs
    init: str = ""  # hf/custom: local weights file or folder
    factory: str = ""  # custom: "package.module:function"
    pretrained: str = ""  # hf: a folder or a Hub name "ORG/NAME" whose config and weights start the run
    weights_digest: str = ""  # checksum of the initial weights (see `model.external.weights_digest`)
    base_dir: str = field(default="", compare=False)  # the manifest's folder; not hashed
    # the hashed content of `config`, computed at construction (a value passed in is replaced)
    resolved_config: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _enum(ModelKind, self.kind, "model.kind"))
        _require(self.block_size >= 2, f"model.block_size must be >= 2, got {self.block_size}")
        _require(0.0 <= self.dropout < 1.0, f"model.dropout must be in [0, 1), got {self.dropout}")
        object.__setattr__(self, "resolved_config", {})
        if self.kind == ModelKind.GPT:
            _require(self.n_layer >= 1, f"model.n_layer must be >= 1, got {self.n_layer}")
            _require(self.n_head >= 1, f"model.n_head must be >= 1, got {self.n_head}")
            _require(
                self.n_embd % self.n_head == 0,
                f"model.n_embd ({self.n_embd}) must be a multiple of model.n_head ({self.n_head})",
            )
            for key in ("config", "init", "factory", "pretrained"):
                _require(
                    not getattr(self, key),
                    f"model.{key} is for kind = 'hf' or 'custom'; remove it or set model.kind",
                )
            return
        if self.kind == ModelKind.HF:
            _require(not self.factory, "model.factory is for kind = 'custom'; remove it")
            _require(
                (self.config is None) != (not self.pretrained),
                "model.kind = 'hf' needs a transformers config (an inline [model.config] table with "
                'model_type = "llama", ..., or config = "path/config.json") or pretrained = "ORG/NAME" (or a '
                "folder holding config.json and *.safetensors), not both: a pretrained model brings its "
                "own config (its dropout comes from model.dropout)",
            )
            _require(
                not (self.pretrained and self.init),
                "model.pretrained and model.init both give the initial weights; keep one",
            )
        else:
            _require(not self.pretrained, "model.pretrained is for kind = 'hf'; remove it")
            module, _, func = self.factory.partition(":")
            _require(
                bool(module) and func.isidentifier(),
                f"model.kind = 'custom' needs factory = \"package.module:function\", got {self.factory!r}",
            )
            _require(
                self.config is None or isinstance(self.config, dict),
                "model.config of a custom model is the [model.config] table of keyword arguments",
            )
        object.__setattr__(self, "resolved_config", self._read_config())

    def _read_config(self) -> dict[str, Any]:
        if self.config is None:  # a custom factory without keyword arguments
            return {}
        if isinstance(self.config, dict):
            return dict(self.config)
        if not isinstance(self.config, str):
            raise ConfigError(f"model.config must be a table or a path string, got {self.config!r}")
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
        _require(isinstance(raw, dict), f"model.config file {path} must hold a JSON object")
        return raw

    def path(self, path: str) -> Path:
        """A path named in ``[model]``, resolved against the manifest's folder."""
        return resolve_path(self.base_dir, path)


class DataSource(Choice):
    BUILTIN = "builtin"  # Python's bundled pydoc text, as bytes
    FILES = "files"  # local text files, as bytes
    SHARDS = "shards"  # token shards written by `p2p-diloco data prepare` (model/shards.py)


@dataclass(frozen=True)
class DataConfig:
    """Where training tokens come from.

    `builtin`/`files`: bytes of text, split into train and eval by `eval_fraction`. `shards`: the folder
    `shards` written by `p2p-diloco data prepare`, whose content digest must equal `digest` (printed by
    prepare); the eval split is the one prepare held out. `seed` is the run seed of every peer's stream.
    """

    source: DataSource = DataSource.BUILTIN
    paths: tuple[str, ...] = ()
    eval_fraction: float = 0.05
    seed: int = 0
    shards: str = ""  # folder holding index.json and the shard files
    digest: str = ""  # the dataset's content digest, as `p2p-diloco data prepare` printed it
    base_dir: str = field(default="", compare=False)  # the manifest's folder; not hashed

    def __post_init__(self) -> None:
        object.__setattr__(self, "source", _enum(DataSource, self.source, "data.source"))
        _require(
            self.source != DataSource.FILES or len(self.paths) > 0,
            "data.source = 'files' needs data.paths = ['corpus.txt', ...]",
        )
        _require(
            0.0 < self.eval_fraction < 0.5,
            f"data.eval_fraction must be in (0, 0.5), got {self.eval_fraction}",
        )
        if self.source == DataSource.SHARDS:
            _require(
                bool(self.shards) and bool(self.digest),
                "data.source = 'shards' needs shards = 'folder written by p2p-diloco data prepare' and "
                "digest = '...' (the digest that command printed)",
            )
        else:
            _require(
                not self.shards and not self.digest,
                "data.shards and data.digest are for data.source = 'shards'",
            )

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


@dataclass(frozen=True)
class TrainConfig:
    """How one inner step runs (model/trainer.py). A step is always `diloco.batch_size` sequences; a
    volunteer may split it into micro-batches (`join --micro-batch N`) without changing what it means."""

    precision: Precision = Precision.FP32
    grad_clip: float = 0.0  # max global gradient norm; 0: no clipping
    lr_schedule: LRSchedule = LRSchedule.CONSTANT
    warmup_steps: int = 0  # linear warmup of the inner lr over this many local steps
    decay_steps: int = 0  # cosine: steps after warmup to reach min_lr_ratio * inner_lr
    min_lr_ratio: float = 0.1
    activation_checkpointing: bool = False  # hf models: recompute activations in backward
    loss_every: int = 1  # read the loss from the device every N steps (a sync point on GPUs)
    optimizer: InnerOptimizer = InnerOptimizer.ADAMW  # adamw8bit: a quarter of AdamW's state memory on CUDA

    def __post_init__(self) -> None:
        object.__setattr__(self, "optimizer", _enum(InnerOptimizer, self.optimizer, "train.optimizer"))
        object.__setattr__(self, "precision", _enum(Precision, self.precision, "train.precision"))
        object.__setattr__(self, "lr_schedule", _enum(LRSchedule, self.lr_schedule, "train.lr_schedule"))
        _require(self.grad_clip >= 0, f"train.grad_clip must be >= 0 (0 = off), got {self.grad_clip}")
        _require(self.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {self.warmup_steps}")
        _require(self.decay_steps >= 0, f"train.decay_steps must be >= 0, got {self.decay_steps}")
        _require(
            self.lr_schedule != LRSchedule.COSINE or self.decay_steps > 0,
            "train.lr_schedule = 'cosine' needs train.decay_steps > 0 (steps from warmup's end to the "
            "minimum lr)",
        )
        _require(
            0.0 <= self.min_lr_ratio <= 1.0, f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}"
        )
        _require(self.loss_every >= 1, f"train.loss_every must be >= 1, got {self.loss_every}")
