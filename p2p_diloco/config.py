"""Typed, frozen configuration: DiLoCo knobs, model, data, wire and swarm timing, and the run manifest.

Every section is a frozen pydantic dataclass (`schema.section`): limits are `Field` constraints, rules
across keys model validators, and a bad value raises `ConfigError` naming the key path and the fix.
A manifest (TOML, see `peers/demo.toml`) bundles them; its hash goes into every DHT key and header so
peers with a different manifest never mix.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import tomllib
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from p2p_diloco.errors import ConfigError
from p2p_diloco.manifest_types import build_section, section_values
from p2p_diloco.packaged import missing_manifest_hint
from p2p_diloco.protocol.robust import RobustConfig
from p2p_diloco.protocol.timing import SwarmTiming
from p2p_diloco.schema import LAX, Number, Rule, section
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
    65536 entries with int8 or 4-bit values (`wire.codecs.sparse`); and SparseLoCo's layout, top-k per chunk
    of 4096 entries with 12-bit chunk-local offsets and 2-, 4- or 8-bit values (`wire.codecs.chunked`)."""

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


@section("diloco")
class DilocoConfig:
    """The algorithm's knobs (names follow PAPER.md)."""

    inner_steps: Annotated[int, Field(ge=1, description="H, inner steps between two syncs of a fragment")] = (
        24
    )
    fragments: Annotated[int, Field(ge=1, description="P, parts of the model synchronized in turn")] = 4
    max_in_flight: Annotated[int, Field(ge=1, description="tau, fragments sent but not yet adopted")] = 2
    min_quorum: Annotated[int, Field(ge=1, description="K, deltas a round waits for")] = 1
    grace_gamma: Annotated[Number, Field(ge=0, lt=1, description="gamma of the adaptive grace window")] = 0.3
    outer_lr: Annotated[Number, Field(gt=0)] = 0.7
    outer_momentum: Annotated[Number, Field(ge=0, lt=1)] = 0.9
    # a delta's anchor must be within this many outer versions
    max_staleness: Annotated[int, Field(ge=0)] = 4
    merge_rule: Literal["rda", "mean"] = "rda"
    # "contributors": the merged outer gradient is scaled by (learners merged / live learners), so that
    # with K < M the global model moves per unit of time as much as synchronous DiLoCo would, instead of
    # M times more (one full outer step per learner). "none": apply every merge at full size.
    outer_scaling: Literal["contributors", "none"] = "contributors"
    fragment_pattern: Literal["balanced", "strided"] = "balanced"
    # How a learner takes a merged fragment that included its delta (see swarm/learner.py):
    # "carry" = new global plus progress made since sending, "overwrite" = exactly the new global, "blend".
    adoption: Literal["carry", "overwrite", "blend"] = "carry"
    blend_alpha: Annotated[Number, Field(gt=0, le=1)] = 0.5
    inner_lr: Annotated[Number, Field(gt=0)] = 3e-3
    inner_weight_decay: Number = 0.1
    batch_size: Annotated[int, Field(ge=1, description="sequences per inner step")] = 8
    # S: shards of fragments, each with its own lease (`protocol.shards`)
    synchronizer_shards: Annotated[
        int, Field(ge=1, description="S, shards of fragments with their own lease")
    ] = 1
    # Each update goes from its publisher to at most `fanout` peers, then each peer that applied it offers
    # it to at most `fanout` more (swarm/relay.py): about log_fanout(M) hops whatever the swarm's size
    fanout: Annotated[int, Field(ge=1, description="peers each update is pushed, then relayed, to")] = 3
    # Sparse (union) rounds list at most `gather` deltas per fragment (`protocol.gather`): the round's best
    # by merge weight (tokens x standing ramp); a delta left out is refused `not gathered` and its learner
    # resends the work with its next delta. Every replica downloads the listed deltas, so a round's down
    # bytes are at most `gather` deltas whatever the swarm's size (Covenant-72B gathers about 20). The outer
    # scaling of a sparse round counts min(live learners, gather): a round listing `gather` is a full one.
    gather: Annotated[
        int, Field(ge=1, le=256, description="deltas a sparse round lists per fragment, at most")
    ] = 20

    @model_validator(mode="after")
    def _fragments_fit(self) -> DilocoConfig:
        if self.inner_steps < self.fragments:
            raise Rule(
                "inner_steps",
                self.inner_steps,
                f"must be >= fragments (P = {self.fragments}): one fragment is due every H/P steps; "
                f"set inner_steps >= {self.fragments} or fragments <= {self.inner_steps}",
            )
        if self.synchronizer_shards > self.fragments:
            raise Rule(
                "synchronizer_shards",
                self.synchronizer_shards,
                f"must be from 1 to fragments (P = {self.fragments}): each shard holds whole fragments; "
                f"set synchronizer_shards <= {self.fragments}",
            )
        return self

    @property
    def steps_per_fragment(self) -> int:
        """Inner steps between two consecutive fragment sends (H/P, at least 1)."""
        return max(1, self.inner_steps // self.fragments)


@section("wire")
class WireConfig:
    """How outer deltas and updates are encoded (`wire.codecs.codec`; sparse top-k bodies:
    `wire.codecs.sparse`)."""

    # "int8" (dense blockwise, the default), "fp32", or sparse: "topk-int8" / "topk-int4" (per chunk of
    # 65536 entries only the top `density` by magnitude are sent) or "topk4k-int2" / "-int4" / "-int8"
    # (SparseLoCo's layout: chunks of 4096, 12-bit offsets); the rest is carried by error feedback.
    codec: Annotated[Codec, LAX] = Codec.INT8
    block_size: Literal[64, 128, 256, 512, 1024, 2048, 4096] = 4096
    error_feedback: bool = True
    max_message_bytes: Annotated[int, Field(gt=0)] = 256 * 1024 * 1024
    norm_bound: Annotated[Number, Field(gt=0, description="bound on a delta tensor's L2 norm")] = 1e4
    density: Annotated[
        Number, Field(gt=0, le=1, description="the fraction of entries a sparse codec sends, e.g. 0.01-0.1")
    ] = 0.03
    # Error feedback keeps decay x (the residual) before adding the next delta; 1.0 keeps all of it. Below 1
    # a residual left out of many deltas fades, as SparseLoCo's error-feedback accumulator does. Left out, it
    # is `default_feedback_decay(codec)`, resolved here (the hash sees the number; `dataclasses.replace` of
    # the codec keeps the old number: pass feedback_decay too).
    feedback_decay: (
        Annotated[
            Number,
            Field(gt=0, le=1, description="1.0 keeps the whole residual, 0.9-0.99 lets old residuals fade"),
        ]
        | None
    ) = None

    @model_validator(mode="after")
    def _codec_rules(self) -> WireConfig:
        if self.feedback_decay is None:
            object.__setattr__(self, "feedback_decay", default_feedback_decay(self.codec))
        if self.codec.sparse and not self.error_feedback:
            raise Rule(
                "error_feedback",
                False,
                f"codec = {str(self.codec)!r} needs error_feedback = true: without it the entries a sparse "
                "delta leaves out are lost; set error_feedback = true or a dense codec",
            )
        return self


MIB = 1024 * 1024


Count = Annotated[int, Field(ge=1, le=64)]


@section("limits")
class LimitsConfig:
    """What one peer may hold beyond its training state (`[limits]`). Local to each peer: peers of one run
    may differ here, so it is not part of the manifest hash."""

    # Bytes of applied updates kept for replay, over all fragments (each fragment gets its share by size;
    # the latest update of a fragment is always kept). 0: automatic, 2 x the model's int8 size, at least
    # `MIN_AUTO_UPDATE_LOG_BYTES`. A peer that needs older updates downloads a snapshot instead.
    update_log_bytes: Annotated[int, Field(ge=0, description="0: 2 x the model's int8 size")] = 0
    update_log_length: Annotated[int, Field(ge=1)] = 256  # and at most this many updates per fragment
    # a snapshot travels in chunks of at most this many bytes
    snapshot_chunk_bytes: Annotated[
        int, Field(ge=4096, le=64 * MIB, multiple_of=4, description=f"e.g. {4 * MIB}")
    ] = 4 * MIB
    snapshot_sources: Count = 4  # a newcomer fetches one fragment's chunks from up to this many peers at once
    snapshot_chunks_in_flight: Count = 2  # chunk requests open per source at once
    # A newcomer downloads fragments side by side while their Θ and m (8 B/param) fit this many bytes (at
    # least one fragment at a time): its memory peak is its replica plus this much.
    snapshot_download_bytes: Annotated[int, Field(ge=0, description=f"e.g. {256 * MIB}")] = 256 * MIB
    # Fragment states a peer keeps serving to downloaders (most recently used): one costs nothing while it is
    # the replica's current state, a fragment's Θ and m (8 B/param of it) once the replica has moved on.
    snapshot_pins: Count = 4
    snapshot_pin_seconds: Annotated[Number, Field(gt=0)] = 60.0  # a served state idle this long is dropped

    MIN_AUTO_UPDATE_LOG_BYTES: ClassVar[int] = 16 * MIB

    def update_log_budget(self, num_params: int) -> int:
        """The update log's byte budget for a model of `num_params` parameters."""
        if self.update_log_bytes:
            return self.update_log_bytes
        return max(2 * num_params, self.MIN_AUTO_UPDATE_LOG_BYTES)


RUN_ID = "1-64 characters of letters, digits, '-', '_' or '.'"


@section("")
class RunManifest:
    """Everything peers of one run must agree on. Its `manifest_hash` is part of every key and header."""

    run_id: Annotated[str, Field(pattern=r"^[\w.-]{1,64}$", description=RUN_ID)]
    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    wire: WireConfig = field(default_factory=WireConfig)
    timing: SwarmTiming = field(default_factory=SwarmTiming)
    robust: RobustConfig = field(default_factory=RobustConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    trust: TrustConfig = field(default_factory=TrustConfig)
    allowlist: Annotated[tuple[str, ...], LAX] = ()
    bootstrap: Annotated[tuple[str, ...], LAX] = ()

    @model_validator(mode="after")
    def _checkpointing_needs_hf(self) -> RunManifest:
        if self.train.activation_checkpointing and self.model.kind == ModelKind.GPT:
            raise Rule(
                "[train] activation_checkpointing",
                True,
                "is for kind = 'hf' models; remove it for the built-in gpt",
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def may_synchronize(self, peer: str) -> bool:
        """Whether `peer` may hold the lease: on the allowlist (if any) and in `trust.synchronizers` (if
        any)."""
        if self._anyone_synchronizes:  # asked for every tip of every read: the open run's answer at once
            return True
        return (not self.allowlist or peer in self.allowlist) and self.trust.may_synchronize(peer)

    @functools.cached_property
    def _anyone_synchronizes(self) -> bool:
        return not self.allowlist and not self.trust.synchronizers

    def may_learn(self, peer: str) -> bool:
        """Whether `peer` may send deltas and fetch state: the allowlist (if any) and `trust.learners`."""
        return (not self.allowlist or peer in self.allowlist) and self.trust.may_learn(peer)

    @functools.cached_property
    def anyone_may_learn(self) -> bool:
        """Whether `may_learn` holds for every peer: no allowlist, and `trust.learners` is "any"."""
        return not self.allowlist and self.trust.learners == LEARNERS_ANY

    def takes_part(self, peer: str) -> bool:
        """Whether `peer` may learn or synchronize: a place in an update's relay tree (`swarm.relay`)."""
        return self.may_learn(peer) or self.may_synchronize(peer)

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
        """Whether the synchronizer tries each delta on held-out data before merging
        (`[robust] loss_check`)."""
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
        if d["diloco"]["fanout"] == DilocoConfig.fanout:
            d["diloco"].pop("fanout")  # added later: manifests at the default keep their hash
        if d["diloco"]["gather"] == DilocoConfig.gather:
            d["diloco"].pop("gather")  # added later: manifests at the default keep their hash
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
        if unknown:
            raise ConfigError(f"{where}: unknown top-level keys {unknown}; expected some of {sorted(known)}")
        if "run_id" not in raw:
            raise ConfigError(f'{where}: run_id is missing: add run_id = "..." at the top')
        top = {name: raw[name] for name in ("run_id", "allowlist", "bootstrap") if name in raw}
        kwargs = section_values("", cls, top, where=where)
        for name, klass in sections.items():
            base = base_dir if name in ("model", "data") else None
            values = section_values(name, klass, raw.get(name, {}), where=where, base_dir=base)
            kwargs[name] = build_section(name, klass, values, where=where)
        return build_section("", cls, kwargs, where=where)

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
