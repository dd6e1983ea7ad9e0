"""Typed, frozen configuration: DiLoCo knobs, model, data, wire and swarm timing, and the run manifest.

Every dataclass validates itself at construction and raises `ConfigError` naming the field and the fix.
A manifest (TOML, see `peers/demo.toml`) bundles them; its hash goes into every DHT key and header so
peers with a different manifest never mix.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from p2p_diloco.errors import ConfigError
from p2p_diloco.manifest_types import build_section, section_values
from p2p_diloco.packaged import missing_manifest_hint
from p2p_diloco.protocol.robust import RobustConfig
from p2p_diloco.protocol.timing import SwarmTiming
from p2p_diloco.specs import (
    Choice,
    DataConfig,
    DataSource,
    InnerOptimizer,
    LRSchedule,
    ModelConfig,
    ModelKind,
    Precision,
    TrainConfig,
)
from p2p_diloco.trust_config import LEARNERS_ANY, TrustConfig

__all__ = [
    "LEARNERS_ANY",
    "DataConfig",
    "DataSource",
    "DilocoConfig",
    "InnerOptimizer",
    "LimitsConfig",
    "LRSchedule",
    "ModelConfig",
    "ModelKind",
    "Precision",
    "RunManifest",
    "TrainConfig",
    "TrustConfig",
    "WireConfig",
]


class Codec(Choice):
    """Tensor codecs of `[wire] codec`: dense int8 blockwise (default), raw fp32; sparse top-k per chunk of
    65536 entries with int8 or 4-bit values (`wire.sparse`); and SparseLoCo's layout, top-k per chunk of
    4096 entries with 12-bit chunk-local offsets and 2-, 4- or 8-bit values (`wire.chunked`)."""

    INT8 = "int8"
    FP32 = "fp32"
    TOPK_INT8 = "topk-int8"
    TOPK_INT4 = "topk-int4"
    TOPK4K_INT2 = "topk4k-int2"
    TOPK4K_INT4 = "topk4k-int4"
    TOPK4K_INT8 = "topk4k-int8"

    @property
    def sparse(self) -> bool:
        return self not in (Codec.INT8, Codec.FP32)


def default_feedback_decay(codec: Codec) -> float:
    """`[wire] feedback_decay` left out: 0.95 for sparse codecs (SparseLoCo's; 0.9-0.95 measured 3-4 % better
    than 1.0, docs/results.md), 1.0 for dense ones (their residual is one rounding error, kept whole)."""
    return 0.95 if codec.sparse else 1.0


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _is_fraction(value: object) -> bool:
    """A number (not a bool) in (0, 1]."""
    return isinstance(value, int | float) and not isinstance(value, bool) and 0.0 < value <= 1.0


@dataclass(frozen=True)
class DilocoConfig:
    """The algorithm's knobs (names follow PAPER.md)."""

    inner_steps: int = 24  # H: inner steps between two syncs of the same fragment
    fragments: int = 4  # P
    max_in_flight: int = 2  # tau: fragments sent but not yet adopted
    min_quorum: int = 1  # K
    grace_gamma: float = 0.3  # gamma in the adaptive grace window
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    max_staleness: int = 4  # a delta's anchor must be within this many outer versions
    merge_rule: Literal["rda", "mean"] = "rda"
    # "contributors": the merged outer gradient is scaled by (learners merged / live learners), so that
    # with K < M the global model moves per unit of time as much as synchronous DiLoCo would, instead of
    # M times more (one full outer step per learner). "none": apply every merge at full size.
    outer_scaling: Literal["contributors", "none"] = "contributors"
    fragment_pattern: Literal["balanced", "strided"] = "balanced"
    # How a learner takes a merged fragment that included its delta (see swarm/learner.py):
    # "carry" = new global plus progress made since sending, "overwrite" = exactly the new global, "blend".
    adoption: Literal["carry", "overwrite", "blend"] = "carry"
    blend_alpha: float = 0.5
    inner_lr: float = 3e-3
    inner_weight_decay: float = 0.1
    batch_size: int = 8
    synchronizer_shards: int = 1  # S: shards of fragments, each with its own lease (`protocol.shards`)

    def __post_init__(self) -> None:
        _require(self.fragments >= 1, f"fragments (P) must be >= 1, got {self.fragments}")
        s, p = self.synchronizer_shards, self.fragments
        _require(1 <= s <= p, f"synchronizer_shards (S) must be from 1 to fragments (P={p}), got {s}")
        _require(
            self.inner_steps >= self.fragments,
            f"inner_steps (H={self.inner_steps}) must be >= fragments (P={self.fragments}): "
            "one fragment is due every H/P steps",
        )
        _require(self.max_in_flight >= 1, f"max_in_flight (tau) must be >= 1, got {self.max_in_flight}")
        _require(self.min_quorum >= 1, f"min_quorum (K) must be >= 1, got {self.min_quorum}")
        _require(0.0 <= self.grace_gamma < 1.0, f"grace_gamma must be in [0, 1), got {self.grace_gamma}")
        _require(self.outer_lr > 0, f"outer_lr must be > 0, got {self.outer_lr}")
        _require(
            0.0 <= self.outer_momentum < 1.0, f"outer_momentum must be in [0, 1), got {self.outer_momentum}"
        )
        _require(self.max_staleness >= 0, f"max_staleness must be >= 0, got {self.max_staleness}")
        _require(
            self.merge_rule in ("rda", "mean"), f"merge_rule must be 'rda' or 'mean', got {self.merge_rule!r}"
        )
        _require(
            self.outer_scaling in ("contributors", "none"),
            f"outer_scaling must be 'contributors' or 'none', got {self.outer_scaling!r}",
        )
        _require(
            self.fragment_pattern in ("balanced", "strided"),
            f"fragment_pattern must be 'balanced' or 'strided', got {self.fragment_pattern!r}",
        )
        _require(
            self.adoption in ("carry", "overwrite", "blend"),
            f"adoption must be 'carry', 'overwrite' or 'blend', got {self.adoption!r}",
        )
        _require(0.0 < self.blend_alpha <= 1.0, f"blend_alpha must be in (0, 1], got {self.blend_alpha}")
        _require(self.inner_lr > 0, f"inner_lr must be > 0, got {self.inner_lr}")
        _require(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")

    @property
    def steps_per_fragment(self) -> int:
        """Inner steps between two consecutive fragment sends (H/P, at least 1)."""
        return max(1, self.inner_steps // self.fragments)


@dataclass(frozen=True)
class WireConfig:
    """How outer deltas and updates are encoded (`wire.codec`; sparse top-k bodies: `wire.sparse`)."""

    # "int8" (dense blockwise, the default), "fp32", or sparse: "topk-int8" / "topk-int4" (per chunk of
    # 65536 entries only the top `density` by magnitude are sent) or "topk4k-int2" / "-int4" / "-int8"
    # (SparseLoCo's layout: chunks of 4096, 12-bit offsets); the rest is carried by error feedback.
    codec: Codec = Codec.INT8
    block_size: int = 4096
    error_feedback: bool = True
    max_message_bytes: int = 256 * 1024 * 1024
    norm_bound: float = 1e4  # absolute bound on a delta tensor's L2 norm
    density: float = 0.03  # fraction of each chunk a sparse codec keeps (ignored by dense codecs)
    # Error feedback keeps decay x (the residual) before adding the next delta; 1.0 keeps all of it. Below 1
    # a residual left out of many deltas fades, as SparseLoCo's error-feedback accumulator does. Left out, it
    # is `default_feedback_decay(codec)`, resolved here (the hash sees the number; `dataclasses.replace` of
    # the codec keeps the old number: pass feedback_decay too).
    feedback_decay: float | None = None

    def __post_init__(self) -> None:
        names = [str(c) for c in Codec]
        _require(
            isinstance(self.codec, str) and self.codec in names,
            f"wire.codec must be one of {names}, got {self.codec!r}",
        )
        object.__setattr__(self, "codec", Codec(self.codec))
        if self.feedback_decay is None:
            object.__setattr__(self, "feedback_decay", default_feedback_decay(self.codec))
        _require(
            _is_fraction(self.density),
            f"wire.density must be in (0, 1] (e.g. 0.01-0.1: the fraction of entries a sparse codec "
            f"sends), got {self.density!r}",
        )
        _require(
            _is_fraction(self.feedback_decay),
            f"wire.feedback_decay must be in (0, 1] (1.0 keeps the whole residual, 0.9-0.99 lets old "
            f"residuals fade), got {self.feedback_decay!r}",
        )
        _require(
            not self.codec.sparse or self.error_feedback,
            f"wire.codec = {str(self.codec)!r} needs wire.error_feedback = true: without it the "
            "entries a sparse delta leaves out are lost",
        )
        _require(
            self.block_size in (64, 128, 256, 512, 1024, 2048, 4096),
            f"wire.block_size must be one of 64..4096 (powers of two), got {self.block_size}",
        )
        _require(self.max_message_bytes > 0, "wire.max_message_bytes must be > 0")
        _require(self.norm_bound > 0, "wire.norm_bound must be > 0")


MIB = 1024 * 1024


@dataclass(frozen=True)
class LimitsConfig:
    """What one peer may hold beyond its training state (`[limits]`). Local to each peer: peers of one run
    may differ here, so it is not part of the manifest hash."""

    # Bytes of applied updates kept for replay, over all fragments (each fragment gets its share by size;
    # the latest update of a fragment is always kept). 0: automatic, 2 x the model's int8 size, at least
    # `MIN_AUTO_UPDATE_LOG_BYTES`. A peer that needs older updates downloads a snapshot instead.
    update_log_bytes: int = 0
    update_log_length: int = 256  # and at most this many updates per fragment
    snapshot_chunk_bytes: int = 4 * MIB  # a snapshot travels in chunks of at most this many bytes
    snapshot_sources: int = 4  # a newcomer fetches one fragment's chunks from up to this many peers at once
    snapshot_chunks_in_flight: int = 2  # chunk requests open per source at once
    # Fragment states a peer keeps serving to downloaders (most recently used): one costs nothing while it is
    # the replica's current state, a fragment's Θ and m (8 B/param of it) once the replica has moved on.
    snapshot_pins: int = 4
    snapshot_pin_seconds: float = 60.0  # a served state idle this long is dropped

    MIN_AUTO_UPDATE_LOG_BYTES = 16 * MIB

    def __post_init__(self) -> None:
        _require(
            type(self.update_log_bytes) is int and self.update_log_bytes >= 0,
            f"limits.update_log_bytes must be an integer >= 0 (0: 2 x the model's int8 size), "
            f"got {self.update_log_bytes!r}",
        )
        _require(
            type(self.update_log_length) is int and self.update_log_length >= 1,
            f"limits.update_log_length must be an integer >= 1, got {self.update_log_length!r}",
        )
        _require(
            type(self.snapshot_chunk_bytes) is int
            and 4096 <= self.snapshot_chunk_bytes <= 64 * MIB
            and self.snapshot_chunk_bytes % 4 == 0,
            f"limits.snapshot_chunk_bytes must be a multiple of 4 in 4096..{64 * MIB} (e.g. {4 * MIB}), "
            f"got {self.snapshot_chunk_bytes!r}",
        )
        for name in ("snapshot_sources", "snapshot_chunks_in_flight", "snapshot_pins"):
            value = getattr(self, name)
            _require(
                type(value) is int and 1 <= value <= 64, f"limits.{name} must be in 1..64, got {value!r}"
            )
        _require(
            self.snapshot_pin_seconds > 0,
            f"limits.snapshot_pin_seconds must be > 0, got {self.snapshot_pin_seconds}",
        )

    def update_log_budget(self, num_params: int) -> int:
        """The update log's byte budget for a model of `num_params` parameters."""
        if self.update_log_bytes:
            return self.update_log_bytes
        return max(2 * num_params, self.MIN_AUTO_UPDATE_LOG_BYTES)


@dataclass(frozen=True)
class RunManifest:
    """Everything peers of one run must agree on. Its `manifest_hash` is part of every key and header."""

    run_id: str
    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    wire: WireConfig = field(default_factory=WireConfig)
    timing: SwarmTiming = field(default_factory=SwarmTiming)
    robust: RobustConfig = field(default_factory=RobustConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    trust: TrustConfig = field(default_factory=TrustConfig)
    allowlist: tuple[str, ...] = ()
    bootstrap: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _require(
            bool(self.run_id)
            and all(c.isalnum() or c in "-_." for c in self.run_id)
            and len(self.run_id) <= 64,
            f"run_id must be 1-64 characters of letters, digits, '-', '_' or '.', got {self.run_id!r}",
        )
        _require(
            not self.train.activation_checkpointing or self.model.kind != ModelKind.GPT,
            "train.activation_checkpointing is for kind = 'hf' models; remove it for the built-in gpt",
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def may_synchronize(self, peer: str) -> bool:
        """Whether `peer` may hold the lease: on the allowlist (if any) and in `trust.synchronizers` (if any)."""
        return (not self.allowlist or peer in self.allowlist) and self.trust.may_synchronize(peer)

    def may_learn(self, peer: str) -> bool:
        """Whether `peer` may send deltas and fetch state: the allowlist (if any) and `trust.learners`."""
        return (not self.allowlist or peer in self.allowlist) and self.trust.may_learn(peer)

    def may_evaluate(self, peer: str) -> bool:
        """Whether `peer`'s global eval points count (`trust.may_evaluate`, within the allowlist if any)."""
        return (not self.allowlist or peer in self.allowlist) and self.trust.may_evaluate(peer)

    def listed(self, peer: str) -> bool:
        """Whether the manifest names `peer` (allowlist, `trust.learners`, `trust.synchronizers`): a listed
        peer's heartbeat makes rounds await it; an unlisted key is awaited from its first accepted delta on.
        In a run that restricts nobody, every peer."""
        if self.allowlist:
            return peer in self.allowlist
        if self.trust.learners != LEARNERS_ANY:
            return self.trust.may_learn(peer)
        return self.trust.may_synchronize(peer)

    @property
    def loss_check_on(self) -> bool:
        """Whether the synchronizer tries each delta on held-out data before merging (`[robust] loss_check`)."""
        mode = self.robust.loss_check
        return self.robust.enabled and (mode == "on" or (mode == "auto" and self.trust.public))

    def participants(self) -> frozenset[str] | None:
        """The peers that may take part at all, or None when anyone may (no allowlist, learners "any")."""
        if self.trust.learners == LEARNERS_ANY:
            return frozenset(self.allowlist) if self.allowlist else None
        listed = frozenset(self.trust.learners) | frozenset(self.trust.synchronizers)
        return listed & frozenset(self.allowlist) if self.allowlist else listed

    @functools.cached_property
    def manifest_hash(self) -> str:
        """16 hex digits over everything peers must agree on (bootstrap addresses and the paths of files
        whose content is pinned otherwise excluded)."""
        d = self.to_dict()
        d.pop("bootstrap")
        d.pop("limits")  # each peer's own resources
        # Where a peer keeps the run's files is its own business when their content is pinned: the
        # shards by data.digest, a config file by its content (resolved_config), init by weights_digest.
        d["model"].pop("base_dir")
        d["data"].pop("base_dir")
        d["data"].pop("shards")
        if d["diloco"]["synchronizer_shards"] == 1:  # added later: unsharded manifests keep their hash
            d["diloco"].pop("synchronizer_shards")
        if not d["trust"]["evaluators"]:
            d["trust"].pop("evaluators")  # added later: manifests without it keep their hash
        if isinstance(d["model"]["config"], str):
            d["model"]["config"] = "file"
        if d["model"]["weights_digest"] or not d["model"]["pretrained"]:
            d["model"].pop("pretrained")  # pinned by the digest, or absent (added later: hashes kept)
        if d["model"]["weights_digest"]:
            d["model"].pop("init")
        blob = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(blob, digest_size=8).hexdigest()

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, where: str = "manifest", base_dir: str = "") -> RunManifest:
        """`base_dir`: the folder relative paths in [model] and [data] resolve against (not hashed)."""
        sections = {
            "diloco": DilocoConfig,
            "model": ModelConfig,
            "data": DataConfig,
            "train": TrainConfig,
            "wire": WireConfig,
            "timing": SwarmTiming,
            "robust": RobustConfig,
            "limits": LimitsConfig,
            "trust": TrustConfig,
        }
        raw = dict(raw)
        known = set(sections) | {"run_id", "allowlist", "bootstrap"}
        unknown = sorted(set(raw) - known)
        _require(not unknown, f"{where}: unknown top-level keys {unknown}; expected some of {sorted(known)}")
        _require("run_id" in raw, f'{where}: missing run_id = "..."')
        _require(
            isinstance(raw["run_id"], str),
            f'{where}: run_id must be a string, got {raw["run_id"]!r}: write run_id = "{raw["run_id"]}"',
        )
        kwargs: dict[str, Any] = {"run_id": raw["run_id"]}
        for name, klass in sections.items():
            base = base_dir if name in ("model", "data") else None
            values = section_values(name, klass, raw.get(name, {}), where=where, base_dir=base)
            kwargs[name] = build_section(name, klass, values, where=where)
        for name in ("allowlist", "bootstrap"):
            value = raw.get(name, [])
            _require(
                isinstance(value, list) and all(isinstance(v, str) for v in value),
                f"{where}: {name} must be a list of strings",
            )
            kwargs[name] = tuple(value)
        return cls(**kwargs)

    @classmethod
    def load(cls, path: str | Path) -> RunManifest:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(missing_manifest_hint(path))
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"manifest {path} is not valid TOML: {exc}") from exc
        return cls.from_dict(raw, where=str(path), base_dir=str(path.resolve().parent))
